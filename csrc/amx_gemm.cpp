// The skinny bfloat16 product on AMX tiles (CPUs with amx_bf16, Sapphire Rapids and
// later), for decode batches of 1 to 32 rows.
//
// yT [N, M] = W [N, K] . x^T with W bfloat16 row-major as it lies: a 16 x 32 tile
// of W (16 weight rows, 32 consecutive K) is read straight from the matrix with
// the row stride, and x^T is packed once per call into the tiles' pair layout
// ([K / 2][16 rows of x][2], zero-padded to 16 or 32 rows). Per 32 weight rows and
// 32 K: two W tiles, one or two x tiles, up to four tdpbf16ps into four float32
// accumulator tiles (32 weight rows x 32 x rows). oneDNN's AMX product of the same
// shape (what Linear called here before) reaches about half the memory bandwidth
// at these sizes, each call paying its set-up; here the weights stream once.
// Sums are float32 (exact products of bfloat16 pairs); the result is rounded once.
//
// AMX instructions run only where CPUID says the CPU has them and the OS granted
// this process the tile state (amx_tiles_granted checks both once; callers refuse
// otherwise, and callers then fall back to the skinny kernel); nothing else in the
// extension issues them, so the build still runs on any x86-64 CPU.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if RS_X86
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace radixserve {

#if RS_X86
// Linux hands out the AMX tile state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); torch's own probe asks too, and a
// second request is harmless.
// The CPU's own word first (CPUID leaf 7: EDX bit 24 AMX-TILE, bit 22 AMX-BF16), so
// that a caller's flag alone can never run a tile instruction on a CPU without them.
bool amx_tiles_granted() {
  static const bool granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1u) || !((d >> 22) & 1u)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
}

namespace {

// tmm0-3: float32 accumulators (weight rows n..n+15 / n+16..n+31 x x rows 0-15 /
// 16-31); tmm4-5: W tiles; tmm6-7: x tiles. All 16 rows x 64 bytes.

// A stored accumulator tile's 16 rows into yT [N, M] at (n, m0): 16 x rows at a
// time, masked past M, rounded once to bfloat16 (or kept in float32).
template <typename YT>
RS_TARGET_AMX RS_ALWAYS_INLINE void store_tile(const float (*c)[16], YT* yT, int64_t n,
                                               int64_t m0, int64_t M) {
  const int64_t len = std::min<int64_t>(16, M - m0);
  const __mmask16 mask = static_cast<__mmask16>((1u << len) - 1);
  for (int r = 0; r < 16; ++r) {
    YT* out = yT + (n + r) * M + m0;
    const __m512 v = _mm512_load_ps(c[r]);
    if constexpr (sizeof(YT) == 2) {
      _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(v));
    } else {
      _mm512_mask_storeu_ps(out, mask, v);
    }
  }
}

