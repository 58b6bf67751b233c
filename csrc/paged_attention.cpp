// Paged decode attention on the CPU, reading K/V pages where they lie
// (radixserve.layers._cpu_kernels.paged_decode; its arguments are checked in
// cpu_kernels.cpp before they reach this file, which holds no Python).
//
// The torch backend's decode path copies every page a request reads into a
// contiguous buffer and runs scaled_dot_product_attention over it: the pages
// are read twice and written once, and SDPA expands GQA heads. This kernel
// reads each key and value row once, straight from the pool, for all query
// heads that share it.
//
// Work is described as segments. A segment is one KV sequence (a page list and
// a key range [kv_begin, kv_end) in it) and the query rows that attend to it,
// each with all of its heads. A plain decode request is a segment with one row;
// a shared prefix read once by several requests (cascade decode) is a segment
// with one row per request. Output goes to out[row] and, per head, the
// log-sum-exp of the scaled scores to lse[row], so that two partial results
// over disjoint key sets can be merged by the caller. A row may also be in several
// segments whose keys are disjoint (a cascade member reads the shared prefix and
// its own pages): its result is attention over all of them, merged here.
//
// Parallelism: work items are (segment, key chunk), run by an OpenMP
// loop in the process's OpenMP runtime (torch's, which is loaded first); the
// chunks of a segment are merged in a second loop. Long segments are cut into
// chunks so that a few long requests still keep every thread busy.
//
// Storage types: float32, float64 (computed in their own precision) and
// bfloat16 (computed in float32). A quantized pool (KVQuant: int8, fp8 e4m3 or
// e5m2 codes, a float16 scale after each (token, kv head) row of codes) is read
// with queries of any of the three: each block of K or V rows is turned into the
// compute type (code * scale) in the block's L1 buffer, as bfloat16 rows are, by
// loops the compiler vectorizes at every instruction-set level (the fp8 formats
// by bit moves and a select for their subnormals, no table); an fp8 row whose scale
// is negative is a sink row of int8 codes (kv_quant.quantize_sink). With a soft-cap (Gemma 2) each scaled score s
// becomes softcap * tanh(s / softcap) before the softmax. The pool layout is the KV pool's
// [num_pages, 2, page_size, kv_heads, head_dim], K at index 0, V at 1.
#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if RS_X86
#include <immintrin.h>
#endif

using radixserve::exp8;
using radixserve::expv;
using radixserve::Isa;
using radixserve::lanes;
using radixserve::loadv;
using radixserve::splat;
using radixserve::splat8;
using radixserve::store8;
using radixserve::storev;
using radixserve::v16;
using radixserve::v8;

namespace {

struct BF16 {
  uint16_t bits;
};

inline float to_acc(float x) { return x; }
inline double to_acc(double x) { return x; }
inline float to_acc(BF16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void from_acc(float x, float* d) { *d = x; }
inline void from_acc(double x, double* d) { *d = x; }
inline void from_acc(float x, BF16* d) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    d->bits = 0x7fc0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  d->bits = static_cast<uint16_t>(u >> 16);
}

template <typename T>
using Acc = typename std::conditional<std::is_same<T, double>::value, double, float>::type;

// One-byte codes of a quantized pool; Kind 1: int8, 2: fp8 e4m3, 3: fp8 e5m2.
template <int Kind>
struct Q8 {
  static constexpr int kKind = Kind;
  uint8_t bits;
};
template <typename KV>
struct IsQuant : std::false_type {};
template <int Kind>
struct IsQuant<Q8<Kind>> : std::true_type {};

RS_ALWAYS_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A code's value before its row's scale: exact in float32.
RS_ALWAYS_INLINE float code_value(Q8<1> c) {
  return static_cast<float>(static_cast<int8_t>(c.bits));
}
// The fp8 formats without branches, so that a row's loop vectorizes: a normal code's
// exponent and mantissa move into a float32's, rebiased; a subnormal one (exponent 0)
// is 2^(1 - bias) * (1 + m / 2^M) - 2^(1 - bias) = m * 2^(1 - bias - M), exact.
RS_ALWAYS_INLINE uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
template <int M, int B>
RS_ALWAYS_INLINE float minifloat_value(uint32_t x) {
  const uint32_t em = x & 0x7fu, shift = 23 - M;
  const float normal = bits_to_float((em << shift) + ((127u - B) << 23));
  const float sub = bits_to_float((em << shift) | ((128u - B) << 23)) -
                    bits_to_float((128u - B) << 23);
  const float mag = (em >> M) ? normal : sub;
  return bits_to_float(float_bits(mag) | ((x & 0x80u) << 24));
}
RS_ALWAYS_INLINE float code_value(Q8<2> c) {  // e4m3 (bias 7; NaN is never stored)
  return minifloat_value<3, 7>(c.bits);
}
RS_ALWAYS_INLINE float code_value(Q8<3> c) {  // e5m2 (bias 15; inf/NaN are never stored)
  return minifloat_value<2, 15>(c.bits);
}

// A float16 (a row's scale) as float32, exactly.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float f = static_cast<float>(m) * 0x1p-24f;
    return sign ? -f : f;
  }
  const uint32_t exp = e == 31 ? 0xffu : e + 112u;
  return bits_to_float(sign | (exp << 23) | (m << 13));
}

// exp of one float <= 0: the first lane of exp8 (the same values as the vector
// path, for the tail of a row).
RS_ALWAYS_INLINE float exp_acc(float x) { return exp8(splat8(x))[0]; }
inline double exp_acc(double x) { return std::exp(x); }

