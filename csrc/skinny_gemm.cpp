// y^T = W x^T for few rows of x (decode batches), float32 or bfloat16, on the CPU.
//
// A decode step multiplies every weight matrix by a handful of activation rows.
// BLAS sgemm is tuned for large products; for 1-64 rows streaming the weights
// from memory it leaves much of the machine idle. This kernel reads each weight
// element once and uses it for every row from registers: x is packed
// transposed ([K][M padded to the vector width]), and an outer-product
// micro-kernel keeps an R (weight rows) x C vectors (activation rows) tile of
// accumulators in registers while it walks K. Weight rows are split across
// OpenMP threads.
//
// One template, compiled per instruction set (cpu_kernels.h):
//   baseline, avx2: 8-float vectors, 6 x 16 tiles (12 accumulators + 2 x + 1
//     broadcast: 15 of AVX2's 16 registers);
//   avx512: 16-float vectors, 12 x 32 tiles (24 + 2 + 1 of 32 registers), or
//     8-float ones when at most 8 rows (half the lanes would be padding);
//   avx512bf16 with bfloat16 weights: x rounded to bfloat16 and packed in K
//     pairs ([K/2][M][2]); vdpbf16ps multiplies one broadcast weight pair by 16
//     rows' pairs, two K steps per instruction, accumulating in float32 (the
//     outer form); up to kDotRows rows the dot form with lanes along K instead
//     (tile_dot16), whose 16 accumulators are summed by one shuffle tree.
// Elsewhere bfloat16 weights are widened to float32 as they are broadcast, so
// the weights are still read at half float32's bytes.
#include "cpu_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if RS_X86
#include <immintrin.h>
#endif

namespace radixserve {
namespace {

RS_ALWAYS_INLINE float to_f32(float x) { return x; }
RS_ALWAYS_INLINE float to_f32(uint16_t x) { return bf16_to_f32(x); }

// mw results of one y^T row, from float32 to the output type. (GCC 12 cannot see
// that the tiles write every lane read here.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
RS_ALWAYS_INLINE void store_row(float* dst, const float* v, int64_t mw) {
  std::memcpy(dst, v, static_cast<size_t>(mw) * sizeof(float));
}
RS_ALWAYS_INLINE void store_row(uint16_t* dst, const float* v, int64_t mw) {
  for (int64_t m = 0; m < mw; ++m) dst[m] = f32_to_bf16(v[m]);
}
#pragma GCC diagnostic pop

// One tile: R weight rows x C vectors of activation rows, the accumulators in
// registers for the whole walk over K (fully unrolled: R and C are constants).
template <typename V, int R, int C, typename WT, typename YT>
RS_ALWAYS_INLINE void tile(const WT* W, const float* xp, YT* yT, int64_t n, int64_t K, int64_t M,
                           int64_t Mp, int64_t m0, int64_t mw) {
  constexpr int L = lanes<V>();
  V acc[R][C];
  const WT* w[R];
  for (int r = 0; r < R; ++r) {
    w[r] = W + (n + r) * K;
    for (int c = 0; c < C; ++c) acc[r][c] = splat<V>(0);
  }
  const float* xk = xp + m0;
  for (int64_t k = 0; k < K; ++k, xk += Mp) {
    V x[C];
    for (int c = 0; c < C; ++c) x[c] = loadv<V>(xk + L * c);
    for (int r = 0; r < R; ++r) {
      const float b = to_f32(w[r][k]);
      for (int c = 0; c < C; ++c) acc[r][c] += x[c] * b;  // the scalar is broadcast
    }
  }
  float out[L * C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) storev(out + L * c, acc[r][c]);
    store_row(yT + (n + r) * M + m0, out, mw);
  }
}

// Every chunk of 2 vectors of x against one weight tile before the next tile:
// the tile's rows stay in L1 while x (small) is re-read. Mp is a multiple of L.
template <typename V, int R, typename WT, typename YT>
RS_ALWAYS_INLINE void tile_row(const WT* W, const float* xp, YT* yT, int64_t n, int64_t K,
                               int64_t M, int64_t Mp) {
  constexpr int L = lanes<V>();
  const int64_t full = Mp / (2 * L) * (2 * L);
  for (int64_t m0 = 0; m0 < full; m0 += 2 * L)
    tile<V, R, 2>(W, xp, yT, n, K, M, Mp, m0, std::min<int64_t>(M - m0, 2 * L));
  if (full < Mp) tile<V, R, 1>(W, xp, yT, n, K, M, Mp, full, M - full);
}

// Rows [n0, n1) of y^T.
template <typename V, int R, typename WT, typename YT>
RS_ALWAYS_INLINE void gemm_rows(const WT* W, const float* xp, YT* yT, int64_t n0, int64_t n1,
                                int64_t K, int64_t M, int64_t Mp) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) tile_row<V, R>(W, xp, yT, n, K, M, Mp);
  for (; n < n1; ++n) tile_row<V, 1>(W, xp, yT, n, K, M, Mp);
}