template <typename YT>
RS_TARGET_AMX void amx_range(const uint16_t* W, const uint16_t* xp, YT* yT, int64_t n0,
                             int64_t n1, int64_t K, int64_t M, int64_t mb) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
  const int64_t wstride = K * 2;      // bytes between weight rows
  const int64_t xblock = K / 2 * 32;  // uint16 per x tile column block: [K / 2][16][2]
  const int64_t lines = 32 * wstride / 64, steps = K / 32;
  const int64_t lines_per_step = (lines + steps - 1) / steps;
  alignas(64) float c[4][16][16];
  int64_t n = n0;
  for (; n + 32 <= n1; n += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* w0 = W + n * K;
    const uint16_t* w1 = w0 + 16 * K;
    // The next block of 32 rows is one contiguous run of W: with two x tiles (17-32
    // rows, where each K step's four products leave the loads' latency exposed) its
    // lines are asked into L2 evenly over this block's K steps, one sequential stream
    // (the tile loads' 32 strided rows are not a stream the hardware prefetcher
    // follows well). With one x tile the loads alone keep up, and asking costs more.
    const char* next = reinterpret_cast<const char*>(W + (n + 32) * K);
    const bool fetch = mb > 1 && n + 64 <= n1;
    int64_t line = 0;
    for (int64_t k = 0; k < K; k += 32) {
      if (fetch) {
        for (int64_t end = std::min(lines, line + lines_per_step); line < end; ++line)
          _mm_prefetch(next + line * 64, _MM_HINT_T2);
      }
      _tile_loadd(4, w0 + k, wstride);
      _tile_loadd(5, w1 + k, wstride);
      _tile_loadd(6, xp + k * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      if (mb > 1) {
        _tile_loadd(7, xp + xblock + k * 16, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(2, c[2], 64);
    store_tile(c[0], yT, n, 0, M);
    store_tile(c[2], yT, n + 16, 0, M);
    if (mb > 1) {
      _tile_stored(1, c[1], 64);
      _tile_stored(3, c[3], 64);
      store_tile(c[1], yT, n, 16, M);
      store_tile(c[3], yT, n + 16, 16, M);
    }
  }
  for (; n < n1; n += 16) {  // a last block of 16 weight rows
    _tile_zero(0);
    _tile_zero(1);
    const uint16_t* w0 = W + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      _tile_loadd(4, w0 + k, wstride);
      _tile_loadd(6, xp + k * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (mb > 1) {
        _tile_loadd(7, xp + xblock + k * 16, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    store_tile(c[0], yT, n, 0, M);
    if (mb > 1) {
      _tile_stored(1, c[1], 64);
      store_tile(c[1], yT, n, 16, M);
    }
  }
  _tile_release();
}

// Rows m0 .. m0 + 15 of feature k of a feature-major x as bfloat16 (zero past the mask).
RS_TARGET_AMX RS_ALWAYS_INLINE __m256i row16(const SkinnyGemm& g, bool f32, __mmask16 mask,
                                             int64_t k, int64_t m0) {
  if (f32) {
    const float* x = static_cast<const float*>(g.x) + k * g.sk + m0;
    return (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x));
  }
  const uint16_t* x = static_cast<const uint16_t*>(g.x) + k * g.sk + m0;
  return _mm256_maskz_loadu_epi16(mask, x);
}

// x^T in pairs: xp[b][k / 2][j][k % 2] = x[16 b + j][k], zero past M (xp comes zeroed).
// Feature-major x (sm == 1, what the layers hand over) goes 16 rows and a pair of K
// at a time: two 16-value loads, one interleave, one 64-byte store; float32 rows are
// rounded to nearest even as f32_to_bf16 does. Other layouts take the scalar loop.
RS_TARGET_AMX void pack_x(const SkinnyGemm& g, int64_t mb, uint16_t* xp) {
  const int64_t K = g.K, M = g.M, block = K / 2 * 32;
  const bool f32 = g.x_type == DType::kFloat32;
  if (g.sm != 1) {
    for (int64_t k = 0; k < K; ++k) {
      uint16_t* row = xp + (k / 2) * 32 + (k & 1);
      for (int64_t m = 0; m < M; ++m) {
        const int64_t at = m * g.sm + k * g.sk;
        row[(m / 16) * block + (m % 16) * 2] =
            f32 ? f32_to_bf16(static_cast<const float*>(g.x)[at])
                : static_cast<const uint16_t*>(g.x)[at];
      }
    }
    return;
  }
  // Word 2j of the result is a[j], word 2j + 1 is b[j] (b in the upper half).
  alignas(64) static const uint16_t kPairs[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                  21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                  11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_load_si512(kPairs);
  for (int64_t b = 0; b < mb; ++b) {
    const int64_t m0 = 16 * b, n = std::min<int64_t>(16, M - m0);
    const __mmask16 mask = static_cast<__mmask16>(n >= 16 ? 0xffffu : (1u << n) - 1);
    uint16_t* dst = xp + b * block;
    for (int64_t k = 0; k < K; k += 2) {
      const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(row16(g, f32, mask, k, m0)),
                                            row16(g, f32, mask, k + 1, m0), 1);
      _mm512_storeu_si512(dst + (k / 2) * 32, _mm512_permutexvar_epi16(pairs, ab));
    }
  }
}

}  // namespace

bool amx_gemm_takes(const SkinnyGemm& g) {
  return g.w_type == DType::kBFloat16 && g.M >= 1 && g.M <= 32 && g.K % 32 == 0 &&
         g.N % 16 == 0 && g.K > 0 && g.N > 0;
}

bool skinny_gemm_amx(const SkinnyGemm& g, int num_threads) {
  if (!amx_gemm_takes(g) || !amx_tiles_granted()) return false;
  const int64_t K = g.K, M = g.M, mb = M > 16 ? 2 : 1;
  // The caller's thread's buffer (threads in the region below read it through xs).
  static thread_local std::vector<uint16_t> xp;
  xp.assign(static_cast<size_t>(mb * K * 16), 0);
  const uint16_t* xs = xp.data();
  pack_x(g, mb, xp.data());
  const uint16_t* W = static_cast<const uint16_t*>(g.W);
  // Blocks of 32 weight rows shared evenly (a thread's range stays contiguous, so
  // each streams its own part of W and sets its tiles up once).
  const int64_t blocks = (g.N + 31) / 32;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
  const bool y32 = g.y_type == DType::kFloat32;
#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int tid = omp_get_thread_num();
#else
    const int tid = 0;
#endif
    const int64_t lo = blocks * tid / threads * 32;
    const int64_t hi = std::min<int64_t>(g.N, blocks * (tid + 1) / threads * 32);
    if (lo < hi) {
      if (y32) {
        amx_range(W, xs, static_cast<float*>(g.yT), lo, hi, K, M, mb);
      } else {
        amx_range(W, xs, static_cast<uint16_t*>(g.yT), lo, hi, K, M, mb);
      }
    }
  }
  return true;
}

#else

bool amx_tiles_granted() { return false; }
bool amx_gemm_takes(const SkinnyGemm&) { return false; }
bool skinny_gemm_amx(const SkinnyGemm&, int) { return false; }

#endif

}  // namespace radixserve