// Lane u of the result is the sum of the lanes of a[u]: eight dot products
// finished with 14 shuffles and 7 adds instead of eight separate reductions.
// (__builtin_shufflevector: clang, and GCC from 12.)
RS_ALWAYS_INLINE v8 hsum8x8(const v8* a) {
  auto pairs = [](v8 x, v8 y) {
    return __builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
  };
  auto quads = [](v8 x, v8 y) {
    return __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  };
  const v8 u0 = quads(pairs(a[0], a[1]), pairs(a[2], a[3]));
  const v8 u1 = quads(pairs(a[4], a[5]), pairs(a[6], a[7]));
  return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// The eight-lane sum of a vector's halves (v16), or the vector itself (v8).
RS_ALWAYS_INLINE v8 fold8(v8 a) { return a; }
RS_ALWAYS_INLINE v8 fold8(v16 a) {
  return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}

// Scores of one query vector against eight keys (float32, head_dim a multiple of
// V's lanes).
template <typename V>
RS_ALWAYS_INLINE v8 dot8(const float* q, const float* const* k, int64_t off, int64_t D) {
  constexpr int L = lanes<V>();
  V a[8];
  for (int u = 0; u < 8; ++u) a[u] = splat<V>(0);
  for (int64_t c = 0; c < D; c += L) {
    const V qv = loadv<V>(q + c);
    for (int u = 0; u < 8; ++u) a[u] += loadv<V>(k[u] + off + c) * qv;
  }
  v8 f[8];
  for (int u = 0; u < 8; ++u) f[u] = fold8(a[u]);
  return hsum8x8(f);
}

// acc[0:L*NV] += sum over the block's keys of p[b] * v[b][off:off+L*NV], with the
// accumulators in registers for the whole block.
template <typename V, int NV>
RS_ALWAYS_INLINE void axpy_block(float* acc, const float* p, const float* const* v, int64_t off,
                                 int64_t nb) {
  constexpr int L = lanes<V>();
  V a[NV];
  for (int u = 0; u < NV; ++u) a[u] = loadv<V>(acc + L * u);
  for (int64_t b = 0; b < nb; ++b) {
    const float pb = p[b];
    const float* vb = v[b] + off;
    for (int u = 0; u < NV; ++u) a[u] += loadv<V>(vb + L * u) * pb;
  }
  for (int u = 0; u < NV; ++u) storev(acc + L * u, a[u]);
}

struct Item {
  int64_t seg, k0, k1;  // keys [k0, k1) of the segment
  int64_t partial;               // first partial slot (one per query vector)
};

using Problem = radixserve::PagedDecode;


// Keys handled together: their rows (K, then V) stay in L1 while every query
// vector of the item meets them.
constexpr int64_t kBlock = 16;
// Rows of the next block an item prefetches while it works on this one (see
// load_block): all of them.
constexpr int64_t kPrefetchRows = kBlock;

// Pointers to rows [j0, j0 + nb) of K (which = 0) or V (1) of a segment's pages,
// in the compute type (bfloat16 rows converted into conv): one division per
// block, then page by page. The first rows of the block after (up to key k1) are
// prefetched: pages are scattered, so the hardware prefetcher loses the stream at
// every page boundary.
template <typename T, typename A>
RS_ALWAYS_INLINE void load_block(const T* kv, const int32_t* pages, int64_t ps, int64_t row_len,
                                 int64_t j0, int64_t nb, int64_t k1, int64_t which, A* conv,
                                 const A** out) {
  const int64_t page_stride = 2 * ps * row_len;
  const int64_t row_bytes = row_len * static_cast<int64_t>(sizeof(T));
  int64_t pi = j0 / ps, off = j0 % ps;
  const T* page = kv + pages[pi] * page_stride + which * ps * row_len;
  for (int64_t b = 0; b < nb; ++b) {
    const T* p = page + off * row_len;
    if constexpr (std::is_same<T, A>::value) {
      out[b] = p;
    } else {
      A* c = conv + b * row_len;
      for (int64_t d = 0; d < row_len; ++d) c[d] = to_acc(p[d]);
      out[b] = c;
    }
    if (++off == ps && b + 1 < nb) {
      off = 0;
      page = kv + pages[++pi] * page_stride + which * ps * row_len;
    }
  }
  const int64_t next = j0 + nb, n_pf = std::min(kPrefetchRows, k1 - next);
  for (int64_t r = 0, npi = next / ps, noff = next % ps; r < n_pf; ++r) {
    const char* n = reinterpret_cast<const char*>(kv + pages[npi] * page_stride +
                                                  which * ps * row_len + noff * row_len);
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(n + o);
    if (++noff == ps) noff = 0, ++npi;
  }
}

#if RS_X86
// 16 codes' values before their row's scale, divided by codes16_unit (code_value
// = codes16_value * codes16_unit, exactly: the unit is a power of two, so callers
// fold it into the scale). An fp8 code is a float16's high bits: e5m2 is exactly
// the top byte of the float16 of the same value; e4m3's exponent and mantissa,
// shifted to the float16's places (the sign-extended byte shifted by 7, bit 14
// cleared), give its value / 2^8, normals and subnormals alike (float16's bias is
// 8 more). vcvtph2ps then widens exactly.
template <int Kind>
constexpr float codes16_unit() {
  return Kind == 2 ? 256.0f : 1.0f;
}
template <int Kind>
RS_TARGET_AVX512 RS_ALWAYS_INLINE __m512 codes16_value(const uint8_t* codes) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  if constexpr (Kind == 1) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
  } else if constexpr (Kind == 3) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(c), 8));
  } else {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(c), 7),
                                       _mm256_set1_epi16(static_cast<short>(0xbfff)));
    return _mm512_cvtph_ps(h);
  }
}
#endif

#if RS_X86
// D codes (D % 16 == 0) times their row's scale, as float32 (a call from the
// untargeted loaders of the avx512 items).
template <int Kind>
RS_TARGET_AVX512 void codes_to_float_avx512(const uint8_t* codes, float sc, int64_t D,
                                            float* dst) {
  const __m512 vsc = _mm512_set1_ps(sc * codes16_unit<Kind>());
  for (int64_t d = 0; d < D; d += 16)
    _mm512_storeu_ps(dst + d, _mm512_mul_ps(codes16_value<Kind>(codes + d), vsc));
}
#endif

// load_block for a quantized pool: rows of KVH x (D codes, a float16 scale) bytes,
// each turned into KVH x D values of the compute type in conv (code * scale); with
// 16-float vectors (avx512 and up, D % 16 == 0) by codes16_value.
template <int Kind, typename V = v8, typename A>
RS_ALWAYS_INLINE void load_block_q(const Q8<Kind>* kv, const int32_t* pages, int64_t ps,
                                   int64_t KVH, int64_t D, int64_t j0, int64_t nb, int64_t k1,
                                   int64_t which, A* conv, const A** out) {
  const uint8_t* base = reinterpret_cast<const uint8_t*>(kv);
  const int64_t E = D + 2, row = KVH * E, page_stride = 2 * ps * row;
  int64_t pi = j0 / ps, off = j0 % ps;
  const uint8_t* page = base + pages[pi] * page_stride + which * ps * row;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = page + off * row;
    A* c = conv + b * KVH * D;
    for (int64_t h = 0; h < KVH; ++h) {
      const uint8_t* codes = p + h * E;
      uint16_t sb;
      std::memcpy(&sb, codes + D, sizeof sb);
      // A negative scale in an fp8 pool: a sink row of int8 codes (kv_quant.quantize_sink).
      const bool sink = Kind != 1 && (sb & 0x8000u);
      const A sc = static_cast<A>(half_to_float(sb & 0x7fffu));
      A* dst = c + h * D;
#if RS_X86
      if constexpr (std::is_same<V, v16>::value && std::is_same<A, float>::value) {
        if (sink)
          codes_to_float_avx512<1>(codes, sc, D, dst);
        else
          codes_to_float_avx512<Kind>(codes, sc, D, dst);
        continue;
      }
#endif
      if (sink) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<A>(code_value(Q8<1>{codes[d]})) * sc;
        continue;
      }
#pragma omp simd
      for (int64_t d = 0; d < D; ++d)
        dst[d] = static_cast<A>(code_value(Q8<Kind>{codes[d]})) * sc;
    }
    out[b] = c;
    if (++off == ps && b + 1 < nb) {
      off = 0;
      page = base + pages[++pi] * page_stride + which * ps * row;
    }
  }
  const int64_t next = j0 + nb, n_pf = std::min(kPrefetchRows, k1 - next);
  for (int64_t r = 0, npi = next / ps, noff = next % ps; r < n_pf; ++r) {
    const uint8_t* n = base + pages[npi] * page_stride + which * ps * row + noff * row;
    for (int64_t o = 0; o < row; o += 64) __builtin_prefetch(n + o);
    if (++noff == ps) noff = 0, ++npi;
  }
}

