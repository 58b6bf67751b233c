// The gated delta rule's decode step (radixserve.layers._cpu_kernels.gated_delta_step),
// on the recurrent states where they lie in the state pool.
//
// The torch form (radixserve/models/gated_delta.py, recurrent_step) gathers each
// request's [heads, key_dim, value_dim] state out of the pool, makes four passes
// over it (decay, read, write, output), each a new tensor, and copies the result
// back: for 16 heads of 128 x 128 that is a megabyte per request and layer moved
// about ten times. Here each head's state is read and written in place, in two
// passes while it sits in L2:
//   read_j = sum_i k_i (e S_ij)                   e = exp(g) (0 below 1e-19: flush_exp)
//   u_j    = beta (v_j - read_j)
//   S_ij  <- e S_ij + k_i u_j,   o_j = sum_i q_i S_ij
// the same operations in the same order as the torch form, so float32 and
// float64 results agree with it to rounding (the compiler may fuse a multiply-add).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"

namespace {

using radixserve::GatedDeltaStep;
using radixserve::flush_exp;

// Items [i0, i1) of the (request, head) pairs. Always inlined into one function per
// level (an OpenMP region's outlined body drops its function's target attribute).
template <typename T>
RS_ALWAYS_INLINE void step_items(const GatedDeltaStep& p, int64_t i0, int64_t i1) {
  const int64_t dk = p.key_dim, dv = p.value_dim;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* g = static_cast<const T*>(p.g);
  const T* beta = static_cast<const T*>(p.beta);
  T* out = static_cast<T*>(p.out);
  T* pool = static_cast<T*>(p.state);
  T u[512];
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t b = item / p.heads, h = item % p.heads;
    T* s = pool + p.entries[b] * p.entry_stride + h * dk * dv;
    const T* qr = q + item * dk;
    const T* kr = k + item * dk;
    const T* vr = v + item * dv;
    T* o = out + item * dv;
    const T e = flush_exp(g[item]);
    const T bt = beta[item];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) u[j] = 0;
    for (int64_t i = 0; i < dk; ++i) {
      const T ki = kr[i];
      const T* row = s + i * dv;
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) u[j] += ki * (row[j] * e);
    }
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      u[j] = bt * (vr[j] - u[j]);
      o[j] = 0;
    }
    for (int64_t i = 0; i < dk; ++i) {
      const T ki = kr[i], qi = qr[i];
      T* row = s + i * dv;
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) {
        const T x = row[j] * e + ki * u[j];
        row[j] = x;
        o[j] += qi * x;
      }
    }
  }
}

template <typename T>
void step_baseline(const GatedDeltaStep& p, int64_t i0, int64_t i1) {
  step_items<T>(p, i0, i1);
}

template <typename T>
RS_TARGET_AVX2 void step_avx2(const GatedDeltaStep& p, int64_t i0, int64_t i1) {
  step_items<T>(p, i0, i1);
}

template <typename T>
RS_TARGET_AVX512 void step_avx512(const GatedDeltaStep& p, int64_t i0, int64_t i1) {
  step_items<T>(p, i0, i1);
}

template <typename T>
void run(const GatedDeltaStep& p, radixserve::Isa isa, int num_threads) {
  const auto fn = radixserve::by_isa(isa, &step_baseline<T>, &step_avx2<T>, &step_avx512<T>);
  radixserve::split_items(p.batch * p.heads, num_threads,
                          [&](int64_t i0, int64_t i1) { fn(p, i0, i1); });
}

}  // namespace

void radixserve::gated_delta_step(const GatedDeltaStep& p, bool f64, Isa isa, int num_threads) {
  if (f64) {
    run<double>(p, isa, num_threads);
  } else {
    run<float>(p, isa, num_threads);
  }
}