template <typename WT, typename YT>
void rows_baseline(const WT* W, const float* xp, YT* yT, int64_t n0, int64_t n1, int64_t K,
                   int64_t M, int64_t Mp) {
  gemm_rows<v8, 6>(W, xp, yT, n0, n1, K, M, Mp);
}

template <typename WT, typename YT>
RS_TARGET_AVX2 void rows_avx2(const WT* W, const float* xp, YT* yT, int64_t n0, int64_t n1,
                              int64_t K, int64_t M, int64_t Mp) {
  gemm_rows<v8, 6>(W, xp, yT, n0, n1, K, M, Mp);
}

template <typename WT, typename YT>
RS_TARGET_AVX512 void rows_avx512(const WT* W, const float* xp, YT* yT, int64_t n0, int64_t n1,
                                  int64_t K, int64_t M, int64_t Mp) {
  if (Mp <= 8) {
    gemm_rows<v8, 12>(W, xp, yT, n0, n1, K, M, Mp);
  } else {
    gemm_rows<v16, 12>(W, xp, yT, n0, n1, K, M, Mp);
  }
}

// The avx512bf16 forms read R weight rows side by side, R streams at a row's stride,
// which the hardware prefetchers follow poorly: one thread read them from memory at
// 9-10 GB/s where a plain sequential read reaches 21 (AMD Zen 4). So each tile
// prefetches into L2 the rows kPrefetchRows further on, as far as the thread's own
// range goes ([n0, n1): no line is fetched for another thread's rows).
constexpr int64_t kPrefetchRows = 64;

inline const uint16_t* prefetch_rows(const uint16_t* W, int64_t n, int64_t R, int64_t n1,
                                     int64_t K) {
  return n + kPrefetchRows + R <= n1 ? W + (n + kPrefetchRows) * K : nullptr;
}

#if RS_X86
template <int L>
struct DpVec;
template <>
struct DpVec<16> {
  typedef __m512 F;
  typedef __m512bh B;
};
template <>
struct DpVec<8> {
  typedef __m256 F;
  typedef __m256bh B;
};