// Rows [j0, j0 + nb) of K or V in the compute type, whatever the pool stores.
template <typename V, typename KV, typename A>
RS_ALWAYS_INLINE void load_rows(const KV* kv, const int32_t* pages, int64_t ps, int64_t KVH,
                                int64_t D, int64_t j0, int64_t nb, int64_t k1, int64_t which,
                                A* conv, const A** out) {
  if constexpr (IsQuant<KV>::value) {
    load_block_q<KV::kKind, V>(kv, pages, ps, KVH, D, j0, nb, k1, which, conv, out);
  } else {
    load_block(kv, pages, ps, KVH * D, j0, nb, k1, which, conv, out);
  }
}

// Soft-capping (Gemma 2) of the scaled scores, then each query vector's softmax
// statistics (max m, sum l of exp(s - m)) into its partial slot; sc [nq][len]
// becomes the unnormalised probabilities. The statistics (and the lse the caller
// merges with) are those of the capped scores.
//
// In a causal segment a query vector sees only the first keys of the item (the
// rest are the chunk's later tokens): their scores are set to -inf after the cap,
// and a vector that sees none of the item's keys gets m = -inf, l = 0 and zero
// probabilities (the merge then gives that item no weight).
template <typename A, typename V>
RS_ALWAYS_INLINE void softmax_rows(A* sc, int64_t nq, int64_t len, double softcap, A* pm,
                                   A* pl, int64_t partial, const Problem& P, const Item& it) {
  constexpr int L = lanes<V>();
  if (softcap > 0) {
    const A cap = static_cast<A>(softcap);
    for (int64_t i = 0; i < nq * len; ++i) sc[i] = cap * std::tanh(sc[i] / cap);
  }
  const bool causal = P.causal && P.causal[it.seg];
  const bool padded = P.fixed > 0 && it.k1 - it.k0 < len;  // keys past k1 are zero rows
  const int64_t nrows = P.row_indptr[it.seg + 1] - P.row_indptr[it.seg];
  // Softmax statistics; slot order is [kv head][row][group member] like qs.
  for (int64_t i = 0; i < nq; ++i) {
    A* si = sc + i * len;
    if (causal) {
      const int64_t r = (i / P.group) % nrows;
      const int64_t seen = P.kv_end[it.seg] - (nrows - 1 - r) - it.k0;
      if (seen <= 0) {
        std::fill(si, si + len, A(0));
        pm[partial + i] = -std::numeric_limits<A>::infinity();
        pl[partial + i] = 0;
        continue;
      }
      for (int64_t j = seen; j < len; ++j) si[j] = -std::numeric_limits<A>::infinity();
    } else if (padded) {
      for (int64_t j = it.k1 - it.k0; j < len; ++j) si[j] = -std::numeric_limits<A>::infinity();
    }
    A m = -std::numeric_limits<A>::infinity();
    A l = 0;
    int64_t j = 0;
    if constexpr (std::is_same<A, float>::value) {  // L at a time, by hand
      V mv = splat<V>(m);
      for (; j + L <= len; j += L) {
        const V x = loadv<V>(si + j);
        mv = x > mv ? x : mv;
      }
      for (int k = 0; k < L; ++k) m = std::max(m, mv[k]);
      for (; j < len; ++j) m = std::max(m, si[j]);
      V lv = splat<V>(0);
      for (j = 0; j + L <= len; j += L) {
        const V e = expv(loadv<V>(si + j) - m);
        storev(si + j, e);
        lv += e;
      }
      for (int k = 0; k < L; ++k) l += lv[k];
    } else {
      for (; j < len; ++j) m = std::max(m, si[j]);
      j = 0;
    }
    for (; j < len; ++j) {
      const A e = exp_acc(si[j] - m);
      si[j] = e;
      l += e;
    }
    pm[partial + i] = m;
    pl[partial + i] = l;
  }
}

