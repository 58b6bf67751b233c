// Rotary position embedding of q and k, straight from the fused q/k/v product
// (radixserve.layers._cpu_kernels.rotary_qkv).
//
// The torch form (models/rope.py, apply_rotary) is a copy of the product into rows,
// the rotate-half (two slices, a negation, a concatenation), two products and a
// sum, then copies of q, k and v into the contiguous rows attention reads: a
// dozen dispatches per layer, each costing more than its work at decode batch
// sizes. Here one pass per token reads the product where it lies (any element
// strides: it is often the transposed view of a [features, tokens] product) and
// writes q and k rotated and v as they are, each C-contiguous, with the torch
// form's roundings (rotate-half layout; features from rot_dim on pass through):
//   out[i] = round(round(x[i] * cos[i]) + round(-x[i + h] * sin[i]))   i < h
//   out[i] = round(round(x[i] * cos[i]) + round( x[i - h] * sin[i]))   h <= i < rot_dim
// with h = rot_dim / 2; bfloat16 products and sums are exact in float32.
#include "cpu_kernels.h"

#include <algorithm>
#include <cstdint>

namespace {

using radixserve::RotaryQkv;

// Each product and sum is computed exactly in the wide type and rounded once to the
// storage type: the torch form's separate roundings, which the compiler cannot fuse
// into FMAs (a float32 product or sum of two float32 values is exact in double).
struct F32 {
  typedef float T;
  static RS_ALWAYS_INLINE double load(float x) { return x; }
  static RS_ALWAYS_INLINE float store(double x) { return static_cast<float>(x); }
};

struct BF16 {
  typedef uint16_t T;
  static RS_ALWAYS_INLINE float load(uint16_t x) { return radixserve::bf16_to_f32(x); }
  static RS_ALWAYS_INLINE uint16_t store(float x) { return radixserve::f32_to_bf16(x); }
};

// One head's features: x (element stride xs) into out, rotated when cos is given.
template <typename IO>
RS_ALWAYS_INLINE void head(const typename IO::T* x, int64_t xs, const typename IO::T* cos,
                           const typename IO::T* sin, typename IO::T* out, int64_t dim,
                           int64_t rot) {
  typedef typename IO::T T;
  if (cos == nullptr) {
    for (int64_t i = 0; i < dim; ++i) out[i] = x[i * xs];
    return;
  }
  const int64_t h = rot / 2;
  T a[512], b[512];  // the rounded products
  for (int64_t i = 0; i < h; ++i) {
    a[i] = IO::store(IO::load(x[i * xs]) * IO::load(cos[i]));
    b[i] = IO::store(-IO::load(x[(i + h) * xs]) * IO::load(sin[i]));
    a[i + h] = IO::store(IO::load(x[(i + h) * xs]) * IO::load(cos[i + h]));
    b[i + h] = IO::store(IO::load(x[i * xs]) * IO::load(sin[i + h]));
  }
  for (int64_t i = 0; i < rot; ++i) out[i] = IO::store(IO::load(a[i]) + IO::load(b[i]));
  for (int64_t i = rot; i < dim; ++i) out[i] = x[i * xs];
}

// Tokens [t0, t1). Always inlined into one function per level: each gets its own
// vector code (an OpenMP region's outlined body would not: it drops the target).
template <typename IO>
RS_ALWAYS_INLINE void rotary_rows(const RotaryQkv& p, int64_t t0, int64_t t1) {
  typedef typename IO::T T;
  const T* qkv = static_cast<const T*>(p.qkv);
  const T* cos = static_cast<const T*>(p.cos);
  const T* sin = static_cast<const T*>(p.sin);
  T* outs[3] = {static_cast<T*>(p.q), static_cast<T*>(p.k), static_cast<T*>(p.v)};
  const int64_t counts[3] = {p.heads, p.kv_heads, p.kv_heads};
  const int64_t d = p.head_dim;
  for (int64_t t = t0; t < t1; ++t) {
    const T* row = qkv + t * p.row_stride;
    int64_t at = 0;
    for (int part = 0; part < 3; ++part) {
      for (int64_t hd = 0; hd < counts[part]; ++hd, ++at) {
        T* out = outs[part] + (t * counts[part] + hd) * d;
        const bool rotate = part < 2 && p.rot_dim > 0;
        head<IO>(row + at * d * p.col_stride, p.col_stride, rotate ? cos + t * p.rot_dim : nullptr,
                 sin + t * p.rot_dim, out, d, p.rot_dim);
      }
    }
  }
}

template <typename IO>
void rows_baseline(const RotaryQkv& p, int64_t t0, int64_t t1) {
  rotary_rows<IO>(p, t0, t1);
}

template <typename IO>
RS_TARGET_AVX2 void rows_avx2(const RotaryQkv& p, int64_t t0, int64_t t1) {
  rotary_rows<IO>(p, t0, t1);
}

template <typename IO>
RS_TARGET_AVX512 void rows_avx512(const RotaryQkv& p, int64_t t0, int64_t t1) {
  rotary_rows<IO>(p, t0, t1);
}

template <typename IO>
void dispatch(const RotaryQkv& p, radixserve::Isa isa, int num_threads) {
  void (*fn)(const RotaryQkv&, int64_t, int64_t) = rows_baseline<IO>;
  if (isa == radixserve::Isa::kAvx2) fn = rows_avx2<IO>;
  if (isa >= radixserve::Isa::kAvx512) fn = rows_avx512<IO>;
  // A decode step's tokens are too few to share: threads only for prefill chunks.
  const int64_t work = p.tokens * (p.heads + 2 * p.kv_heads) * p.head_dim;
  const int64_t parts = work >= (1 << 17) ? std::min<int64_t>(num_threads, p.tokens) : 1;
  if (parts <= 1) return fn(p, 0, p.tokens);
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(parts))
  for (int64_t i = 0; i < parts; ++i) fn(p, p.tokens * i / parts, p.tokens * (i + 1) / parts);
}

}  // namespace

void radixserve::rotary_qkv(const RotaryQkv& p, Isa isa, int num_threads) {
  if (p.bf16) return dispatch<BF16>(p, isa, num_threads);
  return dispatch<F32>(p, isa, num_threads);
}