// The vdpbf16ps tile: xp is [ceil(K/2)][Mp][2] bfloat16 (the pair past an odd K
// is (x[K-1], 0)); L = 16 uses zmm registers, L = 8 ymm.
template <int L, int R, int C, typename YT>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void tile_dp(const uint16_t* W, const uint16_t* xp, YT* yT,
                                                   int64_t n, int64_t K, int64_t M, int64_t Mp,
                                                   int64_t m0, int64_t mw, const uint16_t* pf) {
  typedef typename DpVec<L>::F F;
  typedef typename DpVec<L>::B B;
  F acc[R][C];
  const uint16_t* w[R];
  for (int r = 0; r < R; ++r) {
    w[r] = W + (n + r) * K;
    for (int c = 0; c < C; ++c) {
      if constexpr (L == 16) acc[r][c] = _mm512_setzero_ps();
      else acc[r][c] = _mm256_setzero_ps();
    }
  }
  const int64_t K2 = K / 2;
  const uint16_t* xk = xp + 2 * m0;
  for (int64_t k2 = 0; k2 <= K2; ++k2, xk += 2 * Mp) {
    if (k2 == K2 && !(K & 1)) break;
    B x[C];
    for (int c = 0; c < C; ++c) {
      if constexpr (L == 16) x[c] = (B)_mm512_loadu_si512(xk + 2 * L * c);
      else x[c] = (B)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xk + 2 * L * c));
    }
    if (pf && (k2 & 15) == 0)  // a cache line of each row per 16 pairs
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(pf + r * K + 2 * k2), _MM_HINT_T1);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      if (k2 < K2) {
        std::memcpy(&pair, w[r] + 2 * k2, sizeof pair);
      } else {
        pair = w[r][K - 1];  // the odd last element, with a zero partner
      }
      for (int c = 0; c < C; ++c) {
        if constexpr (L == 16)
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (B)_mm512_set1_epi32(static_cast<int>(pair)), x[c]);
        else
          acc[r][c] = _mm256_dpbf16_ps(acc[r][c], (B)_mm256_set1_epi32(static_cast<int>(pair)), x[c]);
      }
    }
  }
  float out[L * C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      if constexpr (L == 16) _mm512_storeu_ps(out + L * c, acc[r][c]);
      else _mm256_storeu_ps(out + L * c, acc[r][c]);
    }
    store_row(yT + (n + r) * M + m0, out, mw);
  }
}

// The first pass over the tile's rows prefetches those kPrefetchRows further on.
template <int L, int R, typename YT>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void tile_dp_row(const uint16_t* W, const uint16_t* xp,
                                                       YT* yT, int64_t n, int64_t K, int64_t M,
                                                       int64_t Mp, const uint16_t* pf) {
  const int64_t full = Mp / (2 * L) * (2 * L);
  for (int64_t m0 = 0; m0 < full; m0 += 2 * L, pf = nullptr)
    tile_dp<L, R, 2>(W, xp, yT, n, K, M, Mp, m0, std::min<int64_t>(M - m0, 2 * L), pf);
  if (full < Mp) tile_dp<L, R, 1>(W, xp, yT, n, K, M, Mp, full, M - full, pf);
}

template <int L, typename YT>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void dp_rows(const uint16_t* W, const uint16_t* xp, YT* yT,
                                                   int64_t n0, int64_t n1, int64_t K, int64_t M,
                                                   int64_t Mp) {
  int64_t n = n0;
  for (; n + 12 <= n1; n += 12)
    tile_dp_row<L, 12>(W, xp, yT, n, K, M, Mp, prefetch_rows(W, n, 12, n1, K));
  for (; n < n1; ++n) tile_dp_row<L, 1>(W, xp, yT, n, K, M, Mp, nullptr);
}