// One item: scores of every query vector of the segment (all rows, all heads)
// against the item's keys, softmax statistics per query vector, and the
// unnormalised weighted sum of values. A key position's K (or V) row holds all
// kv heads side by side, so the item walks the pages front to back, a block of
// contiguous rows at a time. Float vectors are V (v8 or v16).
template <typename T, typename KV, typename V>
RS_ALWAYS_INLINE void run_item_impl(const Problem& P, const Item& it, const T* q, const KV* kv,
                                    Acc<T>* pm, Acc<T>* pl, Acc<T>* pacc,
                                    std::vector<Acc<T>>& scratch) {
  using A = Acc<T>;
  constexpr int L = lanes<V>();
  const int64_t D = P.head_dim, G = P.group, H = P.num_heads, KVH = P.num_kv_heads;
  const int64_t ps = P.page_size;
  const int64_t r0 = P.row_indptr[it.seg], r1 = P.row_indptr[it.seg + 1];
  // In batch-invariant mode every item spans P.fixed keys; those past k1 are zero rows,
  // masked in softmax_rows.
  const int64_t real = it.k1 - it.k0;
  const int64_t nrows = r1 - r0, nq = nrows * H, len = P.fixed > 0 ? P.fixed : real;
  const int64_t row_len = KVH * D;
  // Query vectors ordered [kv head][row][group member], so that the vectors one
  // kv head's keys meet are contiguous.
  scratch.resize(static_cast<size_t>(nq * D + nq * len + kBlock * row_len + row_len));
  A* qs = scratch.data();      // [KVH, nrows, G, D], scaled
  A* sc = qs + nq * D;         // [nq, len] scores, then probabilities
  A* conv = sc + nq * len;     // a block of K or V rows in the compute type
  A* zero = conv + kBlock * row_len;  // the row keys past k1 read (batch-invariant mode)
  std::fill(zero, zero + row_len, A(0));
  const A scale = static_cast<A>(P.scale);
  for (int64_t r = 0; r < nrows; ++r) {
    const T* src = q + static_cast<int64_t>(P.rows[r0 + r]) * H * D;
    for (int64_t h = 0; h < KVH; ++h) {
      A* dst = qs + ((h * nrows + r) * G) * D;
      const T* from = src + h * G * D;
      for (int64_t i = 0; i < G * D; ++i) dst[i] = to_acc(from[i]) * scale;
    }
  }
  const int32_t* pages = P.pages + P.page_indptr[it.seg];
  const int64_t per_head = nrows * G;  // query vectors per kv head
  // float32 with head_dim a multiple of the lanes runs the hand-vectorised loops
  // (dot8, axpy_block); other cases the compiler-vectorised ones below them.
  const bool vec = std::is_same<A, float>::value && D % L == 0;
  const A* rows[kBlock];
  // Scores, a block of keys at a time: each query vector meets eight keys per
  // pass, so eight independent dot products are in flight (one alone is a chain
  // of dependent FMAs, bound by their latency).
  for (int64_t jb = 0; jb < len; jb += kBlock) {
    const int64_t nb = std::min(kBlock, len - jb);
    const int64_t nb_real = std::max<int64_t>(0, std::min(nb, real - jb));
    if (nb_real > 0) load_rows<V>(kv, pages, ps, KVH, D, it.k0 + jb, nb_real, it.k1, 0, conv, rows);
    for (int64_t b = nb_real; b < nb; ++b) rows[b] = zero;
    for (int64_t h = 0; h < KVH; ++h) {
      const A* qh = qs + h * per_head * D;
      A* sh = sc + h * per_head * len + jb;
      for (int64_t i = 0; i < per_head; ++i) {
        const A* qi = qh + i * D;
        A* si = sh + i * len;
        int64_t b = 0;
        if constexpr (std::is_same<A, float>::value) {
          if (vec) {
            for (; b + 8 <= nb; b += 8) store8(si + b, dot8<V>(qi, rows + b, h * D, D));
          }
        }
        for (; b + 8 <= nb; b += 8) {
          const A *k0 = rows[b] + h * D, *k1 = rows[b + 1] + h * D;
          const A *k2 = rows[b + 2] + h * D, *k3 = rows[b + 3] + h * D;
          const A *k4 = rows[b + 4] + h * D, *k5 = rows[b + 5] + h * D;
          const A *k6 = rows[b + 6] + h * D, *k7 = rows[b + 7] + h * D;
          A s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5, s6, s7)
          for (int64_t d = 0; d < D; ++d) {
            const A x = qi[d];
            s0 += x * k0[d];
            s1 += x * k1[d];
            s2 += x * k2[d];
            s3 += x * k3[d];
            s4 += x * k4[d];
            s5 += x * k5[d];
            s6 += x * k6[d];
            s7 += x * k7[d];
          }
          si[b] = s0;
          si[b + 1] = s1;
          si[b + 2] = s2;
          si[b + 3] = s3;
          si[b + 4] = s4;
          si[b + 5] = s5;
          si[b + 6] = s6;
          si[b + 7] = s7;
        }
        for (; b < nb; ++b) {
          const A* k = rows[b] + h * D;
          A s0 = 0;
#pragma omp simd reduction(+ : s0)
          for (int64_t d = 0; d < D; ++d) s0 += qi[d] * k[d];
          si[b] = s0;
        }
      }
    }
  }
  softmax_rows<A, V>(sc, nq, len, P.softcap, pm, pl, it.partial, P, it);
  A* acc = pacc + it.partial * D;
  std::fill(acc, acc + nq * D, A(0));
  // Values, a block of keys at a time: one query vector's accumulator takes the
  // whole block before it is stored again.
  for (int64_t jb = 0; jb < len; jb += kBlock) {
    const int64_t nb = std::min(kBlock, len - jb);
    const int64_t nb_real = std::max<int64_t>(0, std::min(nb, real - jb));
    if (nb_real > 0) load_rows<V>(kv, pages, ps, KVH, D, it.k0 + jb, nb_real, it.k1, 1, conv, rows);
    for (int64_t b = nb_real; b < nb; ++b) rows[b] = zero;
    for (int64_t h = 0; h < KVH; ++h) {
      const A* ph = sc + h * per_head * len + jb;
      A* ah = acc + h * per_head * D;
      for (int64_t i = 0; i < per_head; ++i) {
        const A* p = ph + i * len;
        A* ai = ah + i * D;
        if constexpr (std::is_same<A, float>::value) {
          if (vec) {
            int64_t c = 0;
            for (; c + 64 <= D; c += 64) axpy_block<V, 64 / L>(ai + c, p, rows, h * D + c, nb);
            for (; c < D; c += L) axpy_block<V, 1>(ai + c, p, rows, h * D + c, nb);
            continue;
          }
        }
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4) {
          const A *v0 = rows[b] + h * D, *v1 = rows[b + 1] + h * D;
          const A *v2 = rows[b + 2] + h * D, *v3 = rows[b + 3] + h * D;
          const A p0 = p[b], p1 = p[b + 1], p2 = p[b + 2], p3 = p[b + 3];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d)
            ai[d] += (p0 * v0[d] + p1 * v1[d]) + (p2 * v2[d] + p3 * v3[d]);
        }
        for (; b < nb; ++b) {
          const A* v = rows[b] + h * D;
          const A pb = p[b];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ai[d] += pb * v[d];
        }
      }
    }
  }
}

#if RS_X86
// ---- avx512bf16: bfloat16 products for segments that many query vectors read ----
//
// A cascade prefix is read by every member's query vectors (members x group per kv
// head): there the item is a small matrix product, and the scores and the value sums
// run as vdpbf16ps tiles, each instruction 16 lanes x one bfloat16 pair:
//   scores  lanes = 16 keys, pairs over head_dim: the query pair is broadcast and
//           meets a tile of 32 keys whose K rows are transposed into [D/2][32] pairs
//           (once per tile, for all query vectors of the kv head);
//   values  lanes = 16 features, pairs over keys: a query's probabilities of two
//           consecutive keys, rounded to bfloat16 (as GPU flash attention does for
//           its P x V product), are broadcast and meet V rows interleaved in key
//           pairs ([len/2][D] pairs, packed once per item and kv head).
// Queries stay exact (the pool and q are bfloat16 already), products are exact in
// float32 and summed in float32; the scale is applied to the summed score. The
// softmax statistics between the two are the float32 ones of the other paths.

// Query vectors per kv head from which an item takes the vdpbf16ps tiles: below,
// packing K and V costs more than the products save.
constexpr int64_t kDpMinQueries = 8;
constexpr int64_t kDpKeys = 32;    // keys per score tile: two 16-lane vectors
constexpr int kDpScoreRows = 8;    // query vectors per score tile (16 accumulators)
constexpr int kDpValueCols = 4;    // 16-feature vectors per value tile (64 features)
constexpr int kDpValueRows = 6;    // query vectors per value tile (24 accumulators)

