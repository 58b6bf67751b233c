// Every decoder layer of a decode step in one call (radixserve.layers._cpu_kernels.DecodeLayers).
//
// At decode batch sizes a Llama-style layer is four skinny products that stream
// the weights and, around them, a dozen small steps (the residual adds and norms,
// rotary, the K/V writes, attention, the activation): from Python each is a
// dispatch, a NumPy view per array and a module call, about 0.3 ms per layer on a
// 2-core CPU, as much as the products at batch 1. Here the layers run back to
// back with the kernels the torch path calls one by one (skinny_gemm,
// add_rms_norm, rotary_qkv, paged_decode), on the same layouts (products
// feature-major, [features][rows]), so every value is the same bits as that path
// except the activation: silu(gate) * up is computed here with expv (about 2 ulp)
// where torch uses its own exp (within 1 ulp), each result rounded as torch rounds
// it: round(round(silu(g)) * u).
//
// With `amx` (a CPU with AMX tiles), bfloat16 products of 2 to 32 rows run on them
// (amx_gemm.cpp): float32 sums in another order than the skinny kernel's, the same
// single rounding.
//
// The caller computes the embeddings and the first layer's input norm (as the
// torch path does) and the final norm and the LM head after.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

#if RS_X86
#include <immintrin.h>
#endif

namespace {

using radixserve::DecodeLayers;
using radixserve::Isa;

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

// out[i] = round(round(silu(g[i])) * u[i]), silu(x) = x / (1 + exp(-x)) written with
// e = exp(-|x|) <= 1 (expv takes arguments <= 0): x / (1 + e) for x >= 0, and
// x * e / (1 + e) = x / (1 + 1 / e) for x < 0.
#if RS_X86
// 16 bfloat16 values widened to float32 (exact), and back with round-to-nearest-even
// (NaN to 0x7fc0): radixserve::bf16_to_f32 / f32_to_bf16 on 16 lanes.
RS_TARGET_AVX512 RS_ALWAYS_INLINE __m512 bf16x16_load(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// The bfloat16 bits of 16 float32 values, one per 32-bit lane (low half).
RS_TARGET_AVX512 RS_ALWAYS_INLINE __m512i bf16x16_round(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}

// x rounded to bfloat16 and widened back (exact).
RS_TARGET_AVX512 RS_ALWAYS_INLINE __m512 bf16x16_rounded(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16_round(x), 16));
}

RS_TARGET_AVX512 RS_ALWAYS_INLINE void bf16x16_store(uint16_t* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16x16_round(x)));
}
#endif

// silu(x) = x / (1 + exp(-x)) written with e = exp(-|x|) <= 1 (expv takes arguments <= 0).
template <typename V>
RS_ALWAYS_INLINE V silu_v(V x) {
  const V ax = x < 0 ? -x : x;
  const V e = radixserve::expv<V>(-ax);
  return x < 0 ? x * e / (e + 1.0f) : x / (e + 1.0f);
}

template <typename V, typename IO>
RS_ALWAYS_INLINE void silu_mul_range(const typename IO::T* g, const typename IO::T* u,
                                     typename IO::T* out, int64_t n) {
  constexpr int L = radixserve::lanes<V>();
  int64_t i = 0;
  float buf[L];
  // The last vector zero-padded: every element gets expv's value, whatever its place.
  for (; i < n; i += L) {
    const int64_t m = std::min<int64_t>(L, n - i);
    for (int j = 0; j < L; ++j) buf[j] = j < m ? IO::load(g[i + j]) : 0.0f;
    radixserve::storev(buf, silu_v(radixserve::loadv<V>(buf)));
    for (int64_t j = 0; j < m; ++j)
      out[i + j] = IO::store(IO::load(IO::store(buf[j])) * IO::load(u[i + j]));
  }
}

// One function per level (always-inlined bodies get the caller's target; an OpenMP
// region's outlined body would not, so the parallel loop calls these).
template <typename IO>
void silu_mul_baseline(const typename IO::T* g, const typename IO::T* u, typename IO::T* out,
                       int64_t n) {
  silu_mul_range<radixserve::v8, IO>(g, u, out, n);
}

template <typename IO>
RS_TARGET_AVX2 void silu_mul_avx2(const typename IO::T* g, const typename IO::T* u,
                                  typename IO::T* out, int64_t n) {
  silu_mul_range<radixserve::v8, IO>(g, u, out, n);
}

#if RS_X86
// silu_mul_range's values for bfloat16 at AVX-512, the conversions in vectors too; the
// first n - n % 16 elements (the caller does the rest).
RS_TARGET_AVX512 int64_t silu_mul_bf16_avx512(const uint16_t* g, const uint16_t* u,
                                              uint16_t* out, int64_t n) {
  typedef radixserve::v16 V;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 xv = bf16x16_load(g + i);
    V x;
    std::memcpy(&x, &xv, sizeof x);
    const V sv = silu_v(x);
    __m512 si;
    std::memcpy(&si, &sv, sizeof si);
    // round(round(silu(g)) * u): the silu rounded first, as torch does
    bf16x16_store(out + i, _mm512_mul_ps(bf16x16_rounded(si), bf16x16_load(u + i)));
  }
  return i;
}
#endif

