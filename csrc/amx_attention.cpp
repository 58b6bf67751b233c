// The two products of bfloat16 attention over a block of keys on AMX tiles, for the
// native kernel's items that many query vectors read (paged_attention.cpp,
// run_item_dp: a cascade group's shared prefix, a chunk's rows, drafts being
// verified). The operands are the ones the vdpbf16ps path packs; here each
// tdpbf16ps multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one (16 x 16 x 32
// products) where vdpbf16ps does 16 x 2:
//   scores  C [16 query vectors][16 keys] += Q [16][32 features] . K^T, with Q's rows
//           (qp, pairs of features) as they are and K transposed into pairs (kt:
//           [D / 2][32 keys] pairs), so a B tile is 16 feature pairs x 16 keys;
//   values  C [16 query vectors][16 features] += P [16][32 keys] . V, with P's rows in
//           key pairs (pp) and V interleaved in key pairs (vp: [key pairs][D] pairs).
// Products of bfloat16 pairs are exact in float32 and summed in float32 (in the
// tiles' order, not the vdpbf16ps loops'); the scale is applied to the summed score
// as there. Tile instructions run only after amx_tiles_granted() (amx_gemm.cpp).
#include <algorithm>
#include <cstdint>

#include "cpu_kernels.h"

#if RS_X86
#include <immintrin.h>
#endif

namespace radixserve {

#if RS_X86

RS_TARGET_AMX bool amx_attention_begin() {
  if (!amx_tiles_granted()) return false;
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int i = 0; i < 8; ++i) {  // every tile 16 rows x 64 bytes
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  // The compiler does not see ldtilecfg read cfg: without the barrier it may drop the
  // stores above as dead.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
  return true;
}

RS_TARGET_AMX void amx_attention_end() { _tile_release(); }

// tmm0-1: scores of 16 query vectors x keys 0-15 / 16-31; tmm2: 16 query vectors x 16
// feature pairs; tmm3-4: 16 feature pairs x keys 0-15 / 16-31.
RS_TARGET_AMX void amx_score_tile(const uint32_t* qp, int64_t nq, int64_t D2,
                                       const uint32_t* kt, float scale, float* sc,
                                       int64_t len, int64_t j0, int64_t nb) {
  alignas(64) float c[2][16][16];
  const bool two = nb > 16;
  const __m512 s = _mm512_set1_ps(scale);
  const __mmask16 m0 = static_cast<__mmask16>(nb >= 16 ? 0xffffu : (1u << nb) - 1);
  const __mmask16 m1 =
      static_cast<__mmask16>(nb >= 32 ? 0xffffu : two ? (1u << (nb - 16)) - 1 : 0u);
  for (int64_t i0 = 0; i0 < nq; i0 += 16) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t p = 0; p < D2; p += 16) {
      _tile_loadd(2, qp + i0 * D2 + p, D2 * 4);
      _tile_loadd(3, kt + p * 32, 128);
      _tile_dpbf16ps(0, 2, 3);
      if (two) {
        _tile_loadd(4, kt + p * 32 + 16, 128);
        _tile_dpbf16ps(1, 2, 4);
      }
    }
    _tile_stored(0, c[0], 64);
    if (two) _tile_stored(1, c[1], 64);
    const int64_t rows = std::min<int64_t>(16, nq - i0);
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = sc + (i0 + r) * len + j0;
      _mm512_mask_storeu_ps(dst, m0, _mm512_mul_ps(_mm512_load_ps(c[0][r]), s));
      if (two) _mm512_mask_storeu_ps(dst + 16, m1, _mm512_mul_ps(_mm512_load_ps(c[1][r]), s));
    }
  }
}

// tmm0-3: 16 query vectors x features d0 + 16c (c < 4); tmm4: 16 query vectors x 16 key
// pairs; tmm5: 16 key pairs x 16 features.
RS_TARGET_AMX void amx_value_rows(const uint32_t* pp, int64_t nq, int64_t np2p,
                                       int64_t pp_stride, const uint32_t* vp, int64_t D,
                                       float* out) {
  alignas(64) float c[4][16][16];
  for (int64_t i0 = 0; i0 < nq; i0 += 16) {
    const int64_t rows = std::min<int64_t>(16, nq - i0);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int cols = static_cast<int>(std::min<int64_t>(4, (D - d0) / 16));
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kp = 0; kp < np2p; kp += 16) {
        _tile_loadd(4, pp + i0 * pp_stride + kp, pp_stride * 4);
        const uint32_t* v = vp + kp * D + d0;
        // Tile numbers are immediates: one branch per accumulator.
        _tile_loadd(5, v, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        if (cols > 1) {
          _tile_loadd(6, v + 16, D * 4);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (cols > 2) {
          _tile_loadd(7, v + 32, D * 4);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (cols > 3) {
          _tile_loadd(5, v + 48, D * 4);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, c[0], 64);
      if (cols > 1) _tile_stored(1, c[1], 64);
      if (cols > 2) _tile_stored(2, c[2], 64);
      if (cols > 3) _tile_stored(3, c[3], 64);
      for (int64_t r = 0; r < rows; ++r)
        for (int cc = 0; cc < cols; ++cc)
          _mm512_storeu_ps(out + (i0 + r) * D + d0 + 16 * cc, _mm512_load_ps(c[cc][r]));
    }
  }
}

#else

bool amx_attention_begin() { return false; }
void amx_attention_end() {}
void amx_score_tile(const uint32_t*, int64_t, int64_t, const uint32_t*, float, float*, int64_t,
                    int64_t, int64_t) {}
void amx_value_rows(const uint32_t*, int64_t, int64_t, int64_t, const uint32_t*, int64_t,
                    float*) {}

#endif

}  // namespace radixserve