// Scores of R query vectors (qp: rows of D2 pairs) against one tile of nb <= 32 keys
// (kt: [D2][32] pairs), scaled, into rows of sc (stride len) at column j0.
template <int R>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void dp_score_tile(const uint32_t* qp, int64_t D2,
                                                         const uint32_t* kt, float scale,
                                                         float* sc, int64_t len, int64_t j0,
                                                         int64_t nb) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const bool two = nb > 16;
  for (int64_t p = 0; p < D2; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * kDpKeys);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + p * kDpKeys + 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * D2 + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
      if (two) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  const __mmask16 m0 = static_cast<__mmask16>(nb >= 16 ? 0xffffu : (1u << nb) - 1);
  const __mmask16 m1 =
      static_cast<__mmask16>(nb >= 32 ? 0xffffu : two ? (1u << (nb - 16)) - 1 : 0u);
  for (int r = 0; r < R; ++r) {
    float* dst = sc + r * len + j0;
    _mm512_mask_storeu_ps(dst, m0, _mm512_mul_ps(acc[r][0], s));
    if (two) _mm512_mask_storeu_ps(dst + 16, m1, _mm512_mul_ps(acc[r][1], s));
  }
}

// out[r][16c + j] = sum over key pairs kp of pp[r][kp] . vp[kp][16c + j] for C
// 16-feature vectors starting at feature d0 (pp: rows of np2 pairs, vp: [np2][D] pairs).
template <int R, int C>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void dp_value_tile(const uint32_t* pp, int64_t np2,
                                                         const uint32_t* vp, int64_t D,
                                                         int64_t d0, float* out) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < np2; ++kp) {
    __m512bh v[C];
    for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + kp * D + d0 + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * np2 + kp]));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, v[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * D + d0 + 16 * c, acc[r][c]);
}

// Rows [i, i + R) of every score tile, R < kDpScoreRows chosen at run time.
template <int R = kDpScoreRows - 1>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void dp_score_rest(int rest, const uint32_t* qp,
                                                         int64_t D2, const uint32_t* kt,
                                                         float scale, float* sc, int64_t len,
                                                         int64_t j0, int64_t nb) {
  if constexpr (R > 0) {
    if (rest == R) return dp_score_tile<R>(qp, D2, kt, scale, sc, len, j0, nb);
    dp_score_rest<R - 1>(rest, qp, D2, kt, scale, sc, len, j0, nb);
  }
}

template <int R>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void dp_value_cols(int cols, const uint32_t* pp,
                                                         int64_t np2, const uint32_t* vp,
                                                         int64_t D, int64_t d0, float* out) {
  switch (cols) {
    case 1: return dp_value_tile<R, 1>(pp, np2, vp, D, d0, out);
    case 2: return dp_value_tile<R, 2>(pp, np2, vp, D, d0, out);
    case 3: return dp_value_tile<R, 3>(pp, np2, vp, D, d0, out);
    default: return dp_value_tile<R, 4>(pp, np2, vp, D, d0, out);
  }
}

template <int R = kDpValueRows>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void dp_value_rows(int rows, int cols, const uint32_t* pp,
                                                         int64_t np2, const uint32_t* vp,
                                                         int64_t D, int64_t d0, float* out) {
  if constexpr (R > 0) {
    if (rows == R) return dp_value_cols<R>(cols, pp, np2, vp, D, d0, out);
    dp_value_rows<R - 1>(rows, cols, pp, np2, vp, D, d0, out);
  }
}

// The 32-bit word p (bfloat16 features 2p, 2p + 1) of a bfloat16 row.
RS_ALWAYS_INLINE uint32_t pair_at(const BF16* row, int64_t p) {
  uint32_t w;
  std::memcpy(&w, row + 2 * p, sizeof w);
  return w;
}

// Brings rows [from, from + n) of K (which = 0) or V (1), every kv head's part, into
// the cache.
RS_ALWAYS_INLINE void prefetch_key_rows(const BF16* kv, const int32_t* pages, int64_t ps,
                                        int64_t page_stride, int64_t row_len, int64_t from,
                                        int64_t n, int64_t which) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = from + j;
    const char* row = reinterpret_cast<const char*>(kv + pages[pos / ps] * page_stride +
                                                    which * ps * row_len + (pos % ps) * row_len);
    for (int64_t o = 0; o < row_len * 2; o += 64) __builtin_prefetch(row + o);
  }
}