template <typename IO>
RS_TARGET_AVX512 void silu_mul_avx512(const typename IO::T* g, const typename IO::T* u,
                                      typename IO::T* out, int64_t n) {
  int64_t done = 0;
#if RS_X86
  if constexpr (sizeof(typename IO::T) == 2) done = silu_mul_bf16_avx512(g, u, out, n);
#endif
  silu_mul_range<radixserve::v16, IO>(g + done, u + done, out + done, n - done);
}

// The silu_mul body for an instruction-set level.
template <typename IO>
auto silu_mul_fn(Isa isa) {
  return radixserve::by_isa(isa, &silu_mul_baseline<IO>, &silu_mul_avx2<IO>, &silu_mul_avx512<IO>);
}

template <typename IO>
void silu_mul(const typename IO::T* g, const typename IO::T* u, typename IO::T* out, int64_t n,
              Isa isa, int num_threads) {
  const auto fn = silu_mul_fn<IO>(isa);
  // Small steps stay on one thread: a parallel region costs more than 16k elements. (A
  // value does not depend on the split: a vector's tail gets the same formula.)
  radixserve::split_items(n, n >= (1 << 14) ? num_threads : 1,
                          [&](int64_t lo, int64_t hi) { fn(g + lo, u + lo, out + lo, hi - lo); });
}

// Row-major [rows][2 * inter] -> [rows][inter]: each row's gate half times its up half,
// rows split between the threads.
template <typename IO>
void silu_mul_rows(const typename IO::T* gu, typename IO::T* out, int64_t rows, int64_t inter,
                   Isa isa, int num_threads) {
  const auto fn = silu_mul_fn<IO>(isa);
  radixserve::split_items(rows, rows * inter >= (1 << 14) ? num_threads : 1,
                          [&](int64_t r0, int64_t r1) {
                            for (int64_t r = r0; r < r1; ++r)
                              fn(gu + r * 2 * inter, gu + (r * 2 + 1) * inter, out + r * inter, inter);
                          });
}

