// Attention of many query vectors over one run of keys: a cascade group's shared
// prefix (radixserve/worker/attention/shared_prefix.py), where every member's query
// heads of one kv head read the same keys with no mask, and a prefill chunk
// (torch_backend.py), where each query vector sees a prefix of the keys (its causal
// limit). It returns each row's output and the log-sum-exp of its scaled scores, for
// the merge with the members' own suffixes (lse_merge.cpp).
//
// One call takes one chunk or all of a step's chunks (prefix_attention_chunks: one
// parallel region per layer). Per chunk and kv head, K and V are packed once per call
// into the products' operand layouts (K^T in feature pairs, V in key pairs), and the
// work is split into tasks of 32 query vectors of one chunk and kv head (run(), below):
// the scores of a task's 32 rows against the keys its rows see (up to the longest limit,
// in blocks of 32; blocks past it are skipped) go to a float32 block that stays in the
// core's cache, its softmax runs in vector code, and its probabilities, rounded to
// bfloat16, multiply V. Products of bfloat16 pairs are summed in float32 (as
// torch's CPU flash attention does); the scale is applied to the summed score. bfloat16
// values and head_dim a multiple of 32 only.
//
// The two products run in one of two forms, on the same packed operands:
//   AMX tiles (prefix_attention_amx): tdpbf16ps, 16 x 16 x 32 products each; tile
//     instructions run only after amx_tiles_granted() (amx_gemm.cpp).
//   vdpbf16ps (prefix_attention_dp, AVX512_BF16 CPUs without AMX): register-blocked
//     micro-kernels, 16 lanes x 2 products each. Scores: 12 rows x 32 keys of
//     accumulators, each step one feature pair of 32 keys (two K^T loads) times each
//     row's pair broadcast. Value sums: 6 rows x 64 features (or 12 x 32), each step one
//     key pair of V times each row's pair of probabilities broadcast.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

#if RS_X86
#include <immintrin.h>
#endif

namespace radixserve {

#if RS_X86

namespace {

constexpr int64_t kTaskRows = 32;  // query vectors per task: two tile rows
constexpr int64_t kKeyBlock = 32;  // keys per score step: two tile columns

// exp(x) for finite x <= 0 as 2^t, t = x log2(e): 2^(t - round(t)) by its degree-5
// Taylor polynomial (relative error below 3e-6 on [-1/2, 1/2]) scaled by 2^round(t) with
// vscalefps, which
// gives 0 for t below the float range. The probabilities are rounded to bfloat16 after,
// and the row sums are float32 sums: this is as exact as they need.
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE __m512 exp_le0(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Row-wise softmax of the scaled scores s [32][lp] (rows ls apart), row r over keys
// [0, lens[r]): probabilities in bfloat16 into pb [32][lp] (zero past lens[r]), each
// row's sum into l and its max into m (scaled). Rows past `rows` are zero.
RS_TARGET_AVX512BF16 void softmax_block(const float* s, int64_t ls, int64_t lp, const int64_t* lens,
                                 int64_t rows, float scale, uint16_t* pb, float* m, float* l) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < kTaskRows; ++r) {
    uint16_t* dst = pb + r * ls;
    if (r >= rows) {
      std::memset(dst, 0, static_cast<size_t>(lp) * sizeof(uint16_t));
      continue;
    }
    const float* src = s + r * ls;
    const int64_t len = lens[r];
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(src + j));
    if (j < len) {
      const __mmask16 k = static_cast<__mmask16>((1u << (len - j)) - 1);
      vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_maskz_loadu_ps(k, src + j));
    }
    const float mx = _mm512_reduce_max_ps(vmax) * scale;
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (j = 0; j < lp; j += 16) {
      const int64_t n = std::min<int64_t>(16, len - j);
      const __mmask16 k = static_cast<__mmask16>(n >= 16 ? 0xffffu : n > 0 ? (1u << n) - 1 : 0u);
      const __m512 e = _mm512_maskz_mov_ps(k, exp_le0(_mm512_fmsub_ps(_mm512_loadu_ps(src + j), sc, vm)));
      vsum = _mm512_add_ps(vsum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    m[r] = mx;
    l[r] = _mm512_reduce_add_ps(vsum);
  }
}

template <typename T>
void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

struct Args {
  const uint16_t* q;       // [n / group][kv_heads][group][d]
  const uint16_t* pool;    // the layer's pages viewed as [rows][row_len]
  const int64_t* k_rows;   // [pages] the K row of each shared page (V: + 1)
  const int32_t* limits;   // [n] keys each query vector sees (a prefix of them); null: len
  int64_t n, group, d, kv_heads, page_size, row_len, len;
  float scale;
  uint16_t* out;           // as q
  float* lse;              // [kv_heads][n]
};

// Where query vector i of kv head h starts in q and out (elements).
RS_ALWAYS_INLINE int64_t row_at(const Args& a, int64_t h, int64_t i) {
  return ((i / a.group * a.kv_heads + h) * a.group + i % a.group) * a.d;
}

// The K (which = 0) or V (1) row of key t, kv head h.
RS_ALWAYS_INLINE const uint16_t* key_row(const Args& a, int64_t t, int64_t which, int64_t h) {
  const int64_t page = t / a.page_size, slot = t % a.page_size;
  return a.pool + (a.k_rows[page] + which) * a.row_len + slot * a.kv_heads * a.d + h * a.d;
}

// tmm0-3: scores (rows 0-15 | 16-31) x (keys 0-15 | 16-31) of one key block; tmm4-5:
// the rows' feature pairs; tmm6-7: the keys' feature pairs.
RS_TARGET_AMX void score_tiles(const uint32_t* qp, int64_t d2, const uint32_t* kt, int64_t lp,
                               int64_t ls, float* s) {
  for (int64_t j0 = 0; j0 < lp; j0 += kKeyBlock) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t p = 0; p < d2; p += 16) {
      _tile_loadd(4, qp + p, d2 * 4);
      _tile_loadd(5, qp + 16 * d2 + p, d2 * 4);
      _tile_loadd(6, kt + p * ls + j0, ls * 4);
      _tile_loadd(7, kt + p * ls + j0 + 16, ls * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, s + j0, ls * 4);
    _tile_stored(1, s + j0 + 16, ls * 4);
    _tile_stored(2, s + 16 * ls + j0, ls * 4);
    _tile_stored(3, s + 16 * ls + j0 + 16, ls * 4);
  }
}