// One item by vdpbf16ps tiles (bfloat16 pool, head_dim % 16 == 0): the same
// partial results as run_item_impl.
RS_TARGET_AVX512BF16 void run_item_dp(const Problem& P, const Item& it, const BF16* q,
                                      const BF16* kv, float* pm, float* pl, float* pacc,
                                      std::vector<float>& scores,
                                      const BF16* converted = nullptr) {
  static thread_local std::vector<uint32_t> packed;
  const int64_t D = P.head_dim, D2 = D / 2, G = P.group, H = P.num_heads, KVH = P.num_kv_heads;
  const int64_t ps = P.page_size, row_len = KVH * D, page_stride = 2 * ps * row_len;
  const int64_t r0 = P.row_indptr[it.seg], nrows = P.row_indptr[it.seg + 1] - r0;
  const int64_t per_head = nrows * G, nq = per_head * KVH, len = it.k1 - it.k0;
  const int64_t np2 = (len + 1) / 2;
  // AMX tiles take 16 query vectors and 16 pairs at a time: qp and pp get zero rows
  // up to a multiple of 16, pp and vp zero key pairs up to one.
  const bool amx = P.amx && D % 32 == 0 && radixserve::amx_attention_begin();
  const int64_t nq16 = amx ? (per_head + 15) / 16 * 16 : per_head;
  const int64_t np2p = amx ? (np2 + 15) / 16 * 16 : np2;
  scores.resize(static_cast<size_t>(nq * len));
  // qp [nq16][D2] | kt [D2][32] | vp [np2p][D] | pp [nq16][np2p]
  packed.resize(static_cast<size_t>(nq16 * D2 + D2 * kDpKeys + np2p * D + nq16 * np2p));
  uint32_t* qp = packed.data();
  uint32_t* kt = qp + nq16 * D2;
  uint32_t* vp = kt + D2 * kDpKeys;
  uint32_t* pp = vp + np2p * D;
  if (amx) {
    std::fill(qp + per_head * D2, qp + nq16 * D2, 0u);
    std::fill(vp + np2 * D, vp + np2p * D, 0u);
    std::fill(pp + per_head * np2p, pp + nq16 * np2p, 0u);
  }
  const int32_t* pages = P.pages + P.page_indptr[it.seg];
  // converted: the item's K rows then V rows ([2][len][row_len]), from a quantized pool.
  auto key_row = [&](int64_t j, int64_t which, int64_t h) {  // K (0) or V (1) of key k0 + j
    if (converted) return converted + (which * len + j) * row_len + h * D;
    const int64_t pos = it.k0 + j;
    return kv + pages[pos / ps] * page_stride + which * ps * row_len + (pos % ps) * row_len +
           h * D;
  };
  // Keys are read head by head, each head a slice of every key's row: the first head's
  // pass fetches whole rows (every head's slice) one block ahead, so the rows are in
  // cache for it and for the heads after it (pages are scattered: the hardware
  // prefetcher loses the stream at every page boundary).
  // (A plain call: a lambda around the prefetches would be compiled for the baseline
  // target, found free of side effects and its calls dropped.)
  const float scale = static_cast<float>(P.scale);
  for (int64_t h = 0; h < KVH; ++h) {
    for (int64_t r = 0; r < nrows; ++r) {  // this kv head's query vectors, [row][member]
      const BF16* src = q + (static_cast<int64_t>(P.rows[r0 + r]) * H + h * G) * D;
      std::memcpy(qp + r * G * D2, src, static_cast<size_t>(G * D) * sizeof(BF16));
    }
    float* sh = scores.data() + h * per_head * len;
    for (int64_t j0 = 0; j0 < len; j0 += kDpKeys) {
      const int64_t nb = std::min(kDpKeys, len - j0);
      if (h == 0 && !converted) {  // K one block ahead; after the last, V's first block
        const bool last = j0 + kDpKeys >= len;
        prefetch_key_rows(kv, pages, ps, page_stride, row_len, it.k0 + (last ? 0 : j0 + kDpKeys),
                          std::min(kDpKeys, last ? len : len - j0 - kDpKeys), last ? 1 : 0);
      }
      for (int64_t j = 0; j < kDpKeys; ++j) {
        if (j < nb) {
          const BF16* k = key_row(j0 + j, 0, h);
          for (int64_t p = 0; p < D2; ++p) kt[p * kDpKeys + j] = pair_at(k, p);
        } else {
          for (int64_t p = 0; p < D2; ++p) kt[p * kDpKeys + j] = 0;
        }
      }
      if (amx) {
        radixserve::amx_score_tile(qp, per_head, D2, kt, scale, sh, len, j0, nb);
        continue;
      }
      int64_t i = 0;
      for (; i + kDpScoreRows <= per_head; i += kDpScoreRows)
        dp_score_tile<kDpScoreRows>(qp + i * D2, D2, kt, scale, sh + i * len, len, j0, nb);
      if (i < per_head)
        dp_score_rest(static_cast<int>(per_head - i), qp + i * D2, D2, kt, scale, sh + i * len,
                      len, j0, nb);
    }
  }
  softmax_rows<float, v16>(scores.data(), nq, len, P.softcap, pm, pl, it.partial, P, it);
  // V of key pairs interleaved: word d of pair kp is (V[2kp][d], V[2kp + 1][d]).
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t h = 0; h < KVH; ++h) {
    for (int64_t kp = 0; kp < np2; ++kp) {
      if (h == 0 && kp % 16 == 0 && !converted)
        prefetch_key_rows(kv, pages, ps, page_stride, row_len, it.k0 + 2 * kp + kDpKeys,
                          std::min(kDpKeys, len - 2 * kp - kDpKeys), 1);
      const BF16* a = key_row(2 * kp, 1, h);
      const bool partner = 2 * kp + 1 < len;
      const BF16* b = partner ? key_row(2 * kp + 1, 1, h) : a;
      uint32_t* dst = vp + kp * D;
      for (int64_t d = 0; d < D; d += 32) {
        const int64_t n = std::min<int64_t>(32, D - d);
        const __mmask32 m = n == 32 ? 0xffffffffu : (1u << n) - 1;
        const __m512i va = _mm512_maskz_loadu_epi16(m, a + d);
        const __m512i vb = partner ? _mm512_maskz_loadu_epi16(m, b + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(va, lo, vb));
        if (n == 32) _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(va, hi, vb));
      }
    }
    // Probabilities in bfloat16, in key pairs (the pair past an odd len is (p, 0), and
    // the pairs up to np2p are zero).
    const float* sh = scores.data() + h * per_head * len;
    for (int64_t i = 0; i < per_head; ++i) {
      const float* src = sh + i * len;
      uint16_t* dst = reinterpret_cast<uint16_t*>(pp + i * np2p);
      for (int64_t j = 0; j < 2 * np2p; j += 16) {
        const int64_t n = std::min<int64_t>(16, len - j);
        const __mmask16 m = static_cast<__mmask16>(n >= 16 ? 0xffffu : n > 0 ? (1u << n) - 1 : 0u);
        const __m256bh b16 = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + j));
        const int64_t w = std::min<int64_t>(16, 2 * np2p - j);
        _mm256_mask_storeu_epi16(dst + j, static_cast<__mmask16>(w >= 16 ? 0xffffu : (1u << w) - 1),
                                 (__m256i)b16);
      }
    }
    float* acc = pacc + (it.partial + h * per_head) * D;
    if (amx) {
      radixserve::amx_value_rows(pp, per_head, np2p, np2p, vp, D, acc);
      continue;
    }
    for (int64_t i = 0; i < per_head; i += kDpValueRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kDpValueRows, per_head - i));
      for (int64_t d0 = 0; d0 < D; d0 += 16 * kDpValueCols) {
        const int cols = static_cast<int>(std::min<int64_t>(kDpValueCols, (D - d0) / 16));
        dp_value_rows(rows, cols, pp + i * np2, np2, vp, D, d0, acc + i * D);
      }
    }
  }
  if (amx) radixserve::amx_attention_end();
}
#endif  // RS_X86

// One item, compiled per instruction set (cpu_kernels.h).
template <typename T, typename KV>
using ItemFn = void (*)(const Problem&, const Item&, const T*, const KV*, Acc<T>*, Acc<T>*,
                        Acc<T>*, std::vector<Acc<T>>&);

template <typename T, typename KV>
void item_baseline(const Problem& P, const Item& it, const T* q, const KV* kv, Acc<T>* pm,
                   Acc<T>* pl, Acc<T>* pacc, std::vector<Acc<T>>& scratch) {
  run_item_impl<T, KV, v8>(P, it, q, kv, pm, pl, pacc, scratch);
}

template <typename T, typename KV>
RS_TARGET_AVX2 void item_avx2(const Problem& P, const Item& it, const T* q, const KV* kv,
                              Acc<T>* pm, Acc<T>* pl, Acc<T>* pacc,
                              std::vector<Acc<T>>& scratch) {
  run_item_impl<T, KV, v8>(P, it, q, kv, pm, pl, pacc, scratch);
}