template <typename IO>
void run(const DecodeLayers& p, Isa isa, int num_threads) {
  typedef typename IO::T T;
  using radixserve::DType;
  const int64_t t = p.tokens, hd = p.hidden, dh = p.head_dim, inter = p.intermediate;
  const int64_t qd = p.heads * dh, kvd = p.kv_heads * dh, qkv_n = qd + 2 * kvd;
  const DType dt = p.bf16 ? DType::kBFloat16 : DType::kFloat32;
  std::vector<T> res[2] = {std::vector<T>(hd * t), std::vector<T>(hd * t)};
  std::vector<T> y(hd * t), h(hd * t), qkv(qkv_n * t), q(qd * t), k(kvd * t), v(kvd * t);
  std::vector<T> att(qd * t), o(hd * t), gu(2 * inter * t), act(inter * t);

  auto gemm = [&](const void* w, int64_t n, int64_t kk, const T* x, int64_t sm, int64_t sk,
                  T* out) {
    radixserve::SkinnyGemm g{w, x, out, dt, dt, dt, n, kk, t, sm, sk, p.invariant};
    if (p.amx && radixserve::skinny_gemm_amx(g, num_threads)) return;
    radixserve::skinny_gemm(g, isa, num_threads);
  };
  auto add_norm = [&](const T* x, int64_t x_row, int64_t x_col, const T* a, const void* w,
                      T* s, T* out) {
    // a, s and out feature-major ([hidden][tokens]); x as given. One row is written
    // row-major, as the torch path's call does (the same memory, and its own loop).
    radixserve::AddRmsNorm n{p.bf16, p.unit_offset, t > 1 || p.invariant, x, a, w, s, out, t, hd,
                             x_row, x_col, 1, t, p.eps};
    radixserve::add_rms_norm(n, isa, num_threads);
  };

  // The residual stream: layer 0's is the embeddings (row-major), then each add
  // writes the sum into the buffer it does not read.
  const T* resid = static_cast<const T*>(p.residual);
  int64_t r_row = hd, r_col = 1;
  int cur = 1;
  auto add_into_stream = [&](const T* a, const void* w) {
    cur ^= 1;
    T* s = res[cur].data();
    add_norm(resid, r_row, r_col, a, w, s, y.data());
    resid = s;
    r_row = 1;
    r_col = t;
  };
  const size_t row_bytes = static_cast<size_t>(kvd) * sizeof(T);
  for (int64_t l = 0; l < p.layers; ++l) {
    const radixserve::DecodeLayerWeights& w = p.weights[l];
    // Layer 0's input norm is the caller's (row-major [tokens][hidden]); later
    // layers add the MLP's output h and normalise, feature-major.
    const T* x = static_cast<const T*>(p.x);
    int64_t x_sm = hd, x_sk = 1;
    if (l > 0) {
      add_into_stream(h.data(), w.ln1);
      x = y.data();
      x_sm = 1;
      x_sk = t;
    }
    gemm(w.qkv, qkv_n, hd, x, x_sm, x_sk, qkv.data());
    radixserve::RotaryQkv r{p.bf16, qkv.data(), p.cos, p.sin, q.data(), k.data(), v.data(),
                            t, p.heads, p.kv_heads, dh, p.rot_dim, 1, t};
    radixserve::rotary_qkv(r, isa, num_threads);
    char* kv = static_cast<char*>(w.kv);
    if (p.quant == radixserve::KVQuant::kNone) {
      for (int64_t i = 0; i < t; ++i) {
        const int64_t row = p.write_rows[i];
        std::memcpy(kv + row * row_bytes, k.data() + i * kvd, row_bytes);
        std::memcpy(kv + (row + p.page_size) * row_bytes, v.data() + i * kvd, row_bytes);
      }
    } else {
      // Rows of kv_heads x (head_dim codes, a float16 scale). Keys are stored rotated
      // (attention/rotation.py): each key row rotated in float32, and fp8 key rows take
      // the searched scale; the queries are rotated alike, rounded back to the weights'
      // dtype, before attention reads the pool. A shifted pool's key rows lose the
      // layer and head's constant after the rotation (attention/key_shift.py).
      // The (token, K or V, kv head) rows split between the threads (the searched
      // scale costs 36 trial roundings a key row); each row's bytes are its own.
      const int64_t entry = dh + 2, qrow = p.kv_heads * entry;
      const T* kvs[2] = {k.data(), v.data()};
      radixserve::split_items(t * 2 * p.kv_heads, num_threads, [&](int64_t begin, int64_t end) {
        std::vector<float> x(static_cast<size_t>(dh));
        for (int64_t r = begin; r < end; ++r) {
          const int64_t i = r / (2 * p.kv_heads), which = r / p.kv_heads % 2, hh = r % p.kv_heads;
          const T* src = kvs[which] + i * kvd + hh * dh;
          uint8_t* dst = reinterpret_cast<uint8_t*>(kv) +
                         (p.write_rows[i] + which * p.page_size) * qrow + hh * entry;
          const bool key = which == 0 && p.rotated;
          for (int64_t d = 0; d < dh; ++d) x[static_cast<size_t>(d)] = IO::load(src[d]);
          if (key) radixserve::hadamard_row(x.data(), dh);
          if (key && p.key_shift != nullptr) {  // the layer and head's constant, rotated
            const float* m = p.key_shift + (l * p.kv_heads + hh) * dh;
            for (int64_t d = 0; d < dh; ++d) x[static_cast<size_t>(d)] -= m[d];
          }
          const float* gptq = key && p.key_gptq != nullptr
                                  ? p.key_gptq + (l * p.kv_heads + hh) * dh * dh
                                  : nullptr;  // the layer and head's factor
          radixserve::quantize_kv_row(x.data(), dh, p.quant, dst, isa, key, gptq);
        }
      });
      if (p.rotated) {
        T* qs = q.data();
        std::vector<float> x(static_cast<size_t>(dh));
        for (int64_t r = 0; r < t * p.heads; ++r) {
          T* row = qs + r * dh;
          for (int64_t d = 0; d < dh; ++d) x[static_cast<size_t>(d)] = IO::load(row[d]);
          radixserve::hadamard_row(x.data(), dh);
          for (int64_t d = 0; d < dh; ++d) row[d] = IO::store(x[static_cast<size_t>(d)]);
        }
      }
    }
    radixserve::paged_decode(p.attn, p.bf16 ? radixserve::KVType::kBFloat16
                                            : radixserve::KVType::kFloat32,
                             q.data(), w.kv, att.data(), nullptr, nullptr, isa, num_threads,
                             p.chunk, p.quant);
    gemm(w.o, hd, qd, att.data(), qd, 1, o.data());
    add_into_stream(o.data(), w.ln2);
    gemm(w.gate_up, 2 * inter, hd, y.data(), 1, t, gu.data());
    silu_mul<IO>(gu.data(), gu.data() + inter * t, act.data(), inter * t, isa, num_threads);
    gemm(w.down, hd, inter, act.data(), 1, t, h.data());
  }
  std::memcpy(p.h_out, h.data(), sizeof(T) * hd * t);
  std::memcpy(p.residual_out, resid, sizeof(T) * hd * t);
}

}  // namespace

namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// |a| (a finite float, at most the format's largest finite value) rounded to nearest
// even in a format of M mantissa bits and exponent bias B, as its bits (no sign):
// subnormals by scaling to units of the smallest step, normals by rounding the
// float32 bits' low mantissa bits away.
template <int M, int B>
uint32_t round_to_minifloat(float a) {
  const float min_normal = std::ldexp(1.0f, 1 - B);
  if (a < min_normal) return static_cast<uint32_t>(std::nearbyint(std::ldexp(a, B - 1 + M)));
  uint32_t u = to_bits(a);
  constexpr int shift = 23 - M;
  uint32_t r = u >> shift;
  const uint32_t rem = u & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return r - (static_cast<uint32_t>(127 - B) << M);
}

float half_bits_to_float(uint32_t h) {
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return static_cast<float>(m) * 0x1p-24f;
  return from_bits(((e + 112u) << 23) | (m << 13));
}

}  // namespace