// The sum of a vector's 16 lanes (halving with shuffles; GCC 12's cast intrinsics
// warn about their undefined upper halves).
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE float hsum16(__m512 a) {
  const v16 v = (v16)a;
  const v8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  typedef float v4 __attribute__((vector_size(16)));
  const v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// The dot form, for few rows: each vdpbf16ps multiplies 32 consecutive weights of
// one row by the same 32 elements of one x row (xr: [M][K] bfloat16), so no lane
// is padding whatever M is; a tile of R weight rows x MM x rows keeps R * MM
// accumulators, summed across lanes at the end. A K not a multiple of 32 ends
// with masked loads (nothing past a row is read).
template <int R, int MM, typename YT>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void tile_dot(const uint16_t* W, const uint16_t* xr,
                                                    YT* yT, int64_t n, int64_t K, int64_t M,
                                                    int64_t m0) {
  __m512 acc[R][MM];
  const uint16_t* w[R];
  const uint16_t* x[MM];
  for (int r = 0; r < R; ++r) {
    w[r] = W + (n + r) * K;
    for (int j = 0; j < MM; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int j = 0; j < MM; ++j) x[j] = xr + (m0 + j) * K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh xv[MM];
    for (int j = 0; j < MM; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(x[j] + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[r] + k);
      for (int j = 0; j < MM; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, xv[j]);
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh xv[MM];
    for (int j = 0; j < MM; ++j) xv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[j] + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[r] + k);
      for (int j = 0; j < MM; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, xv[j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < MM; ++j) {
      const float v = hsum16(acc[r][j]);
      store_row(yT + (n + r) * M + m0 + j, &v, 1);
    }
  }
}

// R weight rows against every x row, four at a time (the tile's weights stay in
// L1 between the groups of four).
template <int R, typename YT>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void tile_dot_row(const uint16_t* W, const uint16_t* xr,
                                                        YT* yT, int64_t n, int64_t K,
                                                        int64_t M) {
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) tile_dot<R, 4>(W, xr, yT, n, K, M, m0);
  switch (M - m0) {
    case 3:
      tile_dot<R, 3>(W, xr, yT, n, K, M, m0);
      break;
    case 2:
      tile_dot<R, 2>(W, xr, yT, n, K, M, m0);
      break;
    case 1:
      tile_dot<R, 1>(W, xr, yT, n, K, M, m0);
      break;
    default:
      break;
  }
}

// As many weight rows per tile as the 32 registers hold with MM = min(M, 4) x rows.
template <int R, typename YT>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void dot_rows_r(const uint16_t* W, const uint16_t* xr,
                                                      YT* yT, int64_t n0, int64_t n1, int64_t K,
                                                      int64_t M) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) tile_dot_row<R>(W, xr, yT, n, K, M);
  for (; n < n1; ++n) tile_dot_row<1>(W, xr, yT, n, K, M);
}

template <typename YT>
RS_TARGET_AVX512BF16 void rows_dot_avx512bf16(const uint16_t* W, const uint16_t* xr, YT* yT,
                                              int64_t n0, int64_t n1, int64_t K, int64_t M,
                                              int64_t /*Mp*/) {
  switch (M) {
    case 1:
      dot_rows_r<12>(W, xr, yT, n0, n1, K, M);
      break;
    case 2:
      dot_rows_r<8>(W, xr, yT, n0, n1, K, M);
      break;
    case 3:
      dot_rows_r<6>(W, xr, yT, n0, n1, K, M);
      break;
    default:
      dot_rows_r<4>(W, xr, yT, n0, n1, K, M);
      break;
  }
}