// 16-float vectors where head_dim allows them, else 8-float ones (still with
// AVX-512's 32 registers and instructions).
template <typename T, typename KV>
RS_TARGET_AVX512 void item_avx512(const Problem& P, const Item& it, const T* q, const KV* kv,
                                  Acc<T>* pm, Acc<T>* pl, Acc<T>* pacc,
                                  std::vector<Acc<T>>& scratch) {
  if (P.head_dim % 16 == 0) {
    run_item_impl<T, KV, v16>(P, it, q, kv, pm, pl, pacc, scratch);
  } else {
    run_item_impl<T, KV, v8>(P, it, q, kv, pm, pl, pacc, scratch);
  }
}

#if RS_X86
// Rows [j0, j0 + len) of a quantized pool's K, then its V, as bfloat16
// ([2][len][KVH * D]): code * scale in float32, rounded to nearest even, 16 values
// per conversion (D % 16 == 0). The same values load_block_q then from_acc give.
template <int Kind>
RS_TARGET_AVX512BF16 void quant_rows_to_bf16(const Q8<Kind>* kv, const int32_t* pages,
                                             int64_t ps, int64_t KVH, int64_t D, int64_t j0,
                                             int64_t len, BF16* out) {
  const uint8_t* base = reinterpret_cast<const uint8_t*>(kv);
  const int64_t E = D + 2, row = KVH * E, page_stride = 2 * ps * row;
  for (int64_t which = 0; which < 2; ++which) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(out + which * len * KVH * D);
    for (int64_t j = j0; j < j0 + len;) {
      const int64_t off = j % ps, n = std::min(ps - off, j0 + len - j);
      const uint8_t* p = base + pages[j / ps] * page_stride + which * ps * row + off * row;
      for (int64_t r = 0; r < n; ++r, p += row) {
        for (int64_t h = 0; h < KVH; ++h, dst += D) {
          const uint8_t* codes = p + h * E;
          uint16_t sb;
          std::memcpy(&sb, codes + D, sizeof sb);
          const float sc = half_to_float(sb & 0x7fffu);
          if (Kind != 1 && (sb & 0x8000u)) {  // a sink row: int8 codes (load_block_q)
            const __m512 vs = _mm512_set1_ps(sc);
            for (int64_t d = 0; d < D; d += 16) {
              const __m512 v = _mm512_mul_ps(codes16_value<1>(codes + d), vs);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                                  (__m256i)_mm512_cvtneps_pbh(v));
            }
            continue;
          }
          const __m512 vsc = _mm512_set1_ps(sc * codes16_unit<Kind>());
          for (int64_t d = 0; d < D; d += 16) {
            const __m512 v = _mm512_mul_ps(codes16_value<Kind>(codes + d), vsc);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                                (__m256i)_mm512_cvtneps_pbh(v));
          }
        }
      }
      j += n;
    }
  }
}

// avx512bf16: a bfloat16 item that many query vectors read takes the vdpbf16ps
// tiles, any other the avx512 loops.
template <typename T, typename KV>
RS_TARGET_AVX512BF16 void item_avx512bf16(const Problem& P, const Item& it, const T* q,
                                          const KV* kv, Acc<T>* pm, Acc<T>* pl, Acc<T>* pacc,
                                          std::vector<Acc<T>>& scratch) {
  if constexpr (std::is_same<T, BF16>::value) {
    const int64_t per_head = (P.row_indptr[it.seg + 1] - P.row_indptr[it.seg]) * P.group;
    if (P.fixed == 0 && P.head_dim % 16 == 0 && per_head >= kDpMinQueries) {
      if constexpr (std::is_same<KV, BF16>::value) {
        run_item_dp(P, it, q, kv, pm, pl, pacc, scratch);
        return;
      } else {
        // A quantized pool: the item's rows (code * scale) rounded to bfloat16 first,
        // as a bfloat16 pool would hold them, then the same tiles.
        static thread_local std::vector<BF16> rows;
        const int64_t len = it.k1 - it.k0;
        rows.resize(static_cast<size_t>(2 * len * P.num_kv_heads * P.head_dim));
        const int32_t* pages = P.pages + P.page_indptr[it.seg];
        quant_rows_to_bf16(kv, pages, P.page_size, P.num_kv_heads, P.head_dim, it.k0, len,
                           rows.data());
        run_item_dp(P, it, q, nullptr, pm, pl, pacc, scratch, rows.data());
        return;
      }
    }
  }
  item_avx512<T, KV>(P, it, q, kv, pm, pl, pacc, scratch);
}
#endif

template <typename T, typename KV>
ItemFn<T, KV> item_fn(Isa isa) {
  switch (isa) {
    case Isa::kBaseline:
      return item_baseline<T, KV>;
    case Isa::kAvx2:
      return item_avx2<T, KV>;
    case Isa::kAvx512:
      break;
    case Isa::kAvx512Bf16:
#if RS_X86
      return item_avx512bf16<T, KV>;
#else
      break;
#endif
  }
  return item_avx512<T, KV>;
}