namespace radixserve {

namespace {

// The row's float16 scale, rounded up from amax / qmax (no code outside the format).
uint32_t row_scale_bits(float amax, float qmax) {
  const float exact = std::min(std::max(amax / qmax, 0x1p-24f), 65504.0f);
  uint32_t h = round_to_minifloat<10, 15>(exact);
  if (half_bits_to_float(h) < exact) ++h;
  return h;
}

float quant_max(KVQuant quant) {
  return quant == KVQuant::kInt8 ? 127.0f : quant == KVQuant::kFp8E4M3 ? 448.0f : 57344.0f;
}

void quantize_row_scalar(const float* x, int64_t d, KVQuant quant, uint8_t* dst) {
  const float qmax = quant_max(quant);
  float amax = 0;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const uint32_t h = row_scale_bits(amax, qmax);
  const float scale = half_bits_to_float(h);
  for (int64_t i = 0; i < d; ++i) {
    const float y = x[i] / scale;
    uint8_t c;
    if (quant == KVQuant::kInt8) {
      const float r = std::min(std::max(std::nearbyint(y), -127.0f), 127.0f);
      c = static_cast<uint8_t>(static_cast<int8_t>(r));
    } else {
      const float a = std::min(std::fabs(y), qmax);
      const uint32_t mag = quant == KVQuant::kFp8E4M3 ? round_to_minifloat<3, 7>(a)
                                                      : round_to_minifloat<2, 15>(a);
      c = static_cast<uint8_t>(mag | (std::signbit(y) ? 0x80u : 0u));
    }
    dst[i] = c;
  }
  const uint16_t hb = static_cast<uint16_t>(h);
  std::memcpy(dst + d, &hb, sizeof hb);
}

// |a| <= qmax rounded to the fp8 format's grid (M mantissa bits, bias B), as a float:
// round_to_minifloat's rounding, its value rather than its bits.
template <int M, int B>
float fp8_rounded(float a) {
  const float min_normal = std::ldexp(1.0f, 1 - B);
  if (a < min_normal) return std::nearbyint(a * std::ldexp(1.0f, B - 1 + M)) * std::ldexp(1.0f, 1 - B - M);
  constexpr int shift = 23 - M;
  const uint32_t u = to_bits(a);
  uint32_t r = u >> shift;
  const uint32_t rem = u & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return from_bits(r << shift);
}

// kv_quant.quantize with search_scale for an fp8 format of float16 row scales: among
// the scales that put one of the row's kSearchTop largest magnitudes on one of the
// format's codes in [qmax / 2, qmax] (each rounded to float16, nearest even, within
// [2^-24, 65504]), the one of least sum((code * scale - x)^2); the first on a tie, in
// the order (magnitude descending, code ascending). Values beyond qmax * scale clamp to
// qmax. Each square is a float32, and the sum is taken in float64 in one fixed order
// by both versions (scalar and AVX-512): value i into lane i % 16, lanes summed 0..15.
constexpr int64_t kSearchTop = 4;
constexpr int kLanes = 16;
const float kE4M3Top[] = {224, 240, 256, 288, 320, 352, 384, 416, 448};
const float kE5M2Top[] = {28672, 32768, 40960, 49152, 57344};

// The candidates' float16 scale bits, in the search's order; returns their number.
int search_candidates(const float* x, int64_t d, KVQuant quant, uint32_t* out) {
  const bool e4m3 = quant == KVQuant::kFp8E4M3;
  const float* tops = e4m3 ? kE4M3Top : kE5M2Top;
  const int n_tops = e4m3 ? 9 : 5;
  float mags[kSearchTop];
  const int64_t top = std::min(kSearchTop, d);
  for (int64_t j = 0; j < top; ++j) mags[j] = -1.0f;
  for (int64_t i = 0; i < d; ++i) {  // the `top` largest magnitudes, descending
    float a = std::fabs(x[i]);
    for (int64_t j = 0; j < top; ++j) {
      if (a > mags[j]) std::swap(a, mags[j]);
    }
  }
  int n = 0;
  for (int64_t j = 0; j < top; ++j) {
    for (int c = 0; c < n_tops; ++c) {
      const float exact = std::min(std::max(mags[j] / tops[c], 0x1p-24f), 65504.0f);
      out[n++] = round_to_minifloat<10, 15>(exact);
    }
  }
  return n;
}

double lane_sum(const double* lanes) {
  double total = 0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// A row's searched-scale candidates (search_candidates) and the best so far: offer(c,
// err) for each in order; the first of least error wins.
struct ScaleSearch {
  uint32_t cands[kSearchTop * 9];
  int n;
  double best_err = 0;
  uint32_t best;
  ScaleSearch(const float* x, int64_t d, KVQuant quant)
      : n(search_candidates(x, d, quant, cands)), best(cands[0]) {}
  void offer(int c, double err) {
    if (c == 0 || err < best_err) {
      best_err = err;
      best = cands[c];
    }
  }
};

// The row's codes under float16 scale bits h, and its scale, into dst.
void write_row(const float* x, int64_t d, KVQuant quant, uint32_t h, uint8_t* dst) {
  const float qmax = quant_max(quant), scale = half_bits_to_float(h);
  for (int64_t i = 0; i < d; ++i) {
    const float y = x[i] / scale;
    const float a = std::min(std::fabs(y), qmax);
    const uint32_t mag = quant == KVQuant::kFp8E4M3 ? round_to_minifloat<3, 7>(a)
                                                    : round_to_minifloat<2, 15>(a);
    dst[i] = static_cast<uint8_t>(mag | (std::signbit(y) ? 0x80u : 0u));
  }
  const uint16_t hb = static_cast<uint16_t>(h);
  std::memcpy(dst + d, &hb, sizeof hb);
}

#if RS_X86
// w[j] -= e * u[j] for j in [0, n), 16 at a time: the product rounded on its own, as
// in the scalar loop (the empty asm keeps the compiler from fusing it into the
// subtraction).
RS_TARGET_AVX512 void gptq_update_avx512(float* w, const float* u, float e, int64_t n) {
  const __m512 ev = _mm512_set1_ps(e);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1);
    __m512 t = _mm512_mul_ps(ev, _mm512_maskz_loadu_ps(m, u + j));
    __asm__("" : "+v"(t));
    _mm512_mask_storeu_ps(w + j, m, _mm512_sub_ps(_mm512_maskz_loadu_ps(m, w + j), t));
  }
}
#endif

// write_row with GPTQ rounding (kv_quant.quantize's gptq): the codes one value at a
// time, in order, each value's rounding error e_i = (w_i - code_i * scale) / U_ii
// carried into the later ones, w_j -= e_i * U_ij (U: the row's upper triangular factor,
// d x d float32), each product and difference rounded to float32 on its own (this
// function is not inlined into the avx512 callers and has no FMA; the updates at avx512
// and up are gptq_update_avx512's, unfused too). Values beyond qmax * scale clamp to
// qmax.
__attribute__((noinline)) void write_row_gptq(const float* x, int64_t d, KVQuant quant, uint32_t h,
                                              const float* U, uint8_t* dst, Isa isa) {
  const float qmax = quant_max(quant), scale = half_bits_to_float(h);
  std::vector<float> w(x, x + d);
  (void)isa;
  for (int64_t i = 0; i < d; ++i) {
    const float y = w[static_cast<size_t>(i)] / scale;
    const float a = std::min(std::fabs(y), qmax);
    const bool e4m3 = quant == KVQuant::kFp8E4M3;
    const uint32_t mag = e4m3 ? round_to_minifloat<3, 7>(a) : round_to_minifloat<2, 15>(a);
    dst[i] = static_cast<uint8_t>(mag | (std::signbit(y) ? 0x80u : 0u));
    const float q = e4m3 ? fp8_rounded<3, 7>(a) : fp8_rounded<2, 15>(a);
    const float deq = (std::signbit(y) ? -q : q) * scale;
    const float diff = w[static_cast<size_t>(i)] - deq;
    const float e = diff / U[i * d + i];
#if RS_X86
    if (isa >= Isa::kAvx512) {
      gptq_update_avx512(w.data() + i + 1, U + i * d + i + 1, e, d - i - 1);
      continue;
    }
#endif
    for (int64_t j = i + 1; j < d; ++j) {
      const float t = e * U[i * d + j];
      w[static_cast<size_t>(j)] = w[static_cast<size_t>(j)] - t;
    }
  }
  const uint16_t hb = static_cast<uint16_t>(h);
  std::memcpy(dst + d, &hb, sizeof hb);
}

void quantize_row_searched_scalar(const float* x, int64_t d, KVQuant quant, uint8_t* dst,
                                  const float* U, Isa isa = Isa::kBaseline) {
  const float qmax = quant_max(quant);
  ScaleSearch search(x, d, quant);
  for (int c = 0; c < search.n; ++c) {
    const float scale = half_bits_to_float(search.cands[c]), inv = 1.0f / scale;
    double lanes[kLanes] = {};
    for (int64_t i = 0; i < d; ++i) {
      const float a = std::min(std::fabs(x[i] * inv), qmax);
      const float q = quant == KVQuant::kFp8E4M3 ? fp8_rounded<3, 7>(a) : fp8_rounded<2, 15>(a);
      const float diff = (std::signbit(x[i]) ? -q : q) * scale - x[i];
      lanes[i % kLanes] += static_cast<double>(diff * diff);
    }
    search.offer(c, lane_sum(lanes));
  }
  if (U != nullptr) return write_row_gptq(x, d, quant, search.best, U, dst, isa);
  write_row(x, d, quant, search.best, dst);
}

#if RS_X86
// 16 magnitudes in the fp8 format's normal range rounded to nearest even at M mantissa
// bits: their float32 bits shifted down by 23 - M, rounded (still float32's exponent).
template <int M>
RS_TARGET_AVX512 RS_ALWAYS_INLINE __m512i mantissa_rounded16(__m512 a) {
  constexpr int shift = 23 - M;
  const __m512i u = _mm512_castps_si512(a);
  const __m512i r = _mm512_srli_epi32(u, shift);
  const __m512i rem = _mm512_and_si512(u, _mm512_set1_epi32((1 << shift) - 1));
  const __m512i half = _mm512_set1_epi32(1 << (shift - 1));
  const __mmask16 up = _mm512_cmpgt_epi32_mask(rem, half) |
                       (_mm512_cmpeq_epi32_mask(rem, half) &
                        _mm512_test_epi32_mask(r, _mm512_set1_epi32(1)));
  return _mm512_mask_add_epi32(r, up, r, _mm512_set1_epi32(1));
}

// 16 magnitudes below the format's smallest normal, in units of its smallest step,
// rounded to nearest even (as floats), and the lanes that are such.
template <int M, int B>
RS_TARGET_AVX512 RS_ALWAYS_INLINE __m512 subnormal_steps16(__m512 a, __mmask16* tiny) {
  *tiny = _mm512_cmp_ps_mask(a, _mm512_set1_ps(std::ldexp(1.0f, 1 - B)), _CMP_LT_OQ);
  return _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(std::ldexp(1.0f, B - 1 + M))),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// 16 magnitudes |y| <= qmax rounded to nearest even in the fp8 format (M mantissa
// bits, bias B), as int32 codes without sign: round_to_minifloat, 16 lanes at a time.
template <int M, int B>
RS_TARGET_AVX512 RS_ALWAYS_INLINE __m512i minifloat16(__m512 a) {
  __mmask16 tiny;
  const __m512i sub = _mm512_cvtps_epi32(subnormal_steps16<M, B>(a, &tiny));
  const __m512i r = _mm512_sub_epi32(mantissa_rounded16<M>(a), _mm512_set1_epi32((127 - B) << M));
  return _mm512_mask_blend_epi32(tiny, r, sub);
}

// quantize_row_scalar's bytes, 16 values at a time (the division stays a division,
// as torch's x / scale is).
RS_TARGET_AVX512 void quantize_row_avx512(const float* x, int64_t d, KVQuant quant,
                                          uint8_t* dst) {
  const float qmax = quant_max(quant);
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = d - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (d - i)) - 1);
    vmax = _mm512_max_ps(vmax, _mm512_and_ps(_mm512_maskz_loadu_ps(m, x + i), abs_mask));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, vmax);
  float amax = 0;
  for (float v : lanes) amax = std::max(amax, v);
  const uint32_t h = row_scale_bits(amax, qmax);
  const __m512 scale = _mm512_set1_ps(half_bits_to_float(h)), vq = _mm512_set1_ps(qmax);
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = d - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (d - i)) - 1);
    const __m512 y = _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), scale);
    __m512i c;
    if (quant == KVQuant::kInt8) {
      const __m512 r = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)), vq));
    } else {
      const __m512 a = _mm512_min_ps(_mm512_and_ps(y, abs_mask), vq);
      c = quant == KVQuant::kFp8E4M3 ? minifloat16<3, 7>(a) : minifloat16<2, 15>(a);
      const __m512i sign = _mm512_srli_epi32(
          _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(INT32_MIN)), 24);
      c = _mm512_or_si512(c, sign);
    }
    _mm512_mask_cvtepi32_storeu_epi8(dst + i, m, c);
  }
  const uint16_t hb = static_cast<uint16_t>(h);
  std::memcpy(dst + d, &hb, sizeof hb);
}