// Packs kv head h: kt [d / 2][lp] (word p of key j's K row), vp [lp / 2][d] (V of keys
// 2kp and 2kp + 1 interleaved per feature), zero past len.
RS_TARGET_AVX512BF16 void pack_head(const Args& a, int64_t h, int64_t lp, int64_t ls, uint32_t* kt,
                             uint32_t* vp) {
  const int64_t d2 = a.d / 2;
  // K^T by blocks of 16 keys: their rows are copied out, then each feature pair's 16
  // words are written as one cache line (a word at a time down kt's columns would hit
  // one cache set over and over when lp * 4 is a multiple of 4 KiB).
  uint32_t rows[16][64];  // d2 <= 64 words per key (head_dim <= 128) per pass
  for (int64_t j0 = 0; j0 < lp; j0 += 16) {
    for (int64_t p0 = 0; p0 < d2; p0 += 64) {
      const int64_t np = std::min<int64_t>(64, d2 - p0);
      for (int64_t j = 0; j < 16; ++j) {
        if (j0 + j < a.len)
          std::memcpy(rows[j], key_row(a, j0 + j, 0, h) + 2 * p0, static_cast<size_t>(np) * 4);
        else
          std::memset(rows[j], 0, static_cast<size_t>(np) * 4);
      }
      for (int64_t p = 0; p < np; ++p) {
        uint32_t* dst = kt + (p0 + p) * ls + j0;
        for (int64_t j = 0; j < 16; ++j) dst[j] = rows[j][p];
      }
    }
  }
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t kp = 0; kp < lp / 2; ++kp) {
    uint32_t* dst = vp + kp * a.d;
    const int64_t j = 2 * kp;
    if (j >= a.len) {
      std::memset(dst, 0, static_cast<size_t>(a.d) * sizeof(uint32_t));
      continue;
    }
    const uint16_t* va = key_row(a, j, 1, h);
    const uint16_t* vb = j + 1 < a.len ? key_row(a, j + 1, 1, h) : nullptr;
    for (int64_t f = 0; f < a.d; f += 32) {
      const __m512i x = _mm512_loadu_si512(va + f);
      const __m512i y = vb ? _mm512_loadu_si512(vb + f) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + f, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(dst + f + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// Per-thread scratch of one task, reused between tasks and calls (no zero fill; every
// word read is written first).
struct Scratch {
  std::vector<uint32_t> qpad;  // [32][d / 2] the task's query vectors (zero past the last)
  std::vector<float> s;        // [32][ls] scores
  std::vector<uint16_t> pb;    // [32][ls] probabilities (bfloat16)
  std::vector<float> o;        // [32][d] value sums

  void reserve(int64_t d, int64_t ls) {
    grow(qpad, kTaskRows * d / 2);
    grow(s, kTaskRows * ls);
    grow(pb, kTaskRows * ls);
    grow(o, kTaskRows * d);
  }
};

// A task's query vectors, as 32 rows of feature pairs into w.qpad ([rows, 32) zero). The
// keys each row sees into lens; returns the keys the task reads (its longest row's, in
// whole key blocks).
int64_t task_rows(const Args& a, int64_t h, int64_t i0, Scratch& w, int64_t* rows,
                  int64_t* lens) {
  const int64_t d = a.d;
  *rows = std::min(kTaskRows, a.n - i0);
  uint16_t* qp = reinterpret_cast<uint16_t*>(w.qpad.data());
  const size_t row_bytes = static_cast<size_t>(d) * sizeof(uint16_t);
  for (int64_t r = 0; r < *rows; ++r)
    std::memcpy(qp + r * d, a.q + row_at(a, h, i0 + r), row_bytes);
  if (*rows < kTaskRows)  // the last rows of a head: zero-padded to a whole task
    std::memset(qp + *rows * d, 0, static_cast<size_t>(kTaskRows - *rows) * row_bytes);
  int64_t longest = 0;
  for (int64_t r = 0; r < *rows; ++r) {
    lens[r] = a.limits ? std::min<int64_t>(a.limits[i0 + r], a.len) : a.len;
    longest = std::max(longest, lens[r]);
  }
  return (longest + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
}

// A task's rows of out (w.o [32][d] divided by each row's sum, rounded to bfloat16) and
// of lse.
RS_TARGET_AVX512BF16 void finish_task(const Args& a, int64_t h, int64_t i0, int64_t rows,
                                      const float* o, const float* m, const float* l) {
  const int64_t d = a.d;
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    uint16_t* dst = a.out + row_at(a, h, i0 + r);
    for (int64_t f = 0; f < d; f += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + f), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + f), (__m256i)_mm512_cvtneps_pbh(x));
    }
    a.lse[h * a.n + i0 + r] = m[r] + std::log(l[r]);
  }
}