template <typename T, typename KV = T>
void run(const Problem& P, const T* q, const KV* kv, T* out, float* lse_f, double* lse_d,
         Isa isa, int num_threads, int64_t chunk) {
  using A = Acc<T>;
  const ItemFn<T, KV> run_item = item_fn<T, KV>(isa);
  if (P.fixed > 0) chunk = P.fixed;
  const int64_t D = P.head_dim, G = P.group, H = P.num_heads, KVH = P.num_kv_heads;
  const int64_t num_segments = P.num_segments;
  // Items, and where each segment's chunks start.
  std::vector<Item> items;
  std::vector<int64_t> first_item(static_cast<size_t>(num_segments + 1), 0);
  int64_t slots = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t nq = (P.row_indptr[s + 1] - P.row_indptr[s]) * H;
    const int64_t b = P.kv_begin[s], e = P.kv_end[s];
    first_item[static_cast<size_t>(s)] = static_cast<int64_t>(items.size());
    for (int64_t k0 = b; k0 < e; k0 += chunk) {
      items.push_back(Item{s, k0, std::min(e, k0 + chunk), slots});
      slots += nq;
    }
  }
  first_item.back() = static_cast<int64_t>(items.size());
  // Every item writes all of its slots (its softmax statistics and its value sums, or
  // zeros where a causal row sees none of its keys), so the buffers are reused from
  // call to call without clearing: a fresh one of this size (hundreds of kB at a
  // decode batch of 32) would be mapped and page-faulted anew in every layer.
  // (The calling thread's buffers: the threads below reach them through the pointers.)
  static thread_local std::vector<A> pm_buf, pl_buf, pacc_buf;
  if (pm_buf.size() < static_cast<size_t>(slots)) {
    pm_buf.resize(static_cast<size_t>(slots));
    pl_buf.resize(static_cast<size_t>(slots));
  }
  if (pacc_buf.size() < static_cast<size_t>(slots * D))
    pacc_buf.resize(static_cast<size_t>(slots * D));
  A* const pm = pm_buf.data();
  A* const pl = pl_buf.data();
  A* const pacc = pacc_buf.data();
  const int64_t n_items = static_cast<int64_t>(items.size());

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<A> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      run_item(P, items[static_cast<size_t>(i)], q, kv, pm, pl, pacc, scratch);
    }
  }

  // Merge, per query row, the partial results of every item that row is in: the
  // chunks of its segment, and of every other segment holding it (a cascade
  // member's shared prefix and its own suffix are two segments).
  struct Part {
    int64_t row, item, local;  // q row; item; the row's index in its segment
  };
  std::vector<Part> parts;
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t r0 = P.row_indptr[s], nrows = P.row_indptr[s + 1] - r0;
    const int64_t i0 = first_item[static_cast<size_t>(s)];
    const int64_t i1 = first_item[static_cast<size_t>(s + 1)];
    for (int64_t r = 0; r < nrows; ++r) {
      if (i0 == i1) parts.push_back(Part{P.rows[r0 + r], -1, r});  // no keys: still written
      for (int64_t it = i0; it < i1; ++it) parts.push_back(Part{P.rows[r0 + r], it, r});
    }
  }
  std::stable_sort(parts.begin(), parts.end(),
                   [](const Part& a, const Part& b) { return a.row < b.row; });
  std::vector<int64_t> starts;
  for (size_t i = 0; i < parts.size(); ++i)
    if (i == 0 || parts[i].row != parts[i - 1].row) starts.push_back(static_cast<int64_t>(i));
  starts.push_back(static_cast<int64_t>(parts.size()));
  const int64_t num_out = static_cast<int64_t>(starts.size()) - 1;

#pragma omp parallel num_threads(num_threads)
  {
  std::vector<A> o(static_cast<size_t>(D));
#pragma omp for schedule(static)
  for (int64_t o_i = 0; o_i < num_out; ++o_i) {
    const int64_t b = starts[static_cast<size_t>(o_i)], e = starts[static_cast<size_t>(o_i + 1)];
    const int64_t qrow = parts[static_cast<size_t>(b)].row;
    auto slot_of = [&](const Part& pt, int64_t h, int64_t g) {
      const Item& it = items[static_cast<size_t>(pt.item)];
      const int64_t nrows = P.row_indptr[it.seg + 1] - P.row_indptr[it.seg];
      return it.partial + (h * nrows + pt.local) * G + g;
    };
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head = h * G + g;
        T* dst = out + (qrow * H + head) * D;
        A m = -std::numeric_limits<A>::infinity();
        for (int64_t k = b; k < e; ++k) {
          const Part& pt = parts[static_cast<size_t>(k)];
          if (pt.item >= 0) m = std::max(m, pm[static_cast<size_t>(slot_of(pt, h, g))]);
        }
        if (m == -std::numeric_limits<A>::infinity()) {  // no keys
          for (int64_t d = 0; d < D; ++d) from_acc(A(0), dst + d);
        } else {
          A l = 0;
          std::fill(o.begin(), o.end(), A(0));
          for (int64_t k = b; k < e; ++k) {
            const Part& pt = parts[static_cast<size_t>(k)];
            if (pt.item < 0) continue;
            const int64_t slot = slot_of(pt, h, g);
            const A w = std::exp(pm[static_cast<size_t>(slot)] - m);
            l += w * pl[static_cast<size_t>(slot)];
            const A* a = pacc + slot * D;
            for (int64_t d = 0; d < D; ++d) o[static_cast<size_t>(d)] += w * a[d];
          }
          for (int64_t d = 0; d < D; ++d) from_acc(o[static_cast<size_t>(d)] / l, dst + d);
          m += std::log(l);
        }
        if (lse_f) lse_f[qrow * H + head] = static_cast<float>(m);
        if (lse_d) lse_d[qrow * H + head] = static_cast<double>(m);
      }
    }
  }
  }
}

}  // namespace

namespace {

// A quantized pool with queries of type T.
template <typename T>
void run_quant(const Problem& P, radixserve::KVQuant quant, const void* q, const void* kv, void* out,
               float* lse_f, double* lse_d, Isa isa, int num_threads, int64_t chunk) {
  const T* qt = static_cast<const T*>(q);
  T* ot = static_cast<T*>(out);
  switch (quant) {
    case radixserve::KVQuant::kInt8:
      run<T, Q8<1>>(P, qt, static_cast<const Q8<1>*>(kv), ot, lse_f, lse_d, isa, num_threads,
                    chunk);
      break;
    case radixserve::KVQuant::kFp8E4M3:
      run<T, Q8<2>>(P, qt, static_cast<const Q8<2>*>(kv), ot, lse_f, lse_d, isa, num_threads,
                    chunk);
      break;
    case radixserve::KVQuant::kFp8E5M2:
      run<T, Q8<3>>(P, qt, static_cast<const Q8<3>*>(kv), ot, lse_f, lse_d, isa, num_threads,
                    chunk);
      break;
    case radixserve::KVQuant::kNone:
      break;
  }
}

}  // namespace

void radixserve::paged_decode(const PagedDecode& P, KVType type, const void* q, const void* kv,
                              void* out, float* lse_f, double* lse_d, Isa isa,
                              int num_threads, int64_t chunk, KVQuant quant) {
  if (quant != KVQuant::kNone) {
    switch (type) {
      case KVType::kFloat32:
        return run_quant<float>(P, quant, q, kv, out, lse_f, lse_d, isa, num_threads, chunk);
      case KVType::kFloat64:
        return run_quant<double>(P, quant, q, kv, out, lse_f, lse_d, isa, num_threads, chunk);
      case KVType::kBFloat16:
        return run_quant<BF16>(P, quant, q, kv, out, lse_f, lse_d, isa, num_threads, chunk);
    }
    return;
  }
  switch (type) {
    case KVType::kFloat32:
      run<float>(P, static_cast<const float*>(q), static_cast<const float*>(kv),
                 static_cast<float*>(out), lse_f, lse_d, isa, num_threads, chunk);
      break;
    case KVType::kFloat64:
      run<double>(P, static_cast<const double*>(q), static_cast<const double*>(kv),
                  static_cast<double*>(out), lse_f, lse_d, isa, num_threads, chunk);
      break;
    case KVType::kBFloat16:
      run<BF16>(P, static_cast<const BF16*>(q), static_cast<const BF16*>(kv),
                static_cast<BF16*>(out), lse_f, lse_d, isa, num_threads, chunk);
      break;
  }
}