// |a| <= qmax (16 lanes) rounded to the fp8 grid, as floats: fp8_rounded.
template <int M, int B>
RS_TARGET_AVX512 RS_ALWAYS_INLINE __m512 fp8_rounded16(__m512 a) {
  __mmask16 tiny;
  const __m512 sub = _mm512_mul_ps(subnormal_steps16<M, B>(a, &tiny),
                                   _mm512_set1_ps(std::ldexp(1.0f, 1 - B - M)));
  const __m512 normal = _mm512_castsi512_ps(_mm512_slli_epi32(mantissa_rounded16<M>(a), 23 - M));
  return _mm512_mask_blend_ps(tiny, normal, sub);
}

// quantize_row_searched_scalar's bytes (the same squares summed in the same order),
// 16 values at a time.
template <int M, int B>
RS_TARGET_AVX512 uint32_t searched_scale_avx512(const float* x, int64_t d, KVQuant quant) {
  const __m512 vq = _mm512_set1_ps(quant_max(quant));
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 sign_mask = _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN));
  ScaleSearch search(x, d, quant);
  for (int c = 0; c < search.n; ++c) {
    const float s = half_bits_to_float(search.cands[c]);
    const __m512 scale = _mm512_set1_ps(s), inv = _mm512_set1_ps(1.0f / s);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = d - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (d - i)) - 1);
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
      const __m512 a = _mm512_min_ps(_mm512_and_ps(_mm512_mul_ps(xv, inv), abs_mask), vq);
      const __m512 q = _mm512_or_ps(fp8_rounded16<M, B>(a), _mm512_and_ps(xv, sign_mask));
      const __m512 diff = _mm512_sub_ps(_mm512_mul_ps(q, scale), xv);
      const __m512 sq = _mm512_maskz_mul_ps(m, diff, diff);
      lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(sq)));
      hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sq), 1))));
    }
    alignas(64) double lanes[kLanes];
    _mm512_store_pd(lanes, lo);
    _mm512_store_pd(lanes + 8, hi);
    search.offer(c, lane_sum(lanes));
  }
  return search.best;
}

