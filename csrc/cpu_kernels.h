// The worker's CPU kernels (module radixserve.worker._cpu_kernels): paged decode
// attention (paged_attention.cpp) and the skinny float32 product
// (skinny_gemm.cpp). Bindings: cpu_kernels.cpp.
#pragma once

#include <cstdint>

// Hot loops are compiled for AVX2+FMA and for baseline x86-64, and the loader
// picks the best one this CPU runs (GCC/clang target_clones), so a build runs
// on any x86-64 CPU and is fast on a recent one.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__INTEL_COMPILER)
#define RS_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define RS_CLONES
#endif

namespace pybind11 {
class module_;
}

namespace radixserve {

// yT [N, M] = W [N, K] . x^T for float32; W and yT row-major, x [M, K] with
// element strides (sm, sk), so a transposed view needs no copy.
void skinny_gemm_f32(const float* W, const float* x, int64_t sm, int64_t sk, float* yT, int64_t N,
                     int64_t K, int64_t M, int num_threads);

// Adds paged_decode to the module.
void register_paged_attention(pybind11::module_& m);

}  // namespace radixserve
