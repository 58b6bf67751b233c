// K/V rows of a quantized pool as radixserve/worker/kv_quant.py writes them, bit for bit
// (radixserve.layers._cpu_kernels.quantize_kv_rows, and the one-call decode layers'
// K/V writes, decode_layers.cpp): one-byte codes and a float16 scale per (token, kv
// head) row; for a rotated pool's fp8 keys the scale of least squared error among a
// few candidates (the "searched" scale) and, where the pool has GPTQ factors, the codes
// GPTQ-rounded under it (attention/key_shift.py); the Hadamard rotation of a row
// (attention/rotation.py). Every level (scalar, avx2, avx512) writes the same bytes:
// the same float32 operations in the same order, products never fused into the
// subtraction that follows them.
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

}  // namespace radixserve