template <int M, int B>
RS_TARGET_AVX512 void quantize_row_searched_avx512(const float* x, int64_t d, KVQuant quant,
                                                   uint8_t* dst, const float* U) {
  const uint32_t best = searched_scale_avx512<M, B>(x, d, quant);
  if (U != nullptr) return write_row_gptq(x, d, quant, best, U, dst, Isa::kAvx512);
  write_row(x, d, quant, best, dst);
}

// write_row_gptq for n <= 16 rows of one factor U at once, a row a lane (the rows'
// values [d][16] in w): the same operations on each value in the same order, so the
// same bytes, with 16 rows' dependency chains side by side. xs[r]: row r's d values,
// hs[r] its scale bits, dsts[r] its d + 2 bytes.
template <int M, int B>
RS_TARGET_AVX512 void write_rows_gptq16(const float* const* xs, int n, int64_t d, KVQuant quant,
                                        const uint32_t* hs, const float* U,
                                        uint8_t* const* dsts) {
  static thread_local std::vector<float> w, ys;
  w.assign(static_cast<size_t>(d * 16), 0.0f);
  ys.resize(static_cast<size_t>(d * 16));
  alignas(64) float sc[16];
  for (int r = 0; r < 16; ++r) sc[r] = r < n ? half_bits_to_float(hs[r]) : 1.0f;
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < d; ++i) w[static_cast<size_t>(i * 16 + r)] = xs[r][i];
  const __m512 scale = _mm512_load_ps(sc), vq = _mm512_set1_ps(quant_max(quant));
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 sign_mask = _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN));
  float* wp = w.data();
  for (int64_t i = 0; i < d; ++i) {
    const __m512 wi = _mm512_loadu_ps(wp + i * 16);
    const __m512 y = _mm512_div_ps(wi, scale);
    _mm512_storeu_ps(ys.data() + i * 16, y);
    const __m512 a = _mm512_min_ps(_mm512_and_ps(y, abs_mask), vq);
    const __m512 q = _mm512_or_ps(fp8_rounded16<M, B>(a), _mm512_and_ps(y, sign_mask));
    __m512 deq = _mm512_mul_ps(q, scale);
    __asm__("" : "+v"(deq));
    const __m512 e = _mm512_div_ps(_mm512_sub_ps(wi, deq), _mm512_set1_ps(U[i * d + i]));
    for (int64_t j = i + 1; j < d; ++j) {
      __m512 t = _mm512_mul_ps(e, _mm512_set1_ps(U[i * d + j]));
      __asm__("" : "+v"(t));
      _mm512_storeu_ps(wp + j * 16, _mm512_sub_ps(_mm512_loadu_ps(wp + j * 16), t));
    }
  }
  const float qmax = quant_max(quant);
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < d; ++i) {
      const float y = ys[static_cast<size_t>(i * 16 + r)];
      const float a = std::min(std::fabs(y), qmax);
      const uint32_t mag = M == 3 ? round_to_minifloat<3, 7>(a) : round_to_minifloat<2, 15>(a);
      dsts[r][i] = static_cast<uint8_t>(mag | (std::signbit(y) ? 0x80u : 0u));
    }
    const uint16_t hb = static_cast<uint16_t>(hs[r]);
    std::memcpy(dsts[r] + d, &hb, sizeof hb);
  }
}