RS_TARGET_AMX void run_task_amx(const Args& a, int64_t h, int64_t i0, int64_t ls,
                                const uint32_t* kt, const uint32_t* vp, Scratch& w) {
  int64_t rows, lens[kTaskRows];
  const int64_t lt = task_rows(a, h, i0, w, &rows, lens);
  const uint32_t* qp = w.qpad.data();
  score_tiles(qp, a.d / 2, kt, lt, ls, w.s.data());
  float m[kTaskRows], l[kTaskRows];
  softmax_block(w.s.data(), ls, lt, lens, rows, a.scale, w.pb.data(), m, l);
  // o [32][d] (float32) = P . V, P's rows ls bfloat16 (ls / 2 words) apart
  amx_value_rows(reinterpret_cast<const uint32_t*>(w.pb.data()), kTaskRows, lt / 2, ls / 2, vp,
                 a.d, w.o.data());
  finish_task(a, h, i0, rows, w.o.data(), m, l);
}

// vdpbf16ps: lane j of acc += x.lo * k_j.lo + x.hi * k_j.hi, bfloat16 pairs in 32-bit words.
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE __m512 dp(__m512 acc, uint32_t x, __m512i k) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(x)), (__m512bh)k);
}

// s[r][j] (rows ls floats apart) = sum_p qp[r][p] . kt[p][j] for r < R, j < 32: qp rows
// of d2 words, kt rows ls words apart (the key block's first word).
template <int R>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void score_rows_dp(const uint32_t* qp, int64_t d2,
                                                         const uint32_t* kt, int64_t ls,
                                                         float* s) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < d2; ++p) {
    const __m512i k0 = _mm512_loadu_si512(kt + p * ls);
    const __m512i k1 = _mm512_loadu_si512(kt + p * ls + 16);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = dp(acc[r][0], qp[r * d2 + p], k0);
      acc[r][1] = dp(acc[r][1], qp[r * d2 + p], k1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * ls, acc[r][0]);
    _mm512_storeu_ps(s + r * ls + 16, acc[r][1]);
  }
}

