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

namespace radixserve {

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

void decode_layers(const DecodeLayers& p, Isa isa, int num_threads) {
  if (p.bf16) {
    run<BF16>(p, isa, num_threads);
  } else {
    run<F32>(p, isa, num_threads);
  }
}

}  // namespace radixserve