// Rows [t0, t1) x kv head h of x [tokens][heads][d] searched and GPTQ-rounded with U,
// 16 tokens at a time.
template <int M, int B>
RS_TARGET_AVX512 void gptq_rows_avx512(const float* x, int64_t heads, int64_t h, int64_t t0,
                                       int64_t t1, int64_t d, KVQuant quant, const float* U,
                                       uint8_t* dst) {
  for (int64_t t = t0; t < t1; t += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, t1 - t));
    const float* xs[16];
    uint8_t* dsts[16];
    uint32_t hs[16];
    for (int r = 0; r < n; ++r) {
      const int64_t row = (t + r) * heads + h;
      xs[r] = x + row * d;
      dsts[r] = dst + row * (d + 2);
      hs[r] = searched_scale_avx512<M, B>(xs[r], d, quant);
    }
    write_rows_gptq16<M, B>(xs, n, d, quant, hs, U, dsts);
  }
}
#endif

#if RS_X86
// mantissa_rounded16, 8 lanes (avx2), by the carry form of round-to-nearest-even:
// u + (half - 1) + (the kept part's lowest bit), shifted down (|a| <= qmax: no carry
// reaches the sign).
template <int M>
RS_TARGET_AVX2 RS_ALWAYS_INLINE __m256i mantissa_rounded8(__m256 a) {
  constexpr int shift = 23 - M;
  const __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, shift), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32((1 << (shift - 1)) - 1), lsb);
  return _mm256_srli_epi32(_mm256_add_epi32(u, bias), shift);
}

// fp8_rounded16, 8 lanes (avx2): |a| <= qmax rounded to the fp8 grid, as floats (below
// the smallest normal, a whole number of the smallest step).
template <int M, int B>
RS_TARGET_AVX2 RS_ALWAYS_INLINE __m256 fp8_rounded8(__m256 a) {
  const __m256 normal = _mm256_castsi256_ps(_mm256_slli_epi32(mantissa_rounded8<M>(a), 23 - M));
  const __m256 scaled = _mm256_mul_ps(a, _mm256_set1_ps(std::ldexp(1.0f, B - 1 + M)));
  const __m256 steps = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 tiny = _mm256_cmp_ps(a, _mm256_set1_ps(std::ldexp(1.0f, 1 - B)), _CMP_LT_OQ);
  return _mm256_blendv_ps(normal, _mm256_mul_ps(steps, _mm256_set1_ps(std::ldexp(1.0f, 1 - B - M))),
                          tiny);
}

