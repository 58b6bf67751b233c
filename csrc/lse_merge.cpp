// Merging two partial attention results by their log-sum-exps
// (radixserve.layers._cpu_kernels.merge_attention).
//
// Cascade decode computes a member's attention over the shared prefix and over its
// own suffix separately, each with the log-sum-exp (lse) of its scaled scores; the
// attention over both key sets is their mix weighted by exp(lse):
//   m = max(a, b), wa = exp(a - m), wb = exp(b - m)
//   out = (wa * out + wb * part) / (wa + wb),  lse = m + log(wa + wb)
// The torch form is about a dozen ops per cascade group and layer (gathers, casts,
// exp, the mix, a scatter back); here it is one pass over the group's vectors,
// written in place into the rows they belong to. Vector v of the part goes to row
// index[v] of out and lse. Two empty parts (both lse -inf) leave the row as it is.
// Computed in float32 (float64 for float64 tensors); bfloat16 rounds once, at the
// store. The work is a few thousand vectors per call: one thread, the compiler's
// own vector code.
#include "cpu_kernels.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

template <typename T>
struct Bits {
  typedef T type;
  static RS_ALWAYS_INLINE T load(T x) { return x; }
  static RS_ALWAYS_INLINE T store(T x) { return x; }
};

struct BF16Bits {
  static RS_ALWAYS_INLINE float load(uint16_t x) { return radixserve::bf16_to_f32(x); }
  static RS_ALWAYS_INLINE uint16_t store(float x) { return radixserve::f32_to_bf16(x); }
};

template <typename T, typename A, typename IO>
void merge(const radixserve::MergeAttention& m) {
  T* out = static_cast<T*>(m.out);
  A* lse = static_cast<A*>(m.lse);
  const T* part = static_cast<const T*>(m.part);
  const A* plse = static_cast<const A*>(m.part_lse);
  const A ninf = -std::numeric_limits<A>::infinity();
  for (int64_t h = 0; h < m.heads; ++h) {
    for (int64_t l = 0; l < m.len; ++l) {
      const int64_t row = m.index[h * m.len + l];
      const A a = lse[row];
      const A b = plse[h * m.lse_stride_h + l * m.lse_stride_l];
      const A mx = a > b ? a : b;
      if (mx == ninf) continue;
      A wa = std::exp(a - mx), wb = std::exp(b - mx);
      const A sum = wa + wb;
      wa /= sum;
      wb /= sum;
      T* o = out + row * m.dim;
      const T* p = part + h * m.stride_h + l * m.stride_l;
#pragma omp simd
      for (int64_t d = 0; d < m.dim; ++d) {
        o[d] = IO::store(wa * static_cast<A>(IO::load(o[d])) + wb * static_cast<A>(IO::load(p[d])));
      }
      lse[row] = mx + std::log(sum);
    }
  }
}

}  // namespace

void radixserve::merge_attention(const MergeAttention& m) {
  switch (m.type) {
    case KVType::kFloat32:
      return merge<float, float, Bits<float>>(m);
    case KVType::kFloat64:
      return merge<double, double, Bits<double>>(m);
    case KVType::kBFloat16:
      return merge<uint16_t, float, BF16Bits>(m);
  }
}
