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

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// Rows [r0, r1). Always inlined into one function per level, which the OpenMP loop
// below calls: an OpenMP region's outlined body drops its function's target
// attribute, so vector code written inside it would be SSE at every level.
RS_ALWAYS_INLINE void norm_rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t r0,
                                int64_t r1, int64_t n, float eps, bool unit_offset) {
  using radixserve::bf16_to_f32;
  using radixserve::f32_to_bf16;
  for (int64_t r = r0; r < r1; ++r) {
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

typedef void (*NormFn)(const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                       float, bool);

void norm_baseline(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t r0, int64_t r1,
                   int64_t n, float eps, bool unit_offset) {
  norm_rows(x, w, y, r0, r1, n, eps, unit_offset);
}

RS_TARGET_AVX2 void norm_avx2(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t r0,
                              int64_t r1, int64_t n, float eps, bool unit_offset) {
  norm_rows(x, w, y, r0, r1, n, eps, unit_offset);
}

RS_TARGET_AVX512 void norm_avx512(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t r0,
                                  int64_t r1, int64_t n, float eps, bool unit_offset) {
  norm_rows(x, w, y, r0, r1, n, eps, unit_offset);
}

}  // namespace

void radixserve::rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t rows,
                               int64_t n, float eps, bool unit_offset, Isa isa,
                               int num_threads) {
  NormFn fn = norm_baseline;
  if (isa == Isa::kAvx2) fn = norm_avx2;
  if (isa >= Isa::kAvx512) fn = norm_avx512;
  // A decode step's rows are too few to share: threads only for prefill chunks.
  const int64_t parts = rows * n >= (1 << 16) ? std::min<int64_t>(num_threads, rows) : 1;
  if (parts <= 1) return fn(x, w, y, 0, rows, n, eps, unit_offset);
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(parts))
  for (int64_t i = 0; i < parts; ++i)
    fn(x, w, y, rows * i / parts, rows * (i + 1) / parts, n, eps, unit_offset);
}
