// The skinny bfloat16 product on AMX tiles (CPUs with amx_bf16, Sapphire Rapids and
// later), for decode batches of 2 to 32 rows.
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
  alignas(64) float c[4][16][16];
  int64_t n = n0;
  for (; n + 32 <= n1; n += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* w0 = W + n * K;
    const uint16_t* w1 = w0 + 16 * K;
    for (int64_t k = 0; k < K; k += 32) {
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

}  // namespace

bool amx_gemm_takes(const SkinnyGemm& g) {
  return g.w_type == DType::kBFloat16 && g.M >= 1 && g.M <= 32 && g.K % 32 == 0 &&
         g.N % 16 == 0 && g.K > 0 && g.N > 0;
}

bool skinny_gemm_amx(const SkinnyGemm& g, int num_threads) {
  if (!amx_gemm_takes(g) || !amx_tiles_granted()) return false;
  const int64_t K = g.K, M = g.M, mb = M > 16 ? 2 : 1;
  // x^T in pairs: xp[b][k / 2][j][k % 2] = x[16 b + j][k], zero past M. K outside:
  // the layers' x is feature-major (sm == 1), so the inner loop reads contiguously.
  std::vector<uint16_t> xp(static_cast<size_t>(mb * K * 16), 0);
  const int64_t block = K / 2 * 32;
  auto pack = [&](auto convert, const auto* x) {
    for (int64_t k = 0; k < K; ++k) {
      uint16_t* row = xp.data() + (k / 2) * 32 + (k & 1);
      for (int64_t m = 0; m < M; ++m)
        row[(m / 16) * block + (m % 16) * 2] = convert(x[m * g.sm + k * g.sk]);
    }
  };
  if (g.x_type == DType::kFloat32) {
    pack([](float v) { return f32_to_bf16(v); }, static_cast<const float*>(g.x));
  } else {
    pack([](uint16_t v) { return v; }, static_cast<const uint16_t*>(g.x));
  }
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
        amx_range(W, xp.data(), static_cast<float*>(g.yT), lo, hi, K, M, mb);
      } else {
        amx_range(W, xp.data(), static_cast<uint16_t*>(g.yT), lo, hi, K, M, mb);
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