// searched_scale_avx512's choice (the same squares summed in the same order: value i
// into lane i % 16), 8 values at a time (avx2); products never fused into the
// subtraction (the empty asm), as the scalar loop computes them.
template <int M, int B>
RS_TARGET_AVX2 uint32_t searched_scale_avx2(const float* x, int64_t d, KVQuant quant) {
  ScaleSearch search(x, d, quant);
  alignas(32) const int32_t lane_ids[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  const __m256i ids = _mm256_load_si256(reinterpret_cast<const __m256i*>(lane_ids));
  const __m256 vq = _mm256_set1_ps(quant_max(quant));
  const __m256 sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int c = 0; c < search.n; ++c) {
    const float s = half_bits_to_float(search.cands[c]);
    const __m256 scale = _mm256_set1_ps(s), inv = _mm256_set1_ps(1.0f / s);
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                      _mm256_setzero_pd()};
    for (int64_t i = 0; i < d; i += 8) {
      // lanes past the row's end load 0: their squares are +0
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(d - i)), ids);
      const __m256 xv = _mm256_maskload_ps(x + i, m);
      const __m256 a = _mm256_min_ps(_mm256_and_ps(_mm256_mul_ps(xv, inv), abs_mask), vq);
      const __m256 q = _mm256_or_ps(fp8_rounded8<M, B>(a), _mm256_and_ps(xv, sign_mask));
      __m256 prod = _mm256_mul_ps(q, scale);
      __asm__("" : "+x"(prod));
      const __m256 diff = _mm256_sub_ps(prod, xv);
      const __m256 sq = _mm256_mul_ps(diff, diff);
      const int half = static_cast<int>(i % 16) / 8;  // lanes 0-7 or 8-15
      acc[2 * half] = _mm256_add_pd(acc[2 * half], _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
      acc[2 * half + 1] =
          _mm256_add_pd(acc[2 * half + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1)));
    }
    alignas(32) double lanes[kLanes];
    for (int k = 0; k < 4; ++k) _mm256_store_pd(lanes + 4 * k, acc[k]);
    search.offer(c, lane_sum(lanes));
  }
  return search.best;
}
#endif

// One searched row (quantize_kv_row with searched), at the CPU's level.
void quantize_row_searched(const float* x, int64_t d, KVQuant quant, uint8_t* dst, Isa isa,
                           const float* U) {
#if RS_X86
  if (isa >= Isa::kAvx512) {
    if (quant == KVQuant::kFp8E4M3)
      return quantize_row_searched_avx512<3, 7>(x, d, quant, dst, U);
    return quantize_row_searched_avx512<2, 15>(x, d, quant, dst, U);
  }
  if (isa >= Isa::kAvx2) {
    const uint32_t best = quant == KVQuant::kFp8E4M3 ? searched_scale_avx2<3, 7>(x, d, quant)
                                                     : searched_scale_avx2<2, 15>(x, d, quant);
    if (U != nullptr) return write_row_gptq(x, d, quant, best, U, dst, isa);
    return write_row(x, d, quant, best, dst);
  }
#endif
  quantize_row_searched_scalar(x, d, quant, dst, U, isa);
}

}  // namespace

void silu_mul(const void* g, const void* u, void* out, int64_t n, bool bf16, Isa isa,
              int num_threads) {
  if (bf16) {
    ::silu_mul<BF16>(static_cast<const uint16_t*>(g), static_cast<const uint16_t*>(u),
                     static_cast<uint16_t*>(out), n, isa, num_threads);
  } else {
    ::silu_mul<F32>(static_cast<const float*>(g), static_cast<const float*>(u),
                    static_cast<float*>(out), n, isa, num_threads);
  }
}

void silu_mul_rows(const void* gu, void* out, int64_t rows, int64_t inter, bool bf16, Isa isa,
                   int num_threads) {
  if (bf16) {
    ::silu_mul_rows<BF16>(static_cast<const uint16_t*>(gu), static_cast<uint16_t*>(out), rows,
                          inter, isa, num_threads);
  } else {
    ::silu_mul_rows<F32>(static_cast<const float*>(gu), static_cast<float*>(out), rows, inter,
                         isa, num_threads);
  }
}

void quantize_kv_rows_gptq(const float* x, int64_t n, int64_t d, int64_t heads, KVQuant quant,
                           const float* gptq, uint8_t* dst, Isa isa, int num_threads) {
  const int64_t tokens = n / heads, blocks = (tokens + 15) / 16;
  // Items: (kv head, 16 tokens); each a contiguous range of one head's rows.
  split_items(heads * blocks, num_threads, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, t0 = item % blocks * 16;
      const int64_t t1 = std::min(tokens, t0 + 16);
      const float* u = gptq + h * d * d;
#if RS_X86
      if (isa >= Isa::kAvx512) {
        if (quant == KVQuant::kFp8E4M3)
          gptq_rows_avx512<3, 7>(x, heads, h, t0, t1, d, quant, u, dst);
        else
          gptq_rows_avx512<2, 15>(x, heads, h, t0, t1, d, quant, u, dst);
        continue;
      }
#endif
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t row = t * heads + h;
        quantize_row_searched(x + row * d, d, quant, dst + row * (d + 2), isa, u);
      }
    }
  });
}

void quantize_kv_row(const float* x, int64_t d, KVQuant quant, uint8_t* dst, Isa isa,
                     bool searched, const float* gptq) {
  if (searched && quant != KVQuant::kInt8)
    return quantize_row_searched(x, d, quant, dst, isa, gptq);
#if RS_X86
  if (isa >= Isa::kAvx512) return quantize_row_avx512(x, d, quant, dst);
#endif
  (void)isa;
  quantize_row_scalar(x, d, quant, dst);
}

void hadamard_row(float* x, int64_t d) {
  const int64_t block = d & -d;  // the largest power of 2 dividing d
  for (int64_t h = 1; h < block; h *= 2) {
    for (int64_t i = 0; i < d; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  for (int64_t i = 0; i < d; ++i) x[i] *= norm;
}

void decode_layers(const DecodeLayers& p, Isa isa, int num_threads) {
  if (p.bf16) {
    run<BF16>(p, isa, num_threads);
  } else {
    run<F32>(p, isa, num_threads);
  }
}

}  // namespace radixserve