// The dot form's sums of 16 outputs at once: lane i of the result is the sum of
// acc[i]'s 16 lanes. Shuffles pair up the vectors in four halving steps (within
// 128-bit lanes, then across them), 30 shuffles and 15 adds for 16 sums, where a
// horizontal sum per output takes about 9 operations. Every output's lanes are
// added in the same order, wherever it sits among the 16:
// ((l0 + l2) + (l1 + l3)) + ((l4 + l6) + (l5 + l7)), the same for lanes 8-15, then
// the two halves.
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE __m512 sum16(const __m512* acc) {
  // (GCC vector shuffles: GCC 12's shuffle intrinsics warn about their undefined
  // pass-through operands.) unpcklps/unpckhps, unpcklpd/unpckhpd, then shuf_f32x4.
  v16 s1[8], s2[4], s3[2];
  for (int p = 0; p < 8; ++p) {
    const v16 a = (v16)acc[2 * p], b = (v16)acc[2 * p + 1];
    s1[p] = __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
            __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  }
  for (int q = 0; q < 4; ++q) {
    const v16 u = s1[2 * q], v = s1[2 * q + 1];
    s2[q] = __builtin_shufflevector(u, v, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
            __builtin_shufflevector(u, v, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  for (int h = 0; h < 2; ++h) {
    const v16 x = s2[2 * h], y = s2[2 * h + 1];
    s3[h] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  const v16 x = s3[0], y = s3[1];
  return (__m512)(
      __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
      __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31));
}

// The dot form with its sums taken 16 outputs at a time (sum16): a tile of R weight
// rows x MM x rows (R * MM <= 16) keeps R * MM accumulators whose lanes run along K,
// each vdpbf16ps multiplying 32 consecutive weights of a row by the same 32
// elements of an x row (xr: [M][K] bfloat16); the weights are read once per tile
// and x from L1. Accumulator r * MM + j is output (n + r, m0 + j); the unused ones
// of a tile are zero. A K not a multiple of 32 ends with masked loads.
template <int R, int MM, typename YT>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void tile_dot16(const uint16_t* W, const uint16_t* xr,
                                                      YT* yT, int64_t n, int64_t K, int64_t M,
                                                      int64_t m0, const uint16_t* pf) {
  static_assert(R * MM <= 16, "one vector of sums per tile");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const uint16_t* w = W + n * K;
  const uint16_t* x = xr + m0 * K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh xv[MM];
    if (pf)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(pf + r * K + k), _MM_HINT_T1);
    for (int j = 0; j < MM; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(x + j * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * K + k);
      for (int j = 0; j < MM; ++j) acc[r * MM + j] = _mm512_dpbf16_ps(acc[r * MM + j], wv, xv[j]);
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh xv[MM];
    for (int j = 0; j < MM; ++j) xv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + j * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
      for (int j = 0; j < MM; ++j) acc[r * MM + j] = _mm512_dpbf16_ps(acc[r * MM + j], wv, xv[j]);
    }
  }
  float out[16];
  _mm512_storeu_ps(out, sum16(acc));
  for (int r = 0; r < R; ++r) store_row(yT + (n + r) * M + m0, out + r * MM, MM);
}

// R weight rows against x rows [m0, m0 + mm), R * mm <= 16, in one tile.
template <int R, typename YT>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void tile_dot16_group(const uint16_t* W,
                                                            const uint16_t* xr, YT* yT,
                                                            int64_t n, int64_t K, int64_t M,
                                                            int64_t m0, int64_t mm,
                                                            const uint16_t* pf) {
  switch (mm) {
    case 1:
      tile_dot16<R, 1>(W, xr, yT, n, K, M, m0, pf);
      break;
    case 2:
      if constexpr (R <= 8) tile_dot16<R, 2>(W, xr, yT, n, K, M, m0, pf);
      break;
    case 3:
      if constexpr (R <= 5) tile_dot16<R, 3>(W, xr, yT, n, K, M, m0, pf);
      break;
    default:
      if constexpr (R <= 4) tile_dot16<R, 4>(W, xr, yT, n, K, M, m0, pf);
      break;
  }
}

// R weight rows against every x row, G at a time (the rows stay in L1 between the
// groups); the first group prefetches the rows kPrefetchRows further on.
template <int R, int G, typename YT>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void tile_dot16_row(const uint16_t* W, const uint16_t* xr,
                                                          YT* yT, int64_t n, int64_t K,
                                                          int64_t M, const uint16_t* pf) {
  static_assert(R * G <= 16 && G <= 4, "one vector of sums per tile");
  for (int64_t m0 = 0; m0 < M; m0 += G, pf = nullptr)
    tile_dot16_group<R>(W, xr, yT, n, K, M, m0, std::min<int64_t>(M - m0, G), pf);
}

template <int R, int G, typename YT>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void dot16_rows_r(const uint16_t* W, const uint16_t* xr,
                                                        YT* yT, int64_t n0, int64_t n1,
                                                        int64_t K, int64_t M) {
  int64_t n = n0;
  for (; n + R <= n1; n += R)
    tile_dot16_row<R, G>(W, xr, yT, n, K, M, prefetch_rows(W, n, R, n1, K));
  for (; n < n1; ++n) tile_dot16_row<1, G>(W, xr, yT, n, K, M, nullptr);
}

// Tiles of 16 weight rows x 1 x row, 8 x 2, else 4 x 4 (x rows in groups of four;
// the weights are read from memory once, in the first group). Four x four was
// faster than 2 x 8 from 3 to 16 rows (Zen 4, weights streaming from memory).
template <typename YT>
RS_TARGET_AVX512BF16 void rows_dot16_avx512bf16(const uint16_t* W, const uint16_t* xr, YT* yT,
                                                int64_t n0, int64_t n1, int64_t K, int64_t M,
                                                int64_t /*Mp*/) {
  switch (M) {
    case 1:
      dot16_rows_r<16, 1>(W, xr, yT, n0, n1, K, M);
      break;
    case 2:
      dot16_rows_r<8, 2>(W, xr, yT, n0, n1, K, M);
      break;
    default:
      dot16_rows_r<4, 4>(W, xr, yT, n0, n1, K, M);
      break;
  }
}

template <typename YT>
RS_TARGET_AVX512BF16 void rows_avx512bf16(const uint16_t* W, const uint16_t* xp, YT* yT,
                                          int64_t n0, int64_t n1, int64_t K, int64_t M,
                                          int64_t Mp) {
  if (Mp <= 8) {
    dp_rows<8>(W, xp, yT, n0, n1, K, M, Mp);
  } else {
    dp_rows<16>(W, xp, yT, n0, n1, K, M, Mp);
  }
}
#endif

// x [M, K] (strides sm, sk) as float32, packed [K][Mp], zero-padded.
template <typename XT>
void pack_f32(const XT* x, int64_t sm, int64_t sk, int64_t K, int64_t M, int64_t Mp, float* xp) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t m = 0; m < M; ++m) xp[k * Mp + m] = to_f32(x[m * sm + k * sk]);
}

