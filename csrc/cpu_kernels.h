// The worker's CPU kernels (module radixserve.layers._cpu_kernels): paged decode
// attention (paged_attention.cpp) and the skinny product for float32 and
// bfloat16 (skinny_gemm.cpp), both free of Python. Bindings and argument checks:
// cpu_kernels.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// Instruction sets. Each hot loop is compiled once per level (per-function target
// attributes, so the file itself needs no -m flag and the build runs on any
// x86-64 CPU), and every call picks one at run time: the best the CPU has
// (best_isa), or one the caller forces for tests and benchmarks.
//   baseline    no target attribute: x86-64's SSE2 (what any other CPU's compiler default is)
//   avx2        AVX2 + FMA, 16 vector registers of 8 floats
//   avx512      AVX-512 F/BW/VL, 32 registers of 16 floats; bfloat16 converted to float32
//   avx512bf16  avx512 plus AVX512_BF16: bfloat16 products with vdpbf16ps
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__INTEL_COMPILER)
#define RS_X86 1
#define RS_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#define RS_TARGET_AVX512                                                                 \
  __attribute__((target("avx2,fma,f16c,bmi,bmi2,avx512f,avx512bw,avx512vl,avx512dq," \
                        "prefer-vector-width=512")))
#define RS_TARGET_AVX512BF16                                                             \
  __attribute__((target("avx2,fma,f16c,bmi,bmi2,avx512f,avx512bw,avx512vl,avx512dq," \
                        "avx512bf16,prefer-vector-width=512")))
// AMX tiles (amx_gemm.cpp, amx_attention.cpp; run only after amx_tiles_granted()).
#define RS_TARGET_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#else
#define RS_X86 0
#define RS_TARGET_AVX2
#define RS_TARGET_AVX512
#define RS_TARGET_AVX512BF16
#endif

#if defined(__GNUC__)
#define RS_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define RS_ALWAYS_INLINE inline
#endif

