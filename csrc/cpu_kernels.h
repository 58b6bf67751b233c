// The worker's CPU kernels (module radixserve.layers._cpu_kernels): paged decode
// attention (paged_attention.cpp) and the skinny float32 product
// (skinny_gemm.cpp), both free of Python. Bindings and argument checks:
// cpu_kernels.cpp.
#pragma once

#include <cstdint>
#include <cstring>

// Hot loops are compiled for AVX2+FMA and for baseline x86-64, and the loader
// picks the best one this CPU runs (GCC/clang target_clones), so a build runs
// on any x86-64 CPU and is fast on a recent one.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__INTEL_COMPILER)
#define RS_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define RS_CLONES
#endif

#if defined(__GNUC__)
#define RS_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define RS_ALWAYS_INLINE inline
#endif

namespace radixserve {

// Eight floats as a GCC/clang vector: one AVX register in an AVX2 clone, two SSE
// registers in the baseline one. Helpers are always inlined so that each clone
// gets its own instructions.
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

RS_ALWAYS_INLINE v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

RS_ALWAYS_INLINE void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

RS_ALWAYS_INLINE v8 splat8(float x) { return v8{x, x, x, x, x, x, x, x}; }

// exp of eight floats <= 0 (about 2 ulp; below -87 the result is ~0): Cody-Waite
// reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial, 2^n from the bits.
RS_ALWAYS_INLINE v8 exp8(v8 x) {
  const v8 lo = splat8(-87.0f);
  x = x < lo ? lo : x;
  const v8 magic = splat8(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const v8 n = (x * 1.44269504088896341f + magic) - magic;
  v8 r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  v8 p = splat8(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

}  // namespace radixserve

namespace radixserve {

// One paged decode attention call (paged_attention.cpp). Segment s: query rows
// rows[row_indptr[s]:row_indptr[s+1]] attend to keys [kv_begin[s], kv_end[s]) of
// pages pages[page_indptr[s]:page_indptr[s+1]]. All indices must already be
// valid (the bindings check them).
struct PagedDecode {
  int64_t num_segments, num_heads, num_kv_heads, head_dim, page_size, group;
  const int32_t* row_indptr;
  const int32_t* rows;
  const int32_t* page_indptr;
  const int32_t* pages;
  const int32_t* kv_begin;
  const int32_t* kv_end;
  double scale;
};

enum class KVType { kFloat32, kFloat64, kBFloat16 };

// q, out: [rows, heads, head_dim]; kv: [pages, 2, page_size, kv_heads, head_dim],
// all of `type`; lse (one of the two, or neither): [rows, heads].
void paged_decode(const PagedDecode& p, KVType type, const void* q, const void* kv, void* out,
                  float* lse_f, double* lse_d, int num_threads, int64_t chunk);

// yT [N, M] = W [N, K] . x^T for float32; W and yT row-major, x [M, K] with
// element strides (sm, sk), so a transposed view needs no copy.
void skinny_gemm_f32(const float* W, const float* x, int64_t sm, int64_t sk, float* yT, int64_t N,
                     int64_t K, int64_t M, int num_threads);

}  // namespace radixserve
