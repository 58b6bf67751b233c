// y^T = W x^T for few rows of x (decode batches): float32 on the CPU.
//
// A decode step multiplies every weight matrix by a handful of activation rows.
// BLAS sgemm is tuned for large products; for 1-64 rows streaming the weights
// from memory it leaves much of the machine idle. This kernel reads each weight
// element once and uses it for every row from registers: x is packed
// transposed ([K][M padded to 8]), and an outer-product micro-kernel keeps a
// 6 (weight rows) x 16 (activation rows) tile of accumulators in vector
// registers while it walks K. Weight rows are split across OpenMP threads.
//
// Vectors are GCC/clang vector extensions (8 floats); the loop is compiled for
// AVX2+FMA and for baseline x86-64 and the loader picks one (target_clones).
#include "cpu_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace radixserve {
namespace {

// One tile: R weight rows x C*8 activation rows, the accumulators in vector
// registers for the whole walk over K (fully unrolled: R and C are constants).
template <int R, int C>
RS_ALWAYS_INLINE void tile(const float* W, const float* xp, float* yT, int64_t n, int64_t K,
                           int64_t M, int64_t Mp, int64_t m0, int64_t mw) {
  v8 acc[R][C];
  const float* w[R];
  for (int r = 0; r < R; ++r) {
    w[r] = W + (n + r) * K;
    for (int c = 0; c < C; ++c) acc[r][c] = splat8(0);
  }
  const float* xk = xp + m0;
  for (int64_t k = 0; k < K; ++k, xk += Mp) {
    v8 x[C];
    for (int c = 0; c < C; ++c) x[c] = load8(xk + 8 * c);
    for (int r = 0; r < R; ++r) {
      const float b = w[r][k];
      for (int c = 0; c < C; ++c) acc[r][c] += x[c] * b;  // the scalar is broadcast
    }
  }
  float out[8 * C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) store8(out + 8 * c, acc[r][c]);
    std::memcpy(yT + (n + r) * M + m0, out, static_cast<size_t>(mw) * sizeof(float));
  }
}

// Rows [n0, n1) of y^T (ldy = M), from packed x (xp: [K][Mp]): 16 activation rows
// at a time against 6 weight rows (12 accumulators + 2 x vectors + 1 broadcast:
// 15 of AVX2's 16 registers), 8 at a time for the last 8.
RS_CLONES void gemm_rows(const float* W, const float* xp, float* yT, int64_t n0, int64_t n1,
                         int64_t K, int64_t M, int64_t Mp) {
  // Every 16-row chunk of x against one weight tile before the next tile: the
  // tile's rows stay in L1 while x (small) is re-read.
  const int64_t full = Mp / 16 * 16;  // 16-wide chunks; Mp - full is 0 or 8
  auto chunks = [&](auto tile16, auto tile8, int64_t n) {
    for (int64_t m0 = 0; m0 < full; m0 += 16) tile16(n, m0, std::min<int64_t>(M - m0, 16));
    if (full < Mp) tile8(n, full, M - full);
  };
  int64_t n = n0;
  for (; n + 6 <= n1; n += 6) {
    chunks([&](int64_t nn, int64_t m0, int64_t mw) { tile<6, 2>(W, xp, yT, nn, K, M, Mp, m0, mw); },
           [&](int64_t nn, int64_t m0, int64_t mw) { tile<6, 1>(W, xp, yT, nn, K, M, Mp, m0, mw); },
           n);
  }
  for (; n < n1; ++n) {
    chunks([&](int64_t nn, int64_t m0, int64_t mw) { tile<1, 2>(W, xp, yT, nn, K, M, Mp, m0, mw); },
           [&](int64_t nn, int64_t m0, int64_t mw) { tile<1, 1>(W, xp, yT, nn, K, M, Mp, m0, mw); },
           n);
  }
}

}  // namespace

void skinny_gemm_f32(const float* W, const float* x, int64_t sm, int64_t sk, float* yT, int64_t N,
                     int64_t K, int64_t M, int num_threads) {
  const int64_t Mp = (M + 7) / 8 * 8;
  std::vector<float> xp(static_cast<size_t>(K * Mp), 0.0f);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t m = 0; m < M; ++m) xp[static_cast<size_t>(k * Mp + m)] = x[m * sm + k * sk];
  // Blocks of 48 weight rows (a multiple of the tile height): enough per item
  // to amortise the set-up, and enough items (N / 48) to balance the threads.
  const int64_t block = 48, nblocks = (N + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t b = 0; b < nblocks; ++b) {
    gemm_rows(W, xp.data(), yT, b * block, std::min(N, (b + 1) * block), K, M, Mp);
  }
}

}  // namespace radixserve
