// Residual add fused with the next RMSNorm (radixserve.layers._cpu_kernels.add_rms_norm).
//
// A pre-norm decoder layer adds each sublayer's output to the residual stream and
// normalises the sum for the next sublayer: in torch that is the add, then the
// norm (one native call in bfloat16, five ops in float32), each a dispatch that
// costs as much as its work at decode batch sizes. Here one pass per row writes
// both the sum s = x + a and y = RMSNorm(s) * w, with the torch form's roundings:
//   s = round(x + a)                          (one rounding to the storage type)
//   Llama:       y = round(w * round(s * r))  r = 1 / sqrt(mean(s^2) + eps)
//   unit offset: y = round(s * r * (1 + w))   (Gemma)
// computed in float32 (bfloat16 widened exactly), the sum of squares in float32.
// x and a may have any element strides (a sublayer's output is often the
// transposed view of a [features, rows] product); s and y are C-contiguous.
#include "cpu_kernels.h"

#include <cmath>
#include <cstdint>

namespace {

using radixserve::AddRmsNorm;

struct F32 {
  typedef float T;
  static RS_ALWAYS_INLINE float load(float x) { return x; }
  static RS_ALWAYS_INLINE float store(float x) { return x; }
};

struct BF16 {
  typedef uint16_t T;
  static RS_ALWAYS_INLINE float load(uint16_t x) { return radixserve::bf16_to_f32(x); }
  static RS_ALWAYS_INLINE uint16_t store(float x) { return radixserve::f32_to_bf16(x); }
};

template <typename IO, int>
RS_ALWAYS_INLINE void add_norm_rows(const AddRmsNorm& p, int num_threads) {
  typedef typename IO::T T;
  const T* x = static_cast<const T*>(p.x);
  const T* a = static_cast<const T*>(p.a);
  const T* w = static_cast<const T*>(p.w);
  T* s = static_cast<T*>(p.s);
  T* y = static_cast<T*>(p.y);
  const int64_t n = p.n;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (p.rows * n >= (1 << 16))
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* xr = x + r * p.x_row;
    const T* ar = a + r * p.a_row;
    T* sr = s + r * n;
    T* yr = y + r * n;
    float ss = 0;
    if (p.x_col == 1 && p.a_col == 1) {
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) {
        const float v = IO::load(IO::store(IO::load(xr[i]) + IO::load(ar[i])));
        sr[i] = IO::store(v);
        ss += v * v;
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const float v = IO::load(IO::store(IO::load(xr[i * p.x_col]) + IO::load(ar[i * p.a_col])));
        sr[i] = IO::store(v);
        ss += v * v;
      }
    }
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + p.eps);
    if (p.unit_offset) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        yr[i] = IO::store(IO::load(sr[i]) * scale * (1.0f + IO::load(w[i])));
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        yr[i] = IO::store(IO::load(w[i]) * IO::load(IO::store(IO::load(sr[i]) * scale)));
    }
  }
}

template <typename IO>
void add_norm_baseline(const AddRmsNorm& p, int num_threads) {
  add_norm_rows<IO, 0>(p, num_threads);
}

template <typename IO>
RS_TARGET_AVX2 void add_norm_avx2(const AddRmsNorm& p, int num_threads) {
  add_norm_rows<IO, 1>(p, num_threads);
}

template <typename IO>
RS_TARGET_AVX512 void add_norm_avx512(const AddRmsNorm& p, int num_threads) {
  add_norm_rows<IO, 2>(p, num_threads);
}

template <typename IO>
void dispatch(const AddRmsNorm& p, radixserve::Isa isa, int num_threads) {
  switch (isa) {
    case radixserve::Isa::kBaseline:
      return add_norm_baseline<IO>(p, num_threads);
    case radixserve::Isa::kAvx2:
      return add_norm_avx2<IO>(p, num_threads);
    case radixserve::Isa::kAvx512:
    case radixserve::Isa::kAvx512Bf16:
      return add_norm_avx512<IO>(p, num_threads);
  }
}

}  // namespace

void radixserve::add_rms_norm(const AddRmsNorm& p, Isa isa, int num_threads) {
  if (p.bf16) return dispatch<BF16>(p, isa, num_threads);
  return dispatch<F32>(p, isa, num_threads);
}