// o[r][f] (rows d floats apart) := (first) or += sum_kp pw[r][kp] . vp[kp][f] for r < R,
// kp < nkp, f < 16 NC: pw rows of key-pair words pstride apart, vp rows d words apart.
template <int R, int NC>
RS_TARGET_AVX512BF16 RS_ALWAYS_INLINE void value_rows_dp(const uint32_t* pw, int64_t pstride,
                                                         int64_t nkp, const uint32_t* vp,
                                                         int64_t d, float* o, bool first) {
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c)
      acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o + r * d + 16 * c);
  for (int64_t kp = 0; kp < nkp; ++kp) {
    __m512i v[NC];
    for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_si512(vp + kp * d + 16 * c);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NC; ++c) acc[r][c] = dp(acc[r][c], pw[r * pstride + kp], v[c]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + r * d + 16 * c, acc[r][c]);
}

// Key pairs of V per pass of the value sums: 64 x 64 features (16 KiB) stay in L1 while
// every row block of the task reads them.
constexpr int64_t kValuePairs = 64;

// s [32][lt] (rows ls apart) = the task's scores: per key block, 12 + 12 + 8 rows (24
// and 16 accumulators), the block's K^T (d / 2 x 32 words) read from L1 by each.
RS_TARGET_AVX512BF16 void score_task_dp(const uint32_t* qp, int64_t d2, const uint32_t* kt,
                                        int64_t lt, int64_t ls, float* s) {
  static_assert(kTaskRows == 32 && kKeyBlock == 32, "row blocks below cover 32 rows x 32 keys");
  for (int64_t j0 = 0; j0 < lt; j0 += kKeyBlock) {
    score_rows_dp<12>(qp, d2, kt + j0, ls, s + j0);
    score_rows_dp<12>(qp + 12 * d2, d2, kt + j0, ls, s + 12 * ls + j0);
    score_rows_dp<8>(qp + 24 * d2, d2, kt + j0, ls, s + 24 * ls + j0);
  }
}

// o [32][d] = P . V for P's rows of nkp key-pair words (pstride apart): per pass of
// kValuePairs key pairs, 64 features at a time in blocks of 6 rows (24 accumulators),
// and where d % 64 == 32 the last 32 features in blocks of 12.
RS_TARGET_AVX512BF16 void value_task_dp(const uint32_t* pw, int64_t pstride, int64_t nkp,
                                        const uint32_t* vp, int64_t d, float* o) {
  for (int64_t k0 = 0; k0 < nkp; k0 += kValuePairs) {
    const int64_t nk = std::min(kValuePairs, nkp - k0);
    const bool first = k0 == 0;
    const uint32_t* p = pw + k0;
    const uint32_t* v = vp + k0 * d;
    int64_t f = 0;
    for (; f + 64 <= d; f += 64) {
      for (int64_t r = 0; r < 30; r += 6)
        value_rows_dp<6, 4>(p + r * pstride, pstride, nk, v + f, d, o + r * d + f, first);
      value_rows_dp<2, 4>(p + 30 * pstride, pstride, nk, v + f, d, o + 30 * d + f, first);
    }
    if (f < d) {  // 32 features
      value_rows_dp<12, 2>(p, pstride, nk, v + f, d, o + f, first);
      value_rows_dp<12, 2>(p + 12 * pstride, pstride, nk, v + f, d, o + 12 * d + f, first);
      value_rows_dp<8, 2>(p + 24 * pstride, pstride, nk, v + f, d, o + 24 * d + f, first);
    }
  }
}

RS_TARGET_AVX512BF16 void run_task_dp(const Args& a, int64_t h, int64_t i0, int64_t ls,
                                      const uint32_t* kt, const uint32_t* vp, Scratch& w) {
  int64_t rows, lens[kTaskRows];
  const int64_t lt = task_rows(a, h, i0, w, &rows, lens);
  const uint32_t* qp = w.qpad.data();
  score_task_dp(qp, a.d / 2, kt, lt, ls, w.s.data());
  float m[kTaskRows], l[kTaskRows];
  softmax_block(w.s.data(), ls, lt, lens, rows, a.scale, w.pb.data(), m, l);
  value_task_dp(reinterpret_cast<const uint32_t*>(w.pb.data()), ls / 2, lt / 2, vp, a.d,
                w.o.data());
  finish_task(a, h, i0, rows, w.o.data(), m, l);
}

