// Mamba-2's decode step (radixserve.layers._cpu_kernels.mamba2_step), on the
// recurrent states where they lie in the state pool.
//
// The torch form (radixserve/models/mamba2.py, recurrent_step) gathers each
// request's [heads, head_dim, state_size] state out of the pool, decays it, adds the
// input's outer product and multiplies by C, each a pass and a new tensor, and copies
// the result back. Here each head's state is read and written once, in place:
//   S_pn <- e S_pn + (dt x_p) B_n,   y_p = sum_n S_pn C_n   e = exp(dt A) (flush_exp)
// with B and C those of the head's group; float32 and float64 results agree with the
// torch form to rounding (the sum over n is taken in another order).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"

namespace {

using radixserve::Mamba2Step;
using radixserve::flush_exp;

// Items [i0, i1) of the (request, head) pairs; inlined into one function per level.
template <typename T>
RS_ALWAYS_INLINE void step_items(const Mamba2Step& p, int64_t i0, int64_t i1) {
  const int64_t hd = p.head_dim, n = p.state_size, per_group = p.heads / p.groups;
  const T* x = static_cast<const T*>(p.x);
  const T* dt = static_cast<const T*>(p.dt);
  const T* A = static_cast<const T*>(p.A);
  const T* B = static_cast<const T*>(p.B);
  const T* C = static_cast<const T*>(p.C);
  T* out = static_cast<T*>(p.out);
  T* pool = static_cast<T*>(p.state);
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t r = item / p.heads, h = item % p.heads;
    T* s = pool + p.entries[r] * p.entry_stride + h * hd * n;
    const T* xr = x + item * hd;
    const int64_t grp = r * p.groups + h / per_group;
    const T* br = B + grp * n;
    const T* cr = C + grp * n;
    const T d = dt[item];
    const T e = flush_exp(d * A[h]);
    T* y = out + item * hd;
    for (int64_t i = 0; i < hd; ++i) {
      const T dx = d * xr[i];
      T* row = s + i * n;
      T acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < n; ++j) {
        const T v = row[j] * e + dx * br[j];
        row[j] = v;
        acc += v * cr[j];
      }
      y[i] = acc;
    }
  }
}

template <typename T>
void step_baseline(const Mamba2Step& p, int64_t i0, int64_t i1) {
  step_items<T>(p, i0, i1);
}

template <typename T>
RS_TARGET_AVX2 void step_avx2(const Mamba2Step& p, int64_t i0, int64_t i1) {
  step_items<T>(p, i0, i1);
}

template <typename T>
RS_TARGET_AVX512 void step_avx512(const Mamba2Step& p, int64_t i0, int64_t i1) {
  step_items<T>(p, i0, i1);
}

template <typename T>
void run(const Mamba2Step& p, radixserve::Isa isa, int num_threads) {
  const auto fn = radixserve::by_isa(isa, &step_baseline<T>, &step_avx2<T>, &step_avx512<T>);
  radixserve::split_items(p.batch * p.heads, num_threads,
                          [&](int64_t i0, int64_t i1) { fn(p, i0, i1); });
}

}  // namespace

void radixserve::mamba2_step(const Mamba2Step& p, bool f64, Isa isa, int num_threads) {
  if (f64) {
    run<double>(p, isa, num_threads);
  } else {
    run<float>(p, isa, num_threads);
  }
}