// x as bfloat16 pairs, packed [ceil(K/2)][Mp][2], zero-padded.
template <typename XT>
void pack_pairs(const XT* x, int64_t sm, int64_t sk, int64_t K, int64_t M, int64_t Mp,
                uint16_t* xp) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t m = 0; m < M; ++m) {
      const XT v = x[m * sm + k * sk];
      uint16_t b;
      if constexpr (std::is_same<XT, float>::value) b = f32_to_bf16(v);
      else b = v;
      xp[(k / 2) * 2 * Mp + 2 * m + (k & 1)] = b;
    }
}

// Blocks of 48 weight rows (a multiple of every tile height): enough per item to
// amortise the set-up, and enough items (N / 48) to balance the threads.
constexpr int64_t kBlock = 48;

template <typename WT, typename YT, typename Rows, typename XP>
void run_blocks(Rows rows, const WT* W, const XP* xp, YT* yT, int64_t N, int64_t K, int64_t M,
                int64_t Mp, int num_threads) {
  const int64_t nblocks = (N + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t b = 0; b < nblocks; ++b)
    rows(W, xp, yT, b * kBlock, std::min(N, (b + 1) * kBlock), K, M, Mp);
}

template <typename WT, typename YT>
void run_f32(const SkinnyGemm& g, Isa isa, int num_threads) {
  const int64_t K = g.K, M = g.M;
  // avx512 uses 16-float vectors above 8 rows.
  const int64_t width = (isa >= Isa::kAvx512 && M > 8) ? 16 : 8;
  const int64_t Mp = (M + width - 1) / width * width;
  std::vector<float> xp(static_cast<size_t>(K * Mp), 0.0f);
  if (g.x_type == DType::kFloat32)
    pack_f32(static_cast<const float*>(g.x), g.sm, g.sk, K, M, Mp, xp.data());
  else
    pack_f32(static_cast<const uint16_t*>(g.x), g.sm, g.sk, K, M, Mp, xp.data());
  const WT* W = static_cast<const WT*>(g.W);
  YT* yT = static_cast<YT*>(g.yT);
  switch (isa) {
    case Isa::kBaseline:
      run_blocks(rows_baseline<WT, YT>, W, xp.data(), yT, g.N, K, M, Mp, num_threads);
      break;
    case Isa::kAvx2:
      run_blocks(rows_avx2<WT, YT>, W, xp.data(), yT, g.N, K, M, Mp, num_threads);
      break;
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
      run_blocks(rows_avx512<WT, YT>, W, xp.data(), yT, g.N, K, M, Mp, num_threads);
      break;
  }
}

