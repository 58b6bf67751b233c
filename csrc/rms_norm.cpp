// RMSNorm over bfloat16 rows (radixserve.layers._cpu_kernels.rms_norm).
//
// The torch form of a bfloat16 RMSNorm is eight element-wise ops (to float32,
// square, mean, add eps, rsqrt, multiply, back to bfloat16, times the weight),
// each a dispatch and a pass over memory; in a decode step of 32 rows the
// dispatches are the cost. This is one pass per row with the same roundings as
// the torch form (models/blocks.py, RMSNorm):
//   Llama:       y = bf16(w * bf16(x * r))            r = 1 / sqrt(mean(x^2) + eps)
//   unit offset: y = bf16(x * r * (1 + w))            (Gemma; all in float32)
// with x, w widened exactly to float32 and the sum of squares in float32.
#include "cpu_kernels.h"

#include <cmath>
#include <cstdint>

namespace {

template <int>
RS_ALWAYS_INLINE void norm_rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t rows,
                                int64_t n, float eps, bool unit_offset, int num_threads) {
  using radixserve::bf16_to_f32;
  using radixserve::f32_to_bf16;
  const int64_t work = rows * n;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (work >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * n;
    uint16_t* yr = y + r * n;
    float ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) {
      const float v = bf16_to_f32(xr[i]);
      ss += v * v;
    }
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    if (unit_offset) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        yr[i] = f32_to_bf16(bf16_to_f32(xr[i]) * scale * (1.0f + bf16_to_f32(w[i])));
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float h = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * scale));
        yr[i] = f32_to_bf16(bf16_to_f32(w[i]) * h);
      }
    }
  }
}

void norm_baseline(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t rows, int64_t n,
                   float eps, bool unit_offset, int num_threads) {
  norm_rows<0>(x, w, y, rows, n, eps, unit_offset, num_threads);
}

RS_TARGET_AVX2 void norm_avx2(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t rows,
                              int64_t n, float eps, bool unit_offset, int num_threads) {
  norm_rows<1>(x, w, y, rows, n, eps, unit_offset, num_threads);
}

RS_TARGET_AVX512 void norm_avx512(const uint16_t* x, const uint16_t* w, uint16_t* y,
                                  int64_t rows, int64_t n, float eps, bool unit_offset,
                                  int num_threads) {
  norm_rows<2>(x, w, y, rows, n, eps, unit_offset, num_threads);
}

}  // namespace

void radixserve::rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t rows,
                               int64_t n, float eps, bool unit_offset, Isa isa,
                               int num_threads) {
  switch (isa) {
    case Isa::kBaseline:
      return norm_baseline(x, w, y, rows, n, eps, unit_offset, num_threads);
    case Isa::kAvx2:
      return norm_avx2(x, w, y, rows, n, eps, unit_offset, num_threads);
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
      return norm_avx512(x, w, y, rows, n, eps, unit_offset, num_threads);
  }
}
