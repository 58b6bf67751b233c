// y^T = W x^T for few rows of x (decode batches): float32 on the CPU.
//
// A decode step multiplies every weight matrix by a handful of activation rows.
// BLAS sgemm is tuned for large products; for 1-64 rows streaming the weights
// from memory it leaves much of the machine idle. This kernel reads each weight
// element once and uses it for every row from registers: x is packed
// transposed ([K][M padded to 8]), and an outer-product micro-kernel keeps a
// 4 (weight rows) x 16 (activation rows) tile of accumulators in vector
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

// Rows [n0, n1) of y^T (ldy = M), from packed x (xp: [K][Mp]).
RS_CLONES void gemm_rows(const float* W, const float* xp, float* yT, int64_t n0, int64_t n1,
                         int64_t K, int64_t M, int64_t Mp) {
  float tail[16];
  for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
    const bool two = m0 + 8 < Mp;  // a 16-wide tile, else 8-wide
    const int64_t mw = std::min<int64_t>(M - m0, two ? 16 : 8);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
      const float* w0 = W + n * K;
      const float* w1 = w0 + K;
      const float* w2 = w1 + K;
      const float* w3 = w2 + K;
      v8 a00 = splat8(0), a01 = splat8(0), a10 = splat8(0), a11 = splat8(0);
      v8 a20 = splat8(0), a21 = splat8(0), a30 = splat8(0), a31 = splat8(0);
      const float* xk = xp + m0;
      if (two) {
        for (int64_t k = 0; k < K; ++k, xk += Mp) {
          const v8 x0 = load8(xk), x1 = load8(xk + 8);
          const float b0 = w0[k], b1 = w1[k], b2 = w2[k], b3 = w3[k];
          a00 += x0 * b0;  // vector * scalar: the scalar is broadcast
          a01 += x1 * b0;
          a10 += x0 * b1;
          a11 += x1 * b1;
          a20 += x0 * b2;
          a21 += x1 * b2;
          a30 += x0 * b3;
          a31 += x1 * b3;
        }
      } else {
        for (int64_t k = 0; k < K; ++k, xk += Mp) {
          const v8 x0 = load8(xk);
          a00 += x0 * w0[k];
          a10 += x0 * w1[k];
          a20 += x0 * w2[k];
          a30 += x0 * w3[k];
        }
      }
      const v8 lo[4] = {a00, a10, a20, a30}, hi[4] = {a01, a11, a21, a31};
      for (int i = 0; i < 4; ++i) {
        store8(tail, lo[i]);
        store8(tail + 8, hi[i]);
        std::memcpy(yT + (n + i) * M + m0, tail, static_cast<size_t>(mw) * sizeof(float));
      }
    }
    for (; n < n1; ++n) {  // leftover weight rows, one at a time
      const float* w = W + n * K;
      v8 a0 = splat8(0), a1 = splat8(0);
      const float* xk = xp + m0;
      for (int64_t k = 0; k < K; ++k, xk += Mp) {
        a0 += load8(xk) * w[k];
        if (two) a1 += load8(xk + 8) * w[k];
      }
      store8(tail, a0);
      store8(tail + 8, a1);
      std::memcpy(yT + n * M + m0, tail, static_cast<size_t>(mw) * sizeof(float));
    }
  }
}

}  // namespace

void skinny_gemm_f32(const float* W, const float* x, int64_t sm, int64_t sk, float* yT, int64_t N,
                     int64_t K, int64_t M, int num_threads) {
  const int64_t Mp = (M + 7) / 8 * 8;
  std::vector<float> xp(static_cast<size_t>(K * Mp), 0.0f);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t m = 0; m < M; ++m) xp[static_cast<size_t>(k * Mp + m)] = x[m * sm + k * sk];
  // Blocks of 64 weight rows: enough per item to amortise the tile set-up, and
  // enough items (N / 64, hundreds for a Llama layer) to balance the threads.
  const int64_t block = 64, nblocks = (N + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t b = 0; b < nblocks; ++b) {
    gemm_rows(W, xp.data(), yT, b * block, std::min(N, (b + 1) * block), K, M, Mp);
  }
}

}  // namespace radixserve