#if RS_X86
// Up to this many rows the avx512bf16 product takes the dot form with sums of 16
// outputs at once (each weight vector meets few rows; the outer form's broadcasts,
// and its padding lanes up to 16, would bound it); from 16 rows the outer form was
// faster (Zen 4, weights streaming from memory; docs/cpu-kernels.md).
constexpr int64_t kDotRows = 12;

// rows() over each thread's contiguous range of 48-row blocks (the prefetches stop
// at its end).
template <typename YT, typename Rows, typename XP>
void run_ranges(Rows rows, const uint16_t* W, const XP* xp, YT* yT, int64_t N, int64_t K,
                int64_t M, int64_t Mp, int num_threads) {
  const int64_t nblocks = (N + kBlock - 1) / kBlock;
  split_items(nblocks, num_threads, [&](int64_t b0, int64_t b1) {
    rows(W, xp, yT, b0 * kBlock, std::min(N, b1 * kBlock), K, M, Mp);
  });
}

// x [M, K] as bfloat16 rows [M][K] (the dot forms' operand).
void pack_rows(const SkinnyGemm& g, uint16_t* xr) {
  const int64_t K = g.K;
  for (int64_t m = 0; m < g.M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      if (g.x_type == DType::kFloat32)
        xr[m * K + k] = f32_to_bf16(static_cast<const float*>(g.x)[m * g.sm + k * g.sk]);
      else
        xr[m * K + k] = static_cast<const uint16_t*>(g.x)[m * g.sm + k * g.sk];
    }
}

template <typename YT>
void run_dp(const SkinnyGemm& g, int num_threads) {
  const int64_t K = g.K, M = g.M;
  SkinnyForm form = g.form;
  if (form == SkinnyForm::kAuto)
    form = M <= kDotRows && !g.invariant ? SkinnyForm::kDot16 : SkinnyForm::kOuter;
  if (form == SkinnyForm::kDot || form == SkinnyForm::kDot16) {
    std::vector<uint16_t> xr(static_cast<size_t>(M * K));
    pack_rows(g, xr.data());
    const uint16_t* W = static_cast<const uint16_t*>(g.W);
    if (form == SkinnyForm::kDot)
      run_blocks(rows_dot_avx512bf16<YT>, W, xr.data(), static_cast<YT*>(g.yT), g.N, K, M, M,
                 num_threads);
    else
      run_ranges(rows_dot16_avx512bf16<YT>, W, xr.data(), static_cast<YT*>(g.yT), g.N, K, M, M,
                 num_threads);
    return;
  }
  const int64_t width = M > 8 ? 16 : 8;
  const int64_t Mp = (M + width - 1) / width * width;
  std::vector<uint16_t> xp(static_cast<size_t>((K + 1) / 2 * 2 * Mp), 0);
  if (g.x_type == DType::kFloat32)
    pack_pairs(static_cast<const float*>(g.x), g.sm, g.sk, K, M, Mp, xp.data());
  else
    pack_pairs(static_cast<const uint16_t*>(g.x), g.sm, g.sk, K, M, Mp, xp.data());
  run_ranges(rows_avx512bf16<YT>, static_cast<const uint16_t*>(g.W), xp.data(),
             static_cast<YT*>(g.yT), g.N, K, M, Mp, num_threads);
}
#endif

}  // namespace

void skinny_gemm(const SkinnyGemm& g, Isa isa, int num_threads) {
  const bool y32 = g.y_type == DType::kFloat32;
  if (g.w_type == DType::kFloat32) {
    run_f32<float, float>(g, isa, num_threads);
    return;
  }
#if RS_X86
  if (isa == Isa::kAvx512Bf16) {
    if (y32) run_dp<float>(g, num_threads);
    else run_dp<uint16_t>(g, num_threads);
    return;
  }
#endif
  if (y32) run_f32<uint16_t, float>(g, isa, num_threads);
  else run_f32<uint16_t, uint16_t>(g, isa, num_threads);
}

}  // namespace radixserve