// Where a chunk's work and packed operands lie in one call.
struct ChunkPlan {
  int64_t lp, ls;        // keys in whole blocks; row stride of K^T, scores, probabilities
  int64_t per_head;      // tasks per kv head
  int64_t first_task;    // its first task among the call's
  int64_t kt_at, vp_at;  // its packed K^T and V in the shared buffers (words)
};

// Both forms, every chunk of the call in one parallel region. A task (32 query vectors
// of one chunk and kv head) is one thread's and reads only its chunk's packed K and V,
// which hold the same words however they are packed: a row's bits depend on neither the
// thread split nor the other chunks. Two ways to split the work:
//   per head: threads over (chunk, kv head) units, each packing its K and V into the
//     thread's own buffers (in its cache) and running the unit's tasks; no barrier
//     between packing and tasks. Taken where the largest unit is at most a quarter of a
//     thread's share, so that the units balance over the threads (a step of many
//     chunks).
//   shared: every (chunk, kv head) packed into shared buffers (threads over units), a
//     barrier, then threads over all tasks (one chunk of few kv heads: its tasks split).
bool run(const Args* chunks, int64_t count, bool amx, int num_threads) {
  const Args& a0 = chunks[0];
  const int64_t d = a0.d, d2 = d / 2, kv_heads = a0.kv_heads;
  std::vector<ChunkPlan> plan(static_cast<size_t>(count));
  int64_t tasks = 0, kt_words = 0, vp_words = 0, max_ls = 0, work = 0, max_unit = 0;
  for (int64_t c = 0; c < count; ++c) {
    ChunkPlan& p = plan[static_cast<size_t>(c)];
    const Args& a = chunks[c];
    p.lp = (a.len + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    // Past lp by one cache line, so that the rows of a block never share a cache set
    // (lp * 4 may be a multiple of 4 KiB).
    p.ls = p.lp + 16;
    p.per_head = (a.n + kTaskRows - 1) / kTaskRows;
    p.first_task = tasks;
    p.kt_at = kt_words;
    p.vp_at = vp_words;
    tasks += kv_heads * p.per_head;
    kt_words += kv_heads * d2 * p.ls;
    vp_words += kv_heads * (p.lp / 2) * d;
    max_ls = std::max(max_ls, p.ls);
    const int64_t unit = p.per_head * p.lp;  // its tasks' rows x keys, roughly
    work += kv_heads * unit;
    max_unit = std::max(max_unit, unit);
  }
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, tasks)));
  const bool per_head = 4 * threads * max_unit <= work;
  const int64_t units = count * kv_heads;
  // Per head: the units largest first, so that the last ones taken are small.
  std::vector<int64_t> order;
  if (per_head) {
    order.resize(static_cast<size_t>(units));
    for (int64_t u = 0; u < units; ++u) order[static_cast<size_t>(u)] = u;
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
      const ChunkPlan& px = plan[static_cast<size_t>(x / kv_heads)];
      const ChunkPlan& py = plan[static_cast<size_t>(y / kv_heads)];
      return px.per_head * px.lp > py.per_head * py.lp;
    });
  }
  // Shared: reused between calls. Pointers are taken here: inside the parallel region a
  // thread_local would be each thread's own.
  static thread_local std::vector<uint32_t> kt_buf, vp_buf;
  if (!per_head) {
    grow(kt_buf, kt_words);
    grow(vp_buf, vp_words);
  }
  uint32_t* kt = kt_buf.data();
  uint32_t* vp = vp_buf.data();
  // The chunk of task t (tasks are numbered chunk by chunk).
  auto chunk_of = [&](int64_t t) {
    int64_t lo = 0, hi = count - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (plan[static_cast<size_t>(mid)].first_task <= t)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  };
  bool ok = true;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    static thread_local Scratch w;
    w.reserve(d, max_ls);
    const bool tiles = amx && amx_attention_begin();
    if (amx && !tiles) {
#pragma omp atomic write
      ok = false;
    }
    auto task = [&](const Args& a, const ChunkPlan& p, int64_t h, int64_t i0,
                    const uint32_t* kh, const uint32_t* vh) {
      if (amx)
        run_task_amx(a, h, i0, p.ls, kh, vh, w);
      else
        run_task_dp(a, h, i0, p.ls, kh, vh, w);
    };
    if (per_head) {
      static thread_local std::vector<uint32_t> kt_own, vp_own;
      grow(kt_own, d2 * max_ls);
      grow(vp_own, max_ls / 2 * d);
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < units; ++u) {
        if (amx && !tiles) continue;
        const int64_t c = order[static_cast<size_t>(u)] / kv_heads;
        const int64_t h = order[static_cast<size_t>(u)] % kv_heads;
        const Args& a = chunks[c];
        const ChunkPlan& p = plan[static_cast<size_t>(c)];
        pack_head(a, h, p.lp, p.ls, kt_own.data(), vp_own.data());
        for (int64_t i = 0; i < p.per_head; ++i)
          task(a, p, h, i * kTaskRows, kt_own.data(), vp_own.data());
      }
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < units; ++u) {
        const int64_t c = u / kv_heads, h = u % kv_heads;
        const ChunkPlan& p = plan[static_cast<size_t>(c)];
        pack_head(chunks[c], h, p.lp, p.ls, kt + p.kt_at + h * d2 * p.ls,
                  vp + p.vp_at + h * (p.lp / 2) * d);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < tasks; ++t) {
        if (amx && !tiles) continue;
        const int64_t c = chunk_of(t);
        const ChunkPlan& p = plan[static_cast<size_t>(c)];
        const int64_t h = (t - p.first_task) / p.per_head;
        const int64_t i0 = (t - p.first_task) % p.per_head * kTaskRows;
        task(chunks[c], p, h, i0, kt + p.kt_at + h * d2 * p.ls,
             vp + p.vp_at + h * (p.lp / 2) * d);
      }
    }
    if (tiles) amx_attention_end();
  }
  return ok;
}

