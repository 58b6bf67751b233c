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
// x and a may have any element strides (a sublayer's output is the transposed
// view of a [features, rows] product); s and y are written in a's layout when a is
// feature-major ([n][rows]: the next product reads y as a plain matrix, and the next
// add finds s and the sublayer's output both feature-major, contiguous over rows),
// else row-major ([rows][n]).
#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

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

// Rows [r0, r1), feature by feature: s and y are feature-major ([n][rows], the
// layout of a product's output), so with x and a feature-major too (every layer
// after the first) each inner loop runs over contiguous rows. Always inlined into
// one function per level: each gets its own vector code (an OpenMP region's
// outlined body would not: it drops the target).
template <typename IO>
RS_ALWAYS_INLINE void add_norm_rows(const AddRmsNorm& p, int64_t r0, int64_t r1, float* ss) {
  typedef typename IO::T T;
  const T* x = static_cast<const T*>(p.x);
  const T* a = static_cast<const T*>(p.a);
  const T* w = static_cast<const T*>(p.w);
  T* s = static_cast<T*>(p.s);
  T* y = static_cast<T*>(p.y);
  const int64_t n = p.n, rows = p.rows, len = r1 - r0;
  for (int64_t r = 0; r < len; ++r) ss[r] = 0;
  const bool unit = p.x_row == 1 && p.a_row == 1;
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * p.x_col + r0 * p.x_row;
    const T* ai = a + i * p.a_col + r0 * p.a_row;
    T* si = s + i * rows + r0;
    if (unit) {
#pragma omp simd
      for (int64_t r = 0; r < len; ++r) {
        const float v = IO::load(IO::store(IO::load(xi[r]) + IO::load(ai[r])));
        si[r] = IO::store(v);
        ss[r] += v * v;
      }
    } else {
      for (int64_t r = 0; r < len; ++r) {
        const float v = IO::load(IO::store(IO::load(xi[r * p.x_row]) + IO::load(ai[r * p.a_row])));
        si[r] = IO::store(v);
        ss[r] += v * v;
      }
    }
  }
  for (int64_t r = 0; r < len; ++r) ss[r] = 1.0f / std::sqrt(ss[r] / static_cast<float>(n) + p.eps);
  for (int64_t i = 0; i < n; ++i) {
    const T* si = s + i * rows + r0;
    T* yi = y + i * rows + r0;
    const float wi = IO::load(w[i]);
    if (p.unit_offset) {
#pragma omp simd
      for (int64_t r = 0; r < len; ++r) yi[r] = IO::store(IO::load(si[r]) * ss[r] * (1.0f + wi));
    } else {
#pragma omp simd
      for (int64_t r = 0; r < len; ++r)
        yi[r] = IO::store(wi * IO::load(IO::store(IO::load(si[r]) * ss[r])));
    }
  }
}

// The same, row by row, with s and y row-major ([rows][n]): for a row-major a (a
// large prefill's product comes from F.linear that way), so that each inner loop
// again runs over contiguous memory.
template <typename IO>
RS_ALWAYS_INLINE void add_norm_rows_rm(const AddRmsNorm& p, int64_t r0, int64_t r1) {
  typedef typename IO::T T;
  const T* x = static_cast<const T*>(p.x);
  const T* a = static_cast<const T*>(p.a);
  const T* w = static_cast<const T*>(p.w);
  const int64_t n = p.n;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * p.x_row;
    const T* ar = a + r * p.a_row;
    T* sr = static_cast<T*>(p.s) + r * n;
    T* yr = static_cast<T*>(p.y) + r * n;
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
RS_ALWAYS_INLINE void add_norm_any(const AddRmsNorm& p, int64_t r0, int64_t r1, float* ss) {
  if (p.feature_major) return add_norm_rows<IO>(p, r0, r1, ss);
  add_norm_rows_rm<IO>(p, r0, r1);
}

template <typename IO>
void rows_baseline(const AddRmsNorm& p, int64_t r0, int64_t r1, float* ss) {
  add_norm_any<IO>(p, r0, r1, ss);
}

template <typename IO>
RS_TARGET_AVX2 void rows_avx2(const AddRmsNorm& p, int64_t r0, int64_t r1, float* ss) {
  add_norm_any<IO>(p, r0, r1, ss);
}

template <typename IO>
RS_TARGET_AVX512 void rows_avx512(const AddRmsNorm& p, int64_t r0, int64_t r1, float* ss) {
  add_norm_any<IO>(p, r0, r1, ss);
}

template <typename IO>
void dispatch(const AddRmsNorm& p, radixserve::Isa isa, int num_threads) {
  void (*fn)(const AddRmsNorm&, int64_t, int64_t, float*) = rows_baseline<IO>;
  if (isa == radixserve::Isa::kAvx2) fn = rows_avx2<IO>;
  if (isa >= radixserve::Isa::kAvx512) fn = rows_avx512<IO>;
  std::vector<float> ss(static_cast<size_t>(p.rows));  // per row: sum of squares, then 1 / rms
  // A decode step's rows are too few to share: threads only for prefill chunks.
  const int64_t parts = p.rows * p.n >= (1 << 16) ? std::min<int64_t>(num_threads, p.rows) : 1;
  if (parts <= 1) return fn(p, 0, p.rows, ss.data());
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(parts))
  for (int64_t i = 0; i < parts; ++i) {
    const int64_t r0 = p.rows * i / parts;
    fn(p, r0, p.rows * (i + 1) / parts, ss.data() + r0);
  }
}

}  // namespace

void radixserve::add_rms_norm(const AddRmsNorm& p, Isa isa, int num_threads) {
  if (p.bf16) return dispatch<BF16>(p, isa, num_threads);
  return dispatch<F32>(p, isa, num_threads);
}