namespace radixserve {

#if RS_X86
// What ldtilecfg reads (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
#endif

// Ordered: each level runs everything the ones below it run.
enum class Isa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// The best level this CPU (and OS: the CPU check includes the saved register
// state) runs.
Isa best_isa();

// The body compiled for the highest level at or below `isa` of the three a kernel has.
template <typename F>
F by_isa(Isa isa, F baseline, F avx2, F avx512) {
  return isa >= Isa::kAvx512 ? avx512 : isa == Isa::kAvx2 ? avx2 : baseline;
}

// fn(begin, end) over [0, items) in contiguous ranges, one per thread (at most
// num_threads, at most items; one range runs on the caller's thread). fn is a plain
// call into a function with its own target attributes (a lambda does not inherit them).
template <typename Fn>
void split_items(int64_t items, int num_threads, Fn&& fn) {
  const int64_t parts = std::min<int64_t>(std::max(num_threads, 1), items);
  if (parts <= 1) {
    if (items > 0) fn(int64_t{0}, items);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(parts))
  for (int64_t i = 0; i < parts; ++i) fn(items * i / parts, items * (i + 1) / parts);
}
const char* isa_name(Isa isa);

// Eight floats as a GCC/clang vector: one AVX register in an AVX2 function, two SSE
// registers in a baseline one. Helpers are always inlined, so each caller's target
// decides its instructions. v16 is one AVX-512 register (used only by avx512
// functions).
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

template <typename V>
struct VecInt;
template <>
struct VecInt<v8> {
  typedef v8i type;
};
template <>
struct VecInt<v16> {
  typedef v16i type;
};

template <typename V>
constexpr int lanes() {
  return static_cast<int>(sizeof(V) / sizeof(float));
}

template <typename V>
RS_ALWAYS_INLINE V loadv(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
RS_ALWAYS_INLINE void storev(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

template <typename V>
RS_ALWAYS_INLINE V splat(float x) {
  return V{} + x;
}

RS_ALWAYS_INLINE v8 load8(const float* p) { return loadv<v8>(p); }
RS_ALWAYS_INLINE void store8(float* p, v8 v) { storev(p, v); }
RS_ALWAYS_INLINE v8 splat8(float x) { return splat<v8>(x); }

// exp of floats <= 0 (about 2 ulp; below -87 the result is ~0): Cody-Waite
// reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial, 2^n from the bits.
template <typename V>
RS_ALWAYS_INLINE V expv(V x) {
  typedef typename VecInt<V>::type VI;
  const V lo = splat<V>(-87.0f);
  x = x < lo ? lo : x;
  const V magic = splat<V>(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x * 1.44269504088896341f + magic) - magic;
  V r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  V p = splat<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI e = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

RS_ALWAYS_INLINE v8 exp8(v8 x) { return expv(x); }

// bfloat16 <-> float32 (round to nearest even; NaN stays NaN).
RS_ALWAYS_INLINE float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

RS_ALWAYS_INLINE uint16_t f32_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace radixserve

namespace radixserve {

// One paged decode attention call (paged_attention.cpp). Segment s: query rows
// rows[row_indptr[s]:row_indptr[s+1]] attend to keys [kv_begin[s], kv_end[s]) of
// pages pages[page_indptr[s]:page_indptr[s+1]]. A row is at most once in a
// segment; in several segments (disjoint keys) it attends to all of them. All
// indices must already be valid (the bindings check them).
struct PagedDecode {
  int64_t num_segments, num_heads, num_kv_heads, head_dim, page_size, group;
  const int32_t* row_indptr;
  const int32_t* rows;
  const int32_t* page_indptr;
  const int32_t* pages;
  const int32_t* kv_begin;
  const int32_t* kv_end;
  double scale;
  double softcap;  // > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
  // Per segment, or null for none: 1 makes the segment's rows a prefill chunk's
  // (bottom-right aligned causal): row r of n sees keys [kv_begin, kv_end - (n - 1 - r)).
  const uint8_t* causal;
  // > 0: batch-invariant mode (``--deterministic``). Keys are cut into items of exactly
  // this many at fixed offsets from kv_begin (the chunk argument is ignored); an item
  // past the segment's end reads zero rows there and masks them, and the vdpbf16ps
  // tiles are off. A row's result then depends only on its own query, keys and
  // position: not on its batch, its segment's other rows, or how its keys were split.
  int64_t fixed = 0;
  // bfloat16 items that the vdpbf16ps tiles take run their products on AMX tiles
  // where the CPU has them (amx_attention.cpp).
  bool amx = false;
};

enum class KVType { kFloat32, kFloat64, kBFloat16 };

// How the pool stores K and V: values of the query's type (kNone), or one-byte codes
// (int8, fp8 e4m3, fp8 e5m2) per element followed by a float16 scale per (token,
// kv head) row: [pages, 2, page_size, kv_heads, head_dim + 2] bytes, value = code *
// scale (radixserve/worker/kv_quant.py); in the fp8 formats a row of a negative scale
// holds int8 codes, value = code * |scale| (a sequence's position 0, its sink row).
enum class KVQuant { kNone, kInt8, kFp8E4M3, kFp8E5M2 };

// q, out: [rows, heads, head_dim]; kv: [pages, 2, page_size, kv_heads, head_dim],
// all of `type` (or quantized as `quant` says); lse (one of the two, or neither):
// [rows, heads]. `isa` must be one the CPU runs (at most best_isa()).
void paged_decode(const PagedDecode& p, KVType type, const void* q, const void* kv, void* out,
                  float* lse_f, double* lse_d, Isa isa, int num_threads, int64_t chunk,
                  KVQuant quant = KVQuant::kNone);

// One skinny product yT [N, M] = W [N, K] . x^T: W and yT row-major, x [M, K] with
// element strides (sm, sk), so a transposed view needs no copy. Each of W, x, yT is
// float32 or bfloat16 (float32 W takes float32 x and gives float32 yT).
enum class DType { kFloat32, kBFloat16 };
// The avx512bf16 forms for bfloat16 weights (skinny_gemm.cpp); auto chooses by M.
// Other levels and float32 weights have one form each and ignore it.
//   outer: x packed in K pairs, one broadcast weight pair times 16 (or 8) rows' pairs;
//   dot: lanes along K, a horizontal sum per output;
//   dot16: lanes along K, the sums of 16 outputs at once.
enum class SkinnyForm { kAuto, kOuter, kDot, kDot16 };
struct SkinnyGemm {
  const void* W;
  const void* x;
  void* yT;
  DType w_type, x_type, y_type;
  int64_t N, K, M, sm, sk;
  // A row's result independent of M (batch-invariant mode): at avx512bf16 auto takes
  // the outer form at every M (each form alone is independent of M, but auto
  // changes form with M).
  bool invariant = false;
  SkinnyForm form = SkinnyForm::kAuto;
};

// `isa` as for paged_decode. With bfloat16 weights, avx512bf16 multiplies bfloat16
// pairs (x rounded to bfloat16 first, as oneDNN's bfloat16 products do); every
// other level converts W to float32 on the fly and keeps x in float32.
void skinny_gemm(const SkinnyGemm& g, Isa isa, int num_threads);

// The same product on AMX tiles (amx_gemm.cpp) for bfloat16 weights, 1 to 32 rows of
// x, K a multiple of 32 and N of 16 (amx_gemm_takes); false (nothing computed) when
// the shape is not taken, the CPU has no AMX tiles or the OS refuses this process
// the tile state.
bool amx_gemm_takes(const SkinnyGemm& g);
bool skinny_gemm_amx(const SkinnyGemm& g, int num_threads);

// Whether this CPU has AMX tiles (amx_bf16) and the OS granted this process their
// state (asked once); no tile instruction runs anywhere unless it says so.
bool amx_tiles_granted();

// Attention's two products on AMX tiles (amx_attention.cpp), for paged_attention.cpp's
// bfloat16 items. amx_attention_begin configures this thread's tiles (false: no
// tiles, call nothing else); amx_attention_end releases them. Operands as the
// vdpbf16ps path packs them, as 32-bit words of two bfloat16 each:
//   amx_score_tile: sc[i][j0 + j] = scale * sum_p qp[i][p] . kt[p][j] for i < nq and
//     j < nb <= 32; qp [round_up(nq, 16)][D2] (rows past nq zero), kt [D2][32],
//     D2 % 16 == 0; sc rows of len floats.
//   amx_value_rows: out[i][d] = sum_kp pp[i][kp] . vp[kp][d] for i < nq and d < D;
//     pp [round_up(nq, 16)] rows of np2p words, pp_stride (>= np2p) words apart, vp
//     [np2p][D] (np2p % 16 == 0, padding zero), D % 16 == 0; out rows of D floats.
bool amx_attention_begin();
void amx_attention_end();
void amx_score_tile(const uint32_t* qp, int64_t nq, int64_t D2, const uint32_t* kt, float scale,
                    float* sc, int64_t len, int64_t j0, int64_t nb);
void amx_value_rows(const uint32_t* pp, int64_t nq, int64_t np2p, int64_t pp_stride,
                    const uint32_t* vp, int64_t D, float* out);

// Attention of n query vectors per kv head over one run of len keys
// (prefix_attention.cpp), on AMX tiles (prefix_attention_amx) or in vdpbf16ps
// micro-kernels (prefix_attention_dp, CPUs with AVX512_BF16): out (bfloat16, laid out
// as q) and lse [kv_heads][n] (float32, the natural log-sum-exp of each row's scaled
// scores) for q [n / group][kv_heads][group][d] (query vector i of kv head h at
// [i / group][h][i % group]: group = n is [kv_heads][n][d]; a chunk's tokens with their
// query heads folded per kv head is [tokens][kv_heads][heads per kv head][d]);
// key t of kv head h is at pool row k_rows[t / page_size] (V: + 1), offset
// ((t % page_size) * kv_heads + h) * d, rows of row_len bfloat16. Query vector i sees
// keys [0, limits[i]) (1 <= limits[i] <= len; every kv head alike), or all len keys
// when limits is null. d % 32 == 0, n % group == 0. False (nothing written that
// counts) where the form cannot run here (no AMX tiles granted; no AVX512_BF16).
bool prefix_attention_amx(const uint16_t* q, const uint16_t* pool, const int64_t* k_rows,
                          const int32_t* limits, int64_t n, int64_t group, int64_t d,
                          int64_t kv_heads, int64_t page_size, int64_t row_len, int64_t len,
                          float scale, uint16_t* out, float* lse, int num_threads);
bool prefix_attention_dp(const uint16_t* q, const uint16_t* pool, const int64_t* k_rows,
                         const int32_t* limits, int64_t n, int64_t group, int64_t d,
                         int64_t kv_heads, int64_t page_size, int64_t row_len, int64_t len,
                         float scale, uint16_t* out, float* lse, int num_threads);

// One chunk of prefix_attention_chunks: n query vectors (q and out laid out as above),
// its keys at pool rows k_rows (len keys), limits as above (null: all len keys), lse
// [kv_heads][n].
struct PrefixChunk {
  const uint16_t* q;
  const int64_t* k_rows;
  const int32_t* limits;
  int64_t n, len;
  uint16_t* out;
  float* lse;
};

// prefix_attention_amx (amx) or _dp for every chunk of chunks[count] (one layer's pool,
// head shape and scale) in one parallel region: each row's bits as in a call of its chunk
// alone, whatever the other chunks and the thread split. The one-chunk functions above
// are its count == 1 case. False as they are (and where a chunk has n or len <= 0).
bool prefix_attention_chunks(const PrefixChunk* chunks, int64_t count, const uint16_t* pool,
                             int64_t group, int64_t d, int64_t kv_heads, int64_t page_size,
                             int64_t row_len, float scale, bool amx, int num_threads);

// y [rows, n] = RMSNorm of bfloat16 rows x [rows, n] with weight w [n] (rms_norm.cpp),
// all C-contiguous bfloat16 bits; unit_offset scales by (1 + w) (Gemma).
void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t rows, int64_t n,
                   float eps, bool unit_offset, Isa isa, int num_threads);

// s = x + a and y = RMSNorm(s) * w (or * (1 + w) with unit_offset) over rows of n
// features (add_rms_norm.cpp), all float32 or all bfloat16 bits (bf16). x and a
// with element strides (row, col); s and y C-contiguous, feature-major ([n][rows])
// with feature_major, else row-major ([rows][n]); w [n].
struct AddRmsNorm {
  bool bf16, unit_offset, feature_major;
  const void* x;
  const void* a;
  const void* w;
  void* s;
  void* y;
  int64_t rows, n, x_row, x_col, a_row, a_col;
  float eps;
};
void add_rms_norm(const AddRmsNorm& p, Isa isa, int num_threads);

// Rotary embedding of q and k from the fused q/k/v product (rotary.cpp): token t's
// features qkv[t * row_stride + f * col_stride], f < (heads + 2 kv_heads) head_dim,
// into q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim] (C-contiguous);
// q and k rotated (rotate-half) by cos/sin [tokens, rot_dim], rot_dim even and at
// most min(head_dim, 512); all float32 or all bfloat16 bits.
struct RotaryQkv {
  bool bf16;
  const void* qkv;
  const void* cos;
  const void* sin;
  void* q;
  void* k;
  void* v;
  int64_t tokens, heads, kv_heads, head_dim, rot_dim, row_stride, col_stride;
};
void rotary_qkv(const RotaryQkv& p, Isa isa, int num_threads);

// Two partial attention results merged by their log-sum-exps (lse_merge.cpp): vector
// (h, l) of part [heads, len, dim] (element strides stride_h, stride_l; features
// contiguous) with its lse part_lse[h * lse_stride_h + l * lse_stride_l] is merged
// into row index[h * len + l] of out [rows, dim] and lse [rows] (C-contiguous), in
// place. out and part are `type`; the lse arrays float64 for kFloat64, else float32.
// Indices must be valid (the bindings check them).
struct MergeAttention {
  KVType type;
  void* out;
  void* lse;
  const void* part;
  const void* part_lse;
  const int64_t* index;
  int64_t heads, len, dim, stride_h, stride_l, lse_stride_h, lse_stride_l;
};
void merge_attention(const MergeAttention& m);

// Every decoder layer of a decode step (decode_layers.cpp): a pre-norm Llama-style
// layer (fused q/k/v, rotary, paged attention through one PagedDecode plan for all
// layers, output projection, SwiGLU with fused gate/up, no biases), all float32 or
// all bfloat16 bits. Per layer: norm weights [hidden], products row-major [out, in]
// (qkv [(heads + 2 kv_heads) head_dim, hidden], o [hidden, heads head_dim], gate_up
// [2 intermediate, hidden], down [hidden, intermediate]) and its pool layer
// [pages, 2, page_size, kv_heads, head_dim]. The caller gives the embeddings
// (`residual`, [tokens][hidden]) and layer 0's input norm of them (`x`, same
// layout), cos/sin [tokens][rot_dim], and each new token's K row in the pool viewed
// as [pages * 2 * page_size][kv_heads * head_dim] (V is page_size rows on). Out:
// the last MLP output and the residual stream before it, [hidden][tokens] each.
// Every index must already be valid (the bindings check them).
struct DecodeLayerWeights {
  const void* ln1;
  const void* qkv;
  const void* o;
  const void* ln2;
  const void* gate_up;
  const void* down;
  void* kv;
};
struct DecodeLayers {
  bool bf16, unit_offset;
  bool amx;  // bfloat16 products on AMX tiles (skinny_gemm_amx) where it takes them
  // Batch-invariant mode: a row's bits independent of the step's other rows, as the
  // layer-by-layer path computes them there (products with SkinnyGemm::invariant; the
  // norms feature-major for one row too; attention over fixed items, attn.fixed).
  bool invariant;
  int64_t layers, tokens, hidden, heads, kv_heads, head_dim, rot_dim, intermediate, page_size;
  float eps;
  const DecodeLayerWeights* weights;
  const void* residual;
  const void* x;
  const void* cos;
  const void* sin;
  const int64_t* write_rows;
  PagedDecode attn;
  int64_t chunk;
  void* h_out;
  void* residual_out;
  // How the pool stores K/V: the weights' dtype, or quantized rows (KVQuant), which
  // the call writes as radixserve/worker/kv_quant.py's quantize does, bit for bit.
  KVQuant quant;
  // Keys stored rotated (a quantized pool, KVPool.rotated): key rows rotated
  // (hadamard_row) and, for fp8, quantized with the searched scale; queries rotated
  // alike before attention.
  bool rotated;
  // Where the pool's keys are shifted (KVPool.key_shift, attention/key_shift.py):
  // [layers][kv_heads][head_dim] float32, subtracted from each rotated key row
  // before it is quantized; null for none.
  const float* key_shift;
  // Where the pool's fp8 keys are GPTQ-rounded (KVPool.key_gptq, attention/key_shift.py):
  // [layers][kv_heads][head_dim][head_dim] float32, each (layer, kv head)'s upper
  // triangular factor (quantize_kv_row's gptq); null for none.
  const float* key_gptq = nullptr;
};
void decode_layers(const DecodeLayers& p, Isa isa, int num_threads);

// out[i] = round(round(silu(g[i])) * u[i]) for n values (float32, or bfloat16 bits),
// the one-call decode layers' SwiGLU activation (its exp is expv's).
void silu_mul(const void* g, const void* u, void* out, int64_t n, bool bf16, Isa isa,
              int num_threads);
// The same for row-major gate_up [rows][2 * inter] (gate, then up, in each row) into out
// [rows][inter] (decode_layers.cpp), rows split between the threads.
void silu_mul_rows(const void* gu, void* out, int64_t rows, int64_t inter, bool bf16, Isa isa,
                   int num_threads);

// One (token, kv head) row of d values quantized as kv_quant.quantize does: d codes,
// then the float16 scale (max|x| / qmax rounded up), into dst (d + 2 bytes).
// `searched` (the keys of a rotated pool; fp8 formats only, int8 ignores it): the
// scale of least squared error instead (kv_quant.quantize's search_scale); with
// `gptq` (d x d float32, upper triangular; searched fp8 rows only) the codes under that
// scale GPTQ-rounded (kv_quant.quantize's gptq).
void quantize_kv_row(const float* x, int64_t d, KVQuant quant, uint8_t* dst, Isa isa,
                     bool searched = false, const float* gptq = nullptr);
// n rows x [tokens][heads][d] (fp8 formats), searched and GPTQ-rounded with gptq
// [heads][d][d], into dst [n][d + 2]: quantize_kv_row's bytes for each, at avx512 and up
// 16 rows of a kv head at a time (their rounding chains side by side), split between
// the threads.
void quantize_kv_rows_gptq(const float* x, int64_t n, int64_t d, int64_t heads, KVQuant quant,
                           const float* gptq, uint8_t* dst, Isa isa, int num_threads);
// x's d values rotated in place: x R for R the normalized Hadamard matrix of
// attention/rotation.py (Sylvester's, block-diagonal over the largest power of 2
// dividing d), by butterflies in float32, then the 1 / sqrt(block) factor.
void hadamard_row(float* x, int64_t d);

// out[r] = the first v with the largest x[v, r] (a NaN counting as largest) for
// x [vocab, rows] C-contiguous, float32 or bfloat16 bits (argmax.cpp).
void argmax_columns(const void* x, bool bf16, int64_t vocab, int64_t rows, int64_t* out,
                    Isa isa);

// exp(x), 0 below the square root of T's smallest normal number (x < log(min) / 2), as
// radixserve/models/gated_delta.py's flush_exp: a product of two such factors is never
// subnormal (subnormal arithmetic is many times slower on x86).
template <typename T>
inline T flush_exp(T x) {
  const T floor = static_cast<T>(0.5) * std::log(std::numeric_limits<T>::min());
  return x < floor ? static_cast<T>(0) : std::exp(x);
}

// The gated delta rule's decode step in place on the state pool (gated_delta.cpp):
// for each request b and head h, with S = state[entries[b]][h] ([key_dim][value_dim]
// at state + entries[b] * entry_stride + h * key_dim * value_dim), e = exp(g[b][h]):
//   S <- e S + k (beta (v - k^T (e S)))^T,  out[b][h] = q^T S
// q, k [batch, heads, key_dim], v, out [batch, heads, value_dim], g, beta [batch,
// heads], all C-contiguous, all float32 or all float64; entries distinct and in range,
// value_dim <= 512 (the bindings check).
struct GatedDeltaStep {
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  const void* beta;
  void* state;
  void* out;
  const int64_t* entries;
  int64_t batch, heads, key_dim, value_dim, entry_stride;
};
void gated_delta_step(const GatedDeltaStep& p, bool f64, Isa isa, int num_threads);

// Mamba-2's decode step in place on the state pool (mamba2_step.cpp): for each request
// r and head h (of group h / (heads / groups)), with S = state[entries[r]][h]
// ([head_dim][state_size], at state + entries[r] * entry_stride + h * head_dim *
// state_size), e = exp(dt[r][h] A[h]):
//   S <- e S + (dt x) B^T,  out[r][h] = S C
// x, out [batch, heads, head_dim], dt [batch, heads], A [heads], B, C [batch, groups,
// state_size], all C-contiguous, all float32 or all float64; entries distinct and in
// range (the bindings check).
struct Mamba2Step {
  const void* x;
  const void* dt;
  const void* A;
  const void* B;
  const void* C;
  void* state;
  void* out;
  const int64_t* entries;
  int64_t batch, heads, groups, head_dim, state_size, entry_stride;
};
void mamba2_step(const Mamba2Step& p, bool f64, Isa isa, int num_threads);

}  // namespace radixserve