bool valid(const PrefixChunk* chunks, int64_t count, int64_t group, int64_t d) {
  if (count <= 0 || d % 32 != 0 || group <= 0) return false;
  for (int64_t c = 0; c < count; ++c)
    if (chunks[c].len <= 0 || chunks[c].n <= 0 || chunks[c].n % group != 0) return false;
  return true;
}

}  // namespace

bool prefix_attention_chunks(const PrefixChunk* chunks, int64_t count, const uint16_t* pool,
                             int64_t group, int64_t d, int64_t kv_heads, int64_t page_size,
                             int64_t row_len, float scale, bool amx, int num_threads) {
  if (!valid(chunks, count, group, d)) return false;
  if (amx ? !amx_tiles_granted() : best_isa() < Isa::kAvx512Bf16) return false;
  std::vector<Args> args;
  args.reserve(static_cast<size_t>(count));
  for (int64_t c = 0; c < count; ++c) {
    const PrefixChunk& k = chunks[c];
    args.push_back(Args{k.q, pool, k.k_rows, k.limits, k.n, group, d, kv_heads, page_size,
                        row_len, k.len, scale, k.out, k.lse});
  }
  return run(args.data(), count, amx, num_threads);
}

bool prefix_attention_amx(const uint16_t* q, const uint16_t* pool, const int64_t* k_rows,
                          const int32_t* limits, int64_t n, int64_t group, int64_t d,
                          int64_t kv_heads, int64_t page_size, int64_t row_len, int64_t len,
                          float scale, uint16_t* out, float* lse, int num_threads) {
  const PrefixChunk chunk{q, k_rows, limits, n, len, out, lse};
  return prefix_attention_chunks(&chunk, 1, pool, group, d, kv_heads, page_size, row_len, scale,
                                 true, num_threads);
}

bool prefix_attention_dp(const uint16_t* q, const uint16_t* pool, const int64_t* k_rows,
                         const int32_t* limits, int64_t n, int64_t group, int64_t d,
                         int64_t kv_heads, int64_t page_size, int64_t row_len, int64_t len,
                         float scale, uint16_t* out, float* lse, int num_threads) {
  const PrefixChunk chunk{q, k_rows, limits, n, len, out, lse};
  return prefix_attention_chunks(&chunk, 1, pool, group, d, kv_heads, page_size, row_len, scale,
                                 false, num_threads);
}

#else

bool prefix_attention_chunks(const PrefixChunk*, int64_t, const uint16_t*, int64_t, int64_t,
                             int64_t, int64_t, int64_t, float, bool, int) {
  return false;
}

bool prefix_attention_amx(const uint16_t*, const uint16_t*, const int64_t*, const int32_t*,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                          uint16_t*, float*, int) {
  return false;
}

bool prefix_attention_dp(const uint16_t*, const uint16_t*, const int64_t*, const int32_t*,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                         uint16_t*, float*, int) {
  return false;
}

#endif

}  // namespace radixserve
