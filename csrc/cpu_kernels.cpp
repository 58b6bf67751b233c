// Python bindings of the worker's CPU kernels (module radixserve.layers._cpu_kernels).
//
// Arrays arrive as NumPy views of torch tensors (torch is imported first, so
// OpenMP regions run in torch's own runtime); shapes, dtypes and contiguity are
// checked here, before any pointer is read.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "step_bindings.h"

namespace py = pybind11;

namespace radixserve {

Isa best_isa() {
#if RS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return __builtin_cpu_supports("avx512bf16") ? Isa::kAvx512Bf16 : Isa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kBaseline:
      return "baseline";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "?";
}

// "auto" (the best this CPU runs) or a level's name; a level the CPU lacks is
// refused here, so a kernel never executes an instruction the CPU does not have.
Isa parse_isa(const std::string& name, const char* where) {
  const Isa best = best_isa();
  if (name == "auto") return best;
  for (int i = 0; i <= static_cast<int>(Isa::kAvx512Bf16); ++i) {
    const Isa isa = static_cast<Isa>(i);
    if (name != isa_name(isa)) continue;
    if (isa > best) {
      throw std::invalid_argument(std::string(where) + ": this CPU does not run isa '" + name +
                                  "' (best: " + isa_name(best) + ")");
    }
    return isa;
  }
  throw std::invalid_argument(std::string(where) + ": unknown isa '" + name +
                              "' (auto, baseline, avx2, avx512, avx512bf16)");
}

}  // namespace radixserve

namespace {

using radixserve::Isa;
using radixserve::parse_isa;

py::list supported_isas() {
  py::list out;
  for (int i = 0; i <= static_cast<int>(radixserve::best_isa()); ++i)
    out.append(radixserve::isa_name(static_cast<Isa>(i)));
  return out;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("paged_decode: " + what);
}

using I32Array = py::array_t<int32_t, py::array::c_style>;

// A pool's KV storage by its kv_quant.py name ("none": the query's dtype).
radixserve::KVQuant parse_quant(const std::string& name) {
  if (name == "none") return radixserve::KVQuant::kNone;
  if (name == "int8") return radixserve::KVQuant::kInt8;
  if (name == "fp8_e4m3") return radixserve::KVQuant::kFp8E4M3;
  if (name == "fp8_e5m2") return radixserve::KVQuant::kFp8E5M2;
  throw std::invalid_argument("kv_quant must be none, int8, fp8_e4m3 or fp8_e5m2, got " + name);
}

// A plan's segment arrays (int32) for R query rows over NP pages of P.page_size
// tokens, every index checked before it is stored in P; the row repeat check
// included (a row at most once per segment, possibly in several segments).
void check_segments(radixserve::PagedDecode& P, int64_t R, int64_t NP, const I32Array& row_indptr,
                    const I32Array& rows, const I32Array& page_indptr, const I32Array& pages,
                    const I32Array& kv_begin, const I32Array& kv_end) {
  const int64_t S = kv_end.shape(0);
  require(row_indptr.shape(0) == S + 1 && page_indptr.shape(0) == S + 1 && kv_begin.shape(0) == S,
          "segment arrays disagree in length");
  P.num_segments = S;
  P.row_indptr = row_indptr.data();
  P.rows = rows.data();
  P.page_indptr = page_indptr.data();
  P.pages = pages.data();
  P.kv_begin = kv_begin.data();
  P.kv_end = kv_end.data();
  const int64_t ps = P.page_size;
  require(P.row_indptr[0] == 0 && P.row_indptr[S] == rows.shape(0), "bad row_indptr");
  require(P.page_indptr[0] == 0 && P.page_indptr[S] == pages.shape(0), "bad page_indptr");
  for (int64_t s = 0; s < S; ++s) {
    require(P.row_indptr[s] <= P.row_indptr[s + 1] && P.page_indptr[s] <= P.page_indptr[s + 1],
            "indptr not monotone");
    require(0 <= P.kv_begin[s] && P.kv_begin[s] <= P.kv_end[s] &&
                P.kv_end[s] <= (P.page_indptr[s + 1] - P.page_indptr[s]) * ps,
            "key range outside the segment's pages");
  }
  for (int64_t i = 0; i < rows.shape(0); ++i)
    require(0 <= P.rows[i] && P.rows[i] < R, "row out of range");
  {
    std::vector<int64_t> seen(static_cast<size_t>(R), -1);
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = P.row_indptr[s]; i < P.row_indptr[s + 1]; ++i) {
        require(seen[static_cast<size_t>(P.rows[i])] != s, "a row repeats within a segment");
        seen[static_cast<size_t>(P.rows[i])] = s;
      }
    }
  }
  for (int64_t i = 0; i < pages.shape(0); ++i)
    require(0 <= P.pages[i] && P.pages[i] < NP, "page out of range");
}

// The segments' causal flags (None: none causal), held in ``hold`` while P reads them.
void check_causal(radixserve::PagedDecode& P, const py::object& causal,
                  py::array_t<uint8_t, py::array::c_style>& hold) {
  if (causal.is_none()) return;
  const int64_t S = P.num_segments;
  hold = py::array_t<uint8_t, py::array::c_style>::ensure(causal);
  require(hold && hold.ndim() == 1 && hold.shape(0) == S,
          "causal must be a uint8 array with one flag per segment");
  P.causal = hold.data();
  for (int64_t s = 0; s < S; ++s)
    require(!P.causal[s] || P.kv_end[s] - P.kv_begin[s] >= P.row_indptr[s + 1] - P.row_indptr[s],
            "a causal segment needs at least as many keys as rows");
}

// q: [R, H, D]; kv: [pages, 2, page_size, KVH, D]; out like q; lse: [R, H] float32/float64
// or None. Index arrays are int32. dtype: float32, float64, or bfloat16 given as
// int16/uint16 (numpy has no bfloat16). Every index is checked here, once, so the
// kernel never reads out of bounds.
void paged_decode(const py::array& q, const py::array& kv, py::array& out, py::object lse,
                  const py::array_t<int32_t, py::array::c_style>& row_indptr,
                  const py::array_t<int32_t, py::array::c_style>& rows,
                  const py::array_t<int32_t, py::array::c_style>& page_indptr,
                  const py::array_t<int32_t, py::array::c_style>& pages,
                  const py::array_t<int32_t, py::array::c_style>& kv_begin,
                  const py::array_t<int32_t, py::array::c_style>& kv_end, double scale,
                  int num_threads, int64_t chunk, const std::string& isa_name, double softcap,
                  py::object causal, const std::string& kv_quant, int64_t fixed, bool amx) {
  const Isa isa = parse_isa(isa_name, "paged_decode");
  require(fixed >= 0, "fixed must be >= 0 (0: off)");
  require(q.ndim() == 3 && kv.ndim() == 5 && out.ndim() == 3, "q/out must be 3-D, kv 5-D");
  const auto c = py::array::c_style;
  require((q.flags() & c) && (kv.flags() & c) && (out.flags() & c), "arrays must be C-contiguous");
  require(out.writeable(), "out must be writeable");
  const radixserve::KVQuant quant = parse_quant(kv_quant);
  const bool quantized = quant != radixserve::KVQuant::kNone;
  require(q.dtype().is(out.dtype()), "q and out dtypes differ");
  require(quantized ? kv.dtype().itemsize() == 1 : q.dtype().is(kv.dtype()),
          quantized ? "a quantized kv must be one-byte codes" : "q, kv, out dtypes differ");
  radixserve::PagedDecode P{};
  P.num_heads = q.shape(1);
  P.head_dim = q.shape(2);
  P.page_size = kv.shape(2);
  P.num_kv_heads = kv.shape(3);
  require(kv.shape(1) == 2 && kv.shape(4) == P.head_dim + (quantized ? 2 : 0),
          quantized ? "a quantized kv must be [pages, 2, ps, kvh, d + 2]"
                    : "kv must be [pages, 2, ps, kvh, d]");
  require(P.num_kv_heads > 0 && P.num_heads % P.num_kv_heads == 0,
          "heads not a multiple of kv heads");
  require(out.shape(0) == q.shape(0) && out.shape(1) == P.num_heads && out.shape(2) == P.head_dim,
          "out must have q's shape");
  P.group = P.num_heads / P.num_kv_heads;
  P.scale = scale;
  require(softcap >= 0, "softcap must be >= 0 (0: none)");
  P.softcap = softcap;
  P.fixed = fixed;
  P.amx = amx;
  const int64_t R = q.shape(0);
  check_segments(P, R, kv.shape(0), row_indptr, rows, page_indptr, pages, kv_begin, kv_end);
  py::array_t<uint8_t, py::array::c_style> causal_arr;
  check_causal(P, causal, causal_arr);
  float* lse_f = nullptr;
  double* lse_d = nullptr;
  if (!lse.is_none()) {
    py::array l = lse.cast<py::array>();
    require((l.flags() & c) && l.writeable() && l.ndim() == 2 && l.shape(0) == R &&
                l.shape(1) == P.num_heads,
            "lse must be a writeable C-contiguous [rows, heads] array");
    if (l.dtype().is(py::dtype::of<float>())) {
      lse_f = static_cast<float*>(l.mutable_data());
    } else if (l.dtype().is(py::dtype::of<double>())) {
      lse_d = static_cast<double*>(l.mutable_data());
    } else {
      require(false, "lse must be float32 or float64");
    }
  }
  require(chunk > 0 && num_threads > 0, "chunk and num_threads must be positive");
  const char kind = q.dtype().kind();
  const auto size = q.dtype().itemsize();
  radixserve::KVType type;
  if (kind == 'f' && size == 4) {
    type = radixserve::KVType::kFloat32;
  } else if (kind == 'f' && size == 8) {
    type = radixserve::KVType::kFloat64;
  } else {
    require((kind == 'i' || kind == 'u') && size == 2,
            "unsupported dtype (float32, float64, or bfloat16 as int16)");
    type = radixserve::KVType::kBFloat16;
  }
  const void* qp = q.data();
  const void* kvp = kv.data();
  void* outp = out.mutable_data();
  py::gil_scoped_release nogil;
  radixserve::paged_decode(P, type, qp, kvp, outp, lse_f, lse_d, isa, num_threads, chunk, quant);
}

// float32, or bfloat16 given as int16/uint16 (numpy has no bfloat16).
bool is_bf16(const py::array& a) {
  const char kind = a.dtype().kind();
  return (kind == 'i' || kind == 'u') && a.dtype().itemsize() == 2;
}

void skinny_gemm(const py::array& w, const py::array& x, py::array& yT, int num_threads,
                 const std::string& isa_name, bool amx, bool invariant,
                 const std::string& form) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("skinny_gemm: " + what); };
  const Isa isa = parse_isa(isa_name, "skinny_gemm");
  using radixserve::SkinnyForm;
  SkinnyForm f = SkinnyForm::kAuto;
  if (form == "outer") f = SkinnyForm::kOuter;
  else if (form == "dot") f = SkinnyForm::kDot;
  else if (form == "dot16") f = SkinnyForm::kDot16;
  else if (form != "auto") fail("unknown form '" + form + "' (auto, outer, dot, dot16)");
  const auto c = py::array::c_style;
  if (w.ndim() != 2 || x.ndim() != 2 || yT.ndim() != 2) fail("w, x and yT must be 2-D");
  using radixserve::DType;
  auto type_of = [&](const py::array& a) {
    if (a.dtype().is(py::dtype::of<float>())) return DType::kFloat32;
    if (!is_bf16(a)) fail("arrays must be float32 or bfloat16 (as int16)");
    return DType::kBFloat16;
  };
  radixserve::SkinnyGemm g{};
  g.w_type = type_of(w);
  g.x_type = type_of(x);
  g.y_type = type_of(yT);
  if (g.w_type == DType::kFloat32 &&
      (g.x_type != DType::kFloat32 || g.y_type != DType::kFloat32))
    fail("float32 weights take float32 x and yT");
  if (!(w.flags() & c) || !(yT.flags() & c)) fail("w and yT must be C-contiguous");
  const int64_t item = x.dtype().itemsize();
  if (x.strides(0) % item || x.strides(1) % item) fail("x's strides must be whole elements");
  if (!yT.writeable()) fail("yT must be writeable");
  g.N = w.shape(0);
  g.K = w.shape(1);
  g.M = x.shape(0);
  if (x.shape(1) != g.K) fail("x must be [M, K] with w's K");
  if (yT.shape(0) != g.N || yT.shape(1) != g.M) fail("yT must be [N, M]");
  if (num_threads < 1) fail("num_threads must be positive");
  g.W = w.data();
  g.x = x.data();
  g.yT = yT.mutable_data();
  g.sm = x.strides(0) / item;
  g.sk = x.strides(1) / item;
  g.invariant = invariant;
  g.form = f;
  if (amx) {
    // The shape, the CPU and the OS are checked before any tile instruction.
    if (!radixserve::amx_gemm_takes(g)) fail("amx takes bfloat16 w, 1-32 rows, K % 32 == 0, N % 16 == 0");
    bool done;
    {
      py::gil_scoped_release nogil;
      done = radixserve::skinny_gemm_amx(g, num_threads);
    }
    if (!done) fail("this CPU has no AMX tiles, or the OS refused this process their state");
    return;
  }
  py::gil_scoped_release nogil;
  radixserve::skinny_gemm(g, isa, num_threads);
}

// gate_up [2 * I, rows] -> out [I, rows]: silu(gate) * up as the one-call decode
// layers compute it (the gate's rows, then the up rows, of a feature-major product).
void silu_mul_py(const py::array& gate_up, py::array& out, int num_threads,
                 const std::string& isa_name) {
  const Isa isa = parse_isa(isa_name, "silu_mul");
  const auto c = py::array::c_style;
  const bool bf16 = is_bf16(gate_up);
  if (!bf16 && !gate_up.dtype().is(py::dtype::of<float>()))
    throw std::invalid_argument("silu_mul: float32 or bfloat16 (as int16) arrays");
  if (gate_up.ndim() != 2 || out.ndim() != 2 || !(gate_up.flags() & c) || !(out.flags() & c) ||
      !out.writeable() || is_bf16(out) != bf16 || out.dtype().itemsize() != gate_up.dtype().itemsize() ||
      gate_up.shape(0) != 2 * out.shape(0) || gate_up.shape(1) != out.shape(1))
    throw std::invalid_argument("silu_mul: gate_up [2 * I, rows] and a writeable out [I, rows], "
                                "C-contiguous, one dtype");
  const int64_t n = out.shape(0) * out.shape(1);
  const char* g = static_cast<const char*>(gate_up.data());
  py::gil_scoped_release nogil;
  radixserve::silu_mul(g, g + n * gate_up.dtype().itemsize(), out.mutable_data(), n, bf16, isa,
                       num_threads);
}

// out, lse := attention of q over the keys of pool rows k_rows (prefix_attention.cpp):
// q and out [kv_heads, n, d], or [tokens, kv_heads, group, d] (query vector i = token *
// group + g); bfloat16 as int16 throughout, lse [kv_heads, n] float32. On AMX tiles with
// amx, else in vdpbf16ps code at isa avx512bf16. False where that form cannot run (no
// tiles granted; isa below avx512bf16): nothing to use in out/lse.
bool prefix_attention_py(const py::array& q, const py::array& pool, const py::array& k_rows,
                         int64_t kv_len, int64_t page_size, double scale, py::array& out,
                         py::array& lse, int num_threads, const py::object& limits,
                         const std::string& isa_name, bool amx) {
  const Isa isa = parse_isa(isa_name, "prefix_attention");
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("prefix_attention: " + what);
  };
  const auto c = py::array::c_style;
  if (!is_bf16(q) || !is_bf16(pool) || !is_bf16(out) || !lse.dtype().is(py::dtype::of<float>()))
    fail("q, pool and out must be bfloat16 (as int16), lse float32");
  if (!k_rows.dtype().is(py::dtype::of<int64_t>())) fail("k_rows must be int64");
  if ((q.ndim() != 3 && q.ndim() != 4) || out.ndim() != q.ndim() || lse.ndim() != 2 ||
      pool.ndim() != 2 || k_rows.ndim() != 1)
    fail("q and out must be [kv_heads, n, d] or [tokens, kv_heads, group, d], lse [kv_heads, n], "
         "pool 2-D, k_rows 1-D");
  if (!(q.flags() & c) || !(pool.flags() & c) || !(k_rows.flags() & c) || !(out.flags() & c) ||
      !(lse.flags() & c) || !out.writeable() || !lse.writeable())
    fail("arrays must be C-contiguous (out and lse writeable)");
  const bool folded = q.ndim() == 4;
  const int64_t heads = q.shape(folded ? 1 : 0), d = q.shape(q.ndim() - 1);
  const int64_t n = folded ? q.shape(0) * q.shape(2) : q.shape(1);
  const int64_t group = folded ? q.shape(2) : n, row_len = pool.shape(1);
  for (int i = 0; i < q.ndim(); ++i)
    if (out.shape(i) != q.shape(i)) fail("out must have q's shape");
  if (lse.shape(0) != heads || lse.shape(1) != n) fail("lse must be [kv_heads, n]");
  if (d % 32 != 0) fail("head_dim must be a multiple of 32");
  if (page_size <= 0 || row_len != page_size * heads * d) fail("pool rows must hold page_size * kv_heads * d");
  const int64_t pages = k_rows.shape(0);
  if (kv_len <= 0 || kv_len > pages * page_size) fail("kv_len must be in (0, pages * page_size]");
  const int64_t* rows = static_cast<const int64_t*>(k_rows.data());
  for (int64_t i = 0; i < (kv_len + page_size - 1) / page_size; ++i)
    if (rows[i] < 0 || rows[i] + 1 >= pool.shape(0)) fail("a K row (or its V row) is out of range");
  const int32_t* lim = nullptr;
  py::array_t<int32_t, py::array::c_style> limits_arr;
  if (!limits.is_none()) {
    limits_arr = limits.cast<py::array_t<int32_t, py::array::c_style>>();
    if (limits_arr.ndim() != 1 || limits_arr.shape(0) != n) fail("limits must be int32 [n]");
    lim = limits_arr.data();
    for (int64_t i = 0; i < n; ++i)
      if (lim[i] < 1 || lim[i] > kv_len) fail("every limit must be in [1, kv_len]");
  }
  const auto* qp = static_cast<const uint16_t*>(q.data());
  const auto* pp = static_cast<const uint16_t*>(pool.data());
  auto* op = static_cast<uint16_t*>(out.mutable_data());
  auto* lp = static_cast<float*>(lse.mutable_data());
  py::gil_scoped_release nogil;
  if (amx)
    return radixserve::prefix_attention_amx(qp, pp, rows, lim, n, group, d, heads, page_size,
                                            row_len, kv_len, static_cast<float>(scale), op, lp,
                                            num_threads);
  if (isa < Isa::kAvx512Bf16) return false;
  return radixserve::prefix_attention_dp(qp, pp, rows, lim, n, group, d, heads, page_size,
                                         row_len, kv_len, static_cast<float>(scale), op, lp,
                                         num_threads);
}

// out, lse := prefix_attention of every chunk of a step in one call
// (prefix_attention.cpp): q and out [tokens, kv_heads, group, d] (bfloat16 as int16);
// chunk c is tokens [q_begin[c], q_begin[c] + q_len[c]) (ascending, disjoint), its
// query vectors tokens x group; its keys kv_len[c] keys in the pool rows
// k_rows[page_indptr[c]:page_indptr[c + 1]] (V the row after); its limits (int32
// [tokens * group], None: all keys) and lse (float32 [tokens * kv_heads * group]: the
// chunk's [kv_heads][q_len * group] block from q_begin[c] * kv_heads * group) at its
// tokens. Rows outside the chunks are not touched. False where the form cannot run.
bool prefix_attention_chunks_py(const py::array& q, const py::array& pool, py::array& out,
                                py::array& lse, const py::array_t<int64_t>& q_begin,
                                const py::array_t<int64_t>& q_len,
                                const py::array_t<int64_t>& k_rows,
                                const py::array_t<int64_t>& page_indptr,
                                const py::array_t<int64_t>& kv_len, int64_t page_size,
                                double scale, int num_threads, const py::object& limits,
                                const std::string& isa_name, bool amx) {
  const Isa isa = parse_isa(isa_name, "prefix_attention_chunks");
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("prefix_attention_chunks: " + what);
  };
  const auto c = py::array::c_style;
  if (!is_bf16(q) || !is_bf16(pool) || !is_bf16(out) || !lse.dtype().is(py::dtype::of<float>()))
    fail("q, pool and out must be bfloat16 (as int16), lse float32");
  if (q.ndim() != 4 || out.ndim() != 4 || pool.ndim() != 2 || lse.ndim() != 1)
    fail("q and out must be [tokens, kv_heads, group, d], pool 2-D, lse 1-D");
  if (!(q.flags() & c) || !(pool.flags() & c) || !(out.flags() & c) || !(lse.flags() & c) ||
      !out.writeable() || !lse.writeable())
    fail("arrays must be C-contiguous (out and lse writeable)");
  for (int i = 0; i < 4; ++i)
    if (out.shape(i) != q.shape(i)) fail("out must have q's shape");
  const int64_t tokens = q.shape(0), heads = q.shape(1), group = q.shape(2), d = q.shape(3);
  const int64_t row_len = pool.shape(1);
  if (lse.shape(0) != tokens * heads * group) fail("lse must be [tokens * kv_heads * group]");
  if (d % 32 != 0) fail("head_dim must be a multiple of 32");
  if (page_size <= 0 || row_len != page_size * heads * d)
    fail("pool rows must hold page_size * kv_heads * d");
  for (const auto* arr : {&q_begin, &q_len, &k_rows, &page_indptr, &kv_len})
    if (arr->ndim() != 1 || !(arr->flags() & c)) fail("the plan's arrays must be 1-D int64");
  const int64_t count = q_begin.shape(0);
  if (count < 1 || q_len.shape(0) != count || kv_len.shape(0) != count ||
      page_indptr.shape(0) != count + 1)
    fail("q_begin, q_len, kv_len [chunks] and page_indptr [chunks + 1]");
  const int64_t *qb = q_begin.data(), *ql = q_len.data(), *pi = page_indptr.data();
  const int64_t *kl = kv_len.data(), *rows = k_rows.data();
  if (pi[0] != 0 || pi[count] != k_rows.shape(0)) fail("page_indptr must span k_rows");
  const int32_t* lim = nullptr;
  py::array_t<int32_t, py::array::c_style> limits_arr;
  if (!limits.is_none()) {
    limits_arr = limits.cast<py::array_t<int32_t, py::array::c_style>>();
    if (limits_arr.ndim() != 1 || limits_arr.shape(0) != tokens * group)
      fail("limits must be int32 [tokens * group]");
    lim = limits_arr.data();
  }
  std::vector<radixserve::PrefixChunk> chunks(static_cast<size_t>(count));
  const auto* qp = static_cast<const uint16_t*>(q.data());
  auto* op = static_cast<uint16_t*>(out.mutable_data());
  auto* lp = static_cast<float*>(lse.mutable_data());
  for (int64_t i = 0; i < count; ++i) {
    if (ql[i] < 1 || qb[i] < (i ? qb[i - 1] + ql[i - 1] : 0) || qb[i] + ql[i] > tokens)
      fail("chunks must be ascending, disjoint runs of q's tokens");
    const int64_t pages = pi[i + 1] - pi[i];
    if (pages < 0 || kl[i] <= 0 || kl[i] > pages * page_size)
      fail("kv_len must be in (0, pages * page_size]");
    for (int64_t p = pi[i]; p < pi[i] + (kl[i] + page_size - 1) / page_size; ++p)
      if (rows[p] < 0 || rows[p] + 1 >= pool.shape(0))
        fail("a K row (or its V row) is out of range");
    const int64_t n = ql[i] * group;
    const int32_t* cl = lim ? lim + qb[i] * group : nullptr;
    if (cl)
      for (int64_t j = 0; j < n; ++j)
        if (cl[j] < 1 || cl[j] > kl[i]) fail("every limit must be in [1, kv_len]");
    const int64_t at = qb[i] * heads * group * d;
    chunks[static_cast<size_t>(i)] = {qp + at, rows + pi[i], cl, n, kl[i], op + at,
                                      lp + qb[i] * heads * group};
  }
  const auto* pp = static_cast<const uint16_t*>(pool.data());
  py::gil_scoped_release nogil;
  if (!amx && isa < Isa::kAvx512Bf16) return false;
  return radixserve::prefix_attention_chunks(chunks.data(), count, pp, group, d, heads,
                                             page_size, row_len, static_cast<float>(scale), amx,
                                             num_threads);
}

void silu_mul_rows_py(const py::array& gate_up, py::array& out, int num_threads,
                      const std::string& isa_name) {
  const Isa isa = parse_isa(isa_name, "silu_mul_rows");
  const auto c = py::array::c_style;
  const bool bf16 = is_bf16(gate_up);
  if (!bf16 && !gate_up.dtype().is(py::dtype::of<float>()))
    throw std::invalid_argument("silu_mul_rows: float32 or bfloat16 (as int16) arrays");
  if (gate_up.ndim() != 2 || out.ndim() != 2 || !(gate_up.flags() & c) || !(out.flags() & c) ||
      !out.writeable() || is_bf16(out) != bf16 ||
      out.dtype().itemsize() != gate_up.dtype().itemsize() ||
      gate_up.shape(1) != 2 * out.shape(1) || gate_up.shape(0) != out.shape(0))
    throw std::invalid_argument("silu_mul_rows: gate_up [rows, 2 * I] and a writeable out "
                                "[rows, I], C-contiguous, one dtype");
  const void* g = gate_up.data();
  py::gil_scoped_release nogil;
  radixserve::silu_mul_rows(g, out.mutable_data(), out.shape(0), out.shape(1), bf16, isa,
                            num_threads);
}

// x float32 [n, d] -> uint8 [n, d + 2]: each row quantized as the one-call decode
// layers write K/V rows into a quantized pool (quantize_kv_row).
// gptq (searched fp8 rows only): float32 [heads, d, d], row i GPTQ-rounded with factor
// i % heads (rows are (token, kv head) in that order).
py::array_t<uint8_t> quantize_kv_rows(const py::array_t<float, py::array::c_style>& x,
                                      const std::string& kv_quant, const std::string& isa_name,
                                      bool searched, int num_threads, const py::object& gptq) {
  const Isa isa = parse_isa(isa_name, "quantize_kv_rows");
  const radixserve::KVQuant quant = parse_quant(kv_quant);
  if (quant == radixserve::KVQuant::kNone || x.ndim() != 2)
    throw std::invalid_argument("quantize_kv_rows: x must be [rows, d] and kv_quant a format");
  const int64_t n = x.shape(0), d = x.shape(1);
  const float* factors = nullptr;
  int64_t heads = 1;
  py::array_t<float, py::array::c_style> held;
  if (!gptq.is_none()) {
    held = gptq.cast<py::array_t<float, py::array::c_style>>();
    if (!searched || quant == radixserve::KVQuant::kInt8 || held.ndim() != 3 ||
        held.shape(1) != d || held.shape(2) != d || held.shape(0) < 1 || n % held.shape(0))
      throw std::invalid_argument(
          "quantize_kv_rows: gptq must be float32 [heads, d, d] with rows a multiple of heads, "
          "for searched fp8 rows");
    factors = held.data();
    heads = held.shape(0);
  }
  py::array_t<uint8_t> out({n, d + 2});
  const float* src = x.data();
  uint8_t* dst = out.mutable_data();
  py::gil_scoped_release nogil;
  if (factors != nullptr) {
    radixserve::quantize_kv_rows_gptq(src, n, d, heads, quant, factors, dst, isa, num_threads);
    return out;
  }
  radixserve::split_items(n, num_threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      radixserve::quantize_kv_row(src + i * d, d, quant, dst + i * (d + 2), isa, searched);
  });
  return out;
}

// x float32 [n, d] -> each row rotated (hadamard_row: the rotation of a quantized
// pool's keys and queries, attention/rotation.py).
py::array_t<float> hadamard_rows(const py::array_t<float, py::array::c_style>& x) {
  if (x.ndim() != 2) throw std::invalid_argument("hadamard_rows: x must be [rows, d]");
  const int64_t n = x.shape(0), d = x.shape(1);
  py::array_t<float> out({n, d});
  std::memcpy(out.mutable_data(), x.data(), sizeof(float) * static_cast<size_t>(n * d));
  for (int64_t i = 0; i < n; ++i) radixserve::hadamard_row(out.mutable_data() + i * d, d);
  return out;
}

// Every decoder layer of a decode step in one call (decode_layers.cpp). Built once
// per model and KV pool: the weights' and pool layers' arrays are checked here and
// held (their pointers stay valid while this object lives); run() checks the
// step's arrays and every index of its plan before any is read.
class DecodeLayersPy {
 public:
  DecodeLayersPy(const py::list& ln1, const py::list& qkv, const py::list& o, const py::list& ln2,
                 const py::list& gate_up, const py::list& down, const py::list& kv,
                 int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                 bool unit_offset, const std::string& kv_quant, bool rotated,
                 const py::object& key_shift, const py::object& key_gptq) {
    p_.quant = parse_quant(kv_quant);
    const bool quantized = p_.quant != radixserve::KVQuant::kNone;
    check(!rotated || quantized, "rotated keys are a quantized pool's");
    p_.rotated = rotated;  // KVPool.rotated: keys (and queries) rotated, fp8 keys searched
    const size_t n = py::len(ln1);
    for (const py::list* l : std::initializer_list<const py::list*>{&qkv, &o, &ln2, &gate_up, &down, &kv})
      check(py::len(*l) == n, "one array per layer in every list");
    check(n > 0, "at least one layer");
    check(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0,
          "heads must be a positive multiple of kv_heads");
    check(eps > 0, "eps must be > 0");
    const py::array first = qkv[0].cast<py::array>();
    p_.bf16 = is_bf16(first);
    check(p_.bf16 || first.dtype().is(py::dtype::of<float>()),
          "arrays must be float32 or bfloat16 (as int16)");
    p_.layers = static_cast<int64_t>(n);
    p_.heads = heads;
    p_.kv_heads = kv_heads;
    p_.head_dim = head_dim;
    p_.eps = static_cast<float>(eps);
    p_.unit_offset = unit_offset;
    p_.hidden = ln1[0].cast<py::array>().shape(0);
    p_.intermediate = down[0].cast<py::array>().ndim() == 2 ? down[0].cast<py::array>().shape(1) : 0;
    const py::array kv0 = kv[0].cast<py::array>();
    check(kv0.ndim() == 5, "pool layers must be [pages, 2, page_size, kv_heads, head_dim]");
    check(!quantized || kv0.dtype().itemsize() == 1, "a quantized pool holds one-byte codes");
    num_pages_ = kv0.shape(0);
    p_.page_size = kv0.shape(2);
    const int64_t hd = p_.hidden, qd = heads * head_dim, kvd = kv_heads * head_dim;
    auto take = [&](const py::list& l, size_t i, std::initializer_list<int64_t> shape,
                    bool writeable) -> py::array {
      py::array a = l[i].cast<py::array>();
      if (quantized && writeable) {  // a pool layer of codes
        check(a.dtype().itemsize() == 1, "a quantized pool holds one-byte codes");
      } else {
        check(is_bf16(a) == p_.bf16 && (p_.bf16 || a.dtype().is(py::dtype::of<float>())),
              "arrays must share one dtype");
      }
      check((a.flags() & py::array::c_style) && (!writeable || a.writeable()),
            "arrays must be C-contiguous (pool layers writeable)");
      check(a.ndim() == static_cast<py::ssize_t>(shape.size()), "an array has the wrong rank");
      int d = 0;
      for (int64_t e : shape) check(a.shape(d++) == e, "an array has the wrong shape");
      held_.push_back(a);
      return a;
    };
    weights_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      radixserve::DecodeLayerWeights& w = weights_[i];
      w.ln1 = take(ln1, i, {hd}, false).data();
      w.qkv = take(qkv, i, {qd + 2 * kvd, hd}, false).data();
      w.o = take(o, i, {hd, qd}, false).data();
      w.ln2 = take(ln2, i, {hd}, false).data();
      w.gate_up = take(gate_up, i, {2 * p_.intermediate, hd}, false).data();
      w.down = take(down, i, {hd, p_.intermediate}, false).data();
      w.kv = take(kv, i, {num_pages_, 2, p_.page_size, kv_heads, head_dim + (quantized ? 2 : 0)},
                  true)
                 .mutable_data();
    }
    p_.weights = weights_.data();
    // KVPool.key_shift: float32 [layers, kv_heads, head_dim], a rotated pool's only.
    p_.key_shift = nullptr;
    if (!key_shift.is_none()) {
      check(rotated, "a key shift is a rotated pool's");
      const py::array m = key_shift.cast<py::array>();
      check(m.dtype().is(py::dtype::of<float>()) && (m.flags() & py::array::c_style) &&
                m.ndim() == 3 && m.shape(0) == static_cast<py::ssize_t>(n) &&
                m.shape(1) == kv_heads && m.shape(2) == head_dim,
            "key_shift must be float32 [layers, kv_heads, head_dim], C-contiguous");
      held_.push_back(m);
      p_.key_shift = static_cast<const float*>(m.data());
    }
    // KVPool.key_gptq: float32 [layers, kv_heads, head_dim, head_dim], fp8 pools only.
    p_.key_gptq = nullptr;
    if (!key_gptq.is_none()) {
      check(rotated && p_.quant != radixserve::KVQuant::kInt8, "GPTQ keys are a rotated fp8 pool's");
      const py::array u = key_gptq.cast<py::array>();
      check(u.dtype().is(py::dtype::of<float>()) && (u.flags() & py::array::c_style) &&
                u.ndim() == 4 && u.shape(0) == static_cast<py::ssize_t>(n) &&
                u.shape(1) == kv_heads && u.shape(2) == head_dim && u.shape(3) == head_dim,
            "key_gptq must be float32 [layers, kv_heads, head_dim, head_dim], C-contiguous");
      held_.push_back(u);
      p_.key_gptq = static_cast<const float*>(u.data());
    }
  }

  // residual (the embeddings) and x (layer 0's input norm of them): [tokens, hidden];
  // cos, sin [tokens, rot_dim]; write_rows int64 [tokens]; the plan's segments as
  // paged_decode's (causal: one uint8 flag per segment, or None); h_out and
  // residual_out [hidden, tokens]. All C-contiguous.
  void run(const py::array& residual, const py::array& x, const py::array& cos,
           const py::array& sin, const py::array_t<int64_t, py::array::c_style>& write_rows,
           const I32Array& row_indptr, const I32Array& rows, const I32Array& page_indptr,
           const I32Array& pages, const I32Array& kv_begin, const I32Array& kv_end, double scale,
           int64_t chunk, py::array& h_out, py::array& residual_out, int num_threads,
           const std::string& isa_name, bool amx, const py::object& causal, int64_t fixed,
           bool invariant) {
    const Isa isa = parse_isa(isa_name, "DecodeLayers");
    radixserve::DecodeLayers p = p_;
    const int64_t t = x.ndim() == 2 ? x.shape(0) : 0, hd = p.hidden;
    check(t > 0, "x must be [tokens, hidden] with at least one token");
    const auto c = py::array::c_style;
    auto same = [&](const py::array& a) {
      return (a.flags() & c) && is_bf16(a) == p.bf16 &&
             (p.bf16 || a.dtype().is(py::dtype::of<float>()));
    };
    for (const py::array* a : std::initializer_list<const py::array*>{
             &residual, &x, &cos, &sin, &h_out, &residual_out})
      check(same(*a), "arrays must be C-contiguous, of the weights' dtype");
    check(residual.ndim() == 2 && residual.shape(0) == t && residual.shape(1) == hd &&
              x.shape(1) == hd,
          "residual and x must be [tokens, hidden]");
    check(h_out.ndim() == 2 && h_out.shape(0) == hd && h_out.shape(1) == t &&
              residual_out.ndim() == 2 && residual_out.shape(0) == hd &&
              residual_out.shape(1) == t && h_out.writeable() && residual_out.writeable(),
          "h_out and residual_out must be writeable [hidden, tokens]");
    check(cos.ndim() == 2 && sin.ndim() == 2 && cos.shape(0) == t && sin.shape(0) == t &&
              cos.shape(1) == sin.shape(1),
          "cos and sin must be [tokens, rot_dim]");
    p.rot_dim = cos.shape(1);
    check(p.rot_dim % 2 == 0 && p.rot_dim <= p.head_dim && p.rot_dim <= 512,
          "rot_dim must be even and at most min(head_dim, 512)");
    check(write_rows.ndim() == 1 && write_rows.shape(0) == t, "write_rows: one per token");
    const int64_t ps = p.page_size;
    for (int64_t i = 0; i < t; ++i) {
      const int64_t r = write_rows.data()[i];
      check(r >= 0 && r / (2 * ps) < num_pages_ && r % (2 * ps) < ps,
            "a write row is outside the pool's K rows");
    }
    check(chunk > 0 && num_threads > 0, "chunk and num_threads must be positive");
    p.attn = radixserve::PagedDecode{};
    p.attn.num_heads = p.heads;
    p.attn.num_kv_heads = p.kv_heads;
    p.attn.head_dim = p.head_dim;
    p.attn.page_size = ps;
    p.attn.group = p.heads / p.kv_heads;
    p.attn.scale = scale;
    p.attn.amx = amx && p.bf16;
    check(fixed >= 0, "fixed must be >= 0");
    p.attn.fixed = fixed;
    p.invariant = invariant;
    check_segments(p.attn, t, num_pages_, row_indptr, rows, page_indptr, pages, kv_begin,
                   kv_end);
    // A causal segment: a chunk's rows (a request's drafts) see the keys up to their own.
    py::array_t<uint8_t, py::array::c_style> causal_arr;
    check_causal(p.attn, causal, causal_arr);
    p.tokens = t;
    p.residual = residual.data();
    p.x = x.data();
    p.cos = cos.data();
    p.sin = sin.data();
    p.write_rows = write_rows.data();
    p.chunk = chunk;
    p.h_out = h_out.mutable_data();
    p.residual_out = residual_out.mutable_data();
    p.amx = amx && p.bf16;  // where the CPU has no tiles, the products fall back
    py::gil_scoped_release nogil;
    radixserve::decode_layers(p, isa, num_threads);
  }

 private:
  static void check(bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("DecodeLayers: " + what);
  }
  radixserve::DecodeLayers p_{};
  std::vector<radixserve::DecodeLayerWeights> weights_;
  std::vector<py::array> held_;
  int64_t num_pages_ = 0;
};

// Structured output's token mask: for each row r in `rows`, logits[r, t] = -inf
// where bit t % 32 of bitmask[r, t / 32] is 0 (xgrammar's layout). Whole words
// of ones are skipped and whole words of zeros filled, so a mask costs about
// one pass over the tokens it removes.
// RMSNorm of bfloat16 rows (given as int16/uint16): x, y [rows, n], w [n], C-contiguous.
void rms_norm(const py::array& x, const py::array& w, py::array& y, double eps, bool unit_offset,
              int num_threads, const std::string& isa_name) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("rms_norm: " + what); };
  const Isa isa = parse_isa(isa_name, "rms_norm");
  const auto c = py::array::c_style;
  if (!is_bf16(x) || !is_bf16(w) || !is_bf16(y)) fail("arrays must be bfloat16 (as int16)");
  if (x.ndim() != 2 || w.ndim() != 1 || y.ndim() != 2) fail("x and y must be 2-D, w 1-D");
  if (!(x.flags() & c) || !(w.flags() & c) || !(y.flags() & c) || !y.writeable())
    fail("arrays must be C-contiguous (y writeable)");
  if (y.shape(0) != x.shape(0) || y.shape(1) != x.shape(1) || w.shape(0) != x.shape(1))
    fail("shapes disagree");
  if (!(eps > 0)) fail("eps must be > 0");
  radixserve::rms_norm_bf16(static_cast<const uint16_t*>(x.data()),
                            static_cast<const uint16_t*>(w.data()),
                            static_cast<uint16_t*>(y.mutable_data()), x.shape(0), x.shape(1),
                            static_cast<float>(eps), unit_offset, isa, num_threads);
}

// out [rows] (int64) = argmax over dim 0 of x [vocab, rows] (float32, or bfloat16 as int16).
void argmax_columns(const py::array& x, py::array& out, const std::string& isa_name) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("argmax_columns: " + what);
  };
  const Isa isa = parse_isa(isa_name, "argmax_columns");
  const auto c = py::array::c_style;
  const bool bf16 = is_bf16(x);
  if (!bf16 && !py::isinstance<py::array_t<float>>(x)) fail("x must be float32 or bfloat16");
  if (x.ndim() != 2 || out.ndim() != 1) fail("x must be [vocab, rows], out [rows]");
  if (!(x.flags() & c) || !(out.flags() & c) || !out.writeable())
    fail("arrays must be C-contiguous (out writeable)");
  if (!py::isinstance<py::array_t<int64_t>>(out)) fail("out must be int64");
  if (out.shape(0) != x.shape(1)) fail("out must have one entry per column of x");
  if (x.shape(0) < 1) fail("x needs at least one row");
  if (x.shape(0) > INT32_MAX) fail("x has too many rows");
  radixserve::argmax_columns(x.data(), bf16, x.shape(0), x.shape(1),
                             static_cast<int64_t*>(out.mutable_data()), isa);
}

template <typename T>
void mask_rows(T* logits, int64_t vocab, const uint32_t* bitmask, int64_t words,
               const int64_t* rows, int64_t num_rows) {
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < num_rows; ++i) {
    T* row = logits + rows[i] * vocab;
    const uint32_t* bits = bitmask + rows[i] * words;
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t word = bits[w];
      if (word == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32;
      const int64_t n = std::min<int64_t>(32, vocab - base);
      if (n <= 0) break;
      if (word == 0) {
        std::fill(row + base, row + base + n, ninf);
        continue;
      }
      T* x = row + base;
      for (int64_t j = 0; j < n; ++j) x[j] = ((word >> j) & 1u) ? x[j] : ninf;
    }
  }
}

void apply_token_bitmask(py::array& logits, const py::array& bitmask, const py::array& rows) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("apply_token_bitmask: " + what);
  };
  const auto c = py::array::c_style;
  if (logits.ndim() != 2 || bitmask.ndim() != 2 || rows.ndim() != 1)
    fail("logits and bitmask must be 2-D, rows 1-D");
  if (!(logits.flags() & c) || !(bitmask.flags() & c) || !(rows.flags() & c))
    fail("arrays must be C-contiguous");
  if (!logits.writeable()) fail("logits must be writeable");
  if (!bitmask.dtype().is(py::dtype::of<int32_t>())) fail("bitmask must be int32");
  if (!rows.dtype().is(py::dtype::of<int64_t>())) fail("rows must be int64");
  const int64_t n = logits.shape(0), vocab = logits.shape(1);
  const int64_t words = bitmask.shape(1);
  if (bitmask.shape(0) < n) fail("bitmask needs a row per logits row");
  if (words * 32 < vocab) fail("bitmask rows are shorter than the vocabulary");
  const int64_t k = rows.shape(0);
  const auto* r = static_cast<const int64_t*>(rows.data());
  for (int64_t i = 0; i < k; ++i)
    if (r[i] < 0 || r[i] >= n) fail("a row index is out of range");
  const auto* bits = static_cast<const uint32_t*>(bitmask.data());
  if (logits.dtype().is(py::dtype::of<float>())) {
    auto* l = static_cast<float*>(logits.mutable_data());
    py::gil_scoped_release nogil;
    mask_rows(l, vocab, bits, words, r, k);
  } else if (logits.dtype().is(py::dtype::of<double>())) {
    auto* l = static_cast<double*>(logits.mutable_data());
    py::gil_scoped_release nogil;
    mask_rows(l, vocab, bits, words, r, k);
  } else {
    fail("logits must be float32 or float64");
  }
}

// The state pool's entries a recurrent step updates in place: each [entries, heads, d1,
// d2] entry C-contiguous (entries any whole number of elements apart), count distinct
// int64 entries in range. Returns them.
template <typename Fail>
const int64_t* pool_entries(const py::array& state, const py::array& entries, int64_t count,
                            Fail fail) {
  const int64_t item = state.dtype().itemsize();
  if (state.strides(3) != item || state.strides(2) != state.shape(3) * item ||
      state.strides(1) != state.shape(2) * state.shape(3) * item || state.strides(0) % item ||
      state.strides(0) < 0)
    fail("each entry of state must be C-contiguous");
  const int64_t n = state.shape(0);
  const auto* e = static_cast<const int64_t*>(entries.data());
  std::vector<char> seen(static_cast<size_t>(n), 0);
  for (int64_t i = 0; i < count; ++i) {
    if (e[i] < 0 || e[i] >= n) fail("an entry is out of range");
    if (seen[e[i]]++) fail("entries must be distinct");
  }
  return e;
}

// The gated delta rule's decode step on the state pool in place (csrc/gated_delta.cpp).
void gated_delta_step(const py::array& q, const py::array& k, const py::array& v,
                      const py::array& g, const py::array& beta, py::array& state,
                      const py::array& entries, py::array& out, int num_threads,
                      const std::string& isa_name) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("gated_delta_step: " + what);
  };
  const Isa isa = parse_isa(isa_name, "gated_delta_step");
  const auto c = py::array::c_style;
  const bool f64 = q.dtype().is(py::dtype::of<double>());
  if (!f64 && !q.dtype().is(py::dtype::of<float>())) fail("arrays must be float32 or float64");
  for (const py::array* a :
       std::initializer_list<const py::array*>{&k, &v, &g, &beta, &state, &out})
    if (!a->dtype().is(q.dtype())) fail("arrays must have one dtype");
  if (q.ndim() != 3 || k.ndim() != 3 || v.ndim() != 3 || out.ndim() != 3 || g.ndim() != 2 ||
      beta.ndim() != 2 || state.ndim() != 4 || entries.ndim() != 1)
    fail("q, k, v, out must be 3-D, g and beta 2-D, state 4-D, entries 1-D");
  for (const py::array* a :
       std::initializer_list<const py::array*>{&q, &k, &v, &g, &beta, &entries, &out})
    if (!(a->flags() & c)) fail("q, k, v, g, beta, entries and out must be C-contiguous");
  if (!out.writeable() || !state.writeable()) fail("state and out must be writeable");
  if (!entries.dtype().is(py::dtype::of<int64_t>())) fail("entries must be int64");
  const int64_t b = q.shape(0), h = q.shape(1), dk = q.shape(2), dv = v.shape(2);
  if (k.shape(0) != b || k.shape(1) != h || k.shape(2) != dk || v.shape(0) != b ||
      v.shape(1) != h || out.shape(0) != b || out.shape(1) != h || out.shape(2) != dv ||
      g.shape(0) != b || g.shape(1) != h || beta.shape(0) != b || beta.shape(1) != h ||
      entries.shape(0) != b || state.shape(1) != h || state.shape(2) != dk ||
      state.shape(3) != dv)
    fail("shapes disagree");
  if (dv > 512) fail("value_dim must be at most 512");
  const int64_t item = q.dtype().itemsize();
  const int64_t* e = pool_entries(state, entries, b, fail);
  radixserve::GatedDeltaStep p{};
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.g = g.data();
  p.beta = beta.data();
  p.state = state.mutable_data();
  p.out = out.mutable_data();
  p.entries = e;
  p.batch = b;
  p.heads = h;
  p.key_dim = dk;
  p.value_dim = dv;
  p.entry_stride = state.strides(0) / item;
  py::gil_scoped_release nogil;
  radixserve::gated_delta_step(p, f64, isa, num_threads);
}

// Mamba-2's decode step on the state pool in place (csrc/mamba2_step.cpp).
void mamba2_step(const py::array& x, const py::array& dt, const py::array& A,
                 const py::array& B, const py::array& C, py::array& state,
                 const py::array& entries, py::array& out, int num_threads,
                 const std::string& isa_name) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("mamba2_step: " + what); };
  const Isa isa = parse_isa(isa_name, "mamba2_step");
  const auto c = py::array::c_style;
  const bool f64 = x.dtype().is(py::dtype::of<double>());
  if (!f64 && !x.dtype().is(py::dtype::of<float>())) fail("arrays must be float32 or float64");
  for (const py::array* a : std::initializer_list<const py::array*>{&dt, &A, &B, &C, &state, &out})
    if (!a->dtype().is(x.dtype())) fail("arrays must have one dtype");
  if (x.ndim() != 3 || out.ndim() != 3 || dt.ndim() != 2 || A.ndim() != 1 || B.ndim() != 3 ||
      C.ndim() != 3 || state.ndim() != 4 || entries.ndim() != 1)
    fail("x, out, B, C must be 3-D, dt 2-D, A and entries 1-D, state 4-D");
  for (const py::array* a :
       std::initializer_list<const py::array*>{&x, &dt, &A, &B, &C, &entries, &out})
    if (!(a->flags() & c)) fail("x, dt, A, B, C, entries and out must be C-contiguous");
  if (!out.writeable() || !state.writeable()) fail("state and out must be writeable");
  if (!entries.dtype().is(py::dtype::of<int64_t>())) fail("entries must be int64");
  const int64_t r = x.shape(0), h = x.shape(1), p = x.shape(2);
  const int64_t g = B.shape(1), n = B.shape(2);
  if (out.shape(0) != r || out.shape(1) != h || out.shape(2) != p || dt.shape(0) != r ||
      dt.shape(1) != h || A.shape(0) != h || B.shape(0) != r || C.shape(0) != r ||
      C.shape(1) != g || C.shape(2) != n || entries.shape(0) != r || state.shape(1) != h ||
      state.shape(2) != p || state.shape(3) != n)
    fail("shapes disagree");
  if (g < 1 || h % g) fail("heads must be a multiple of groups");
  const int64_t item = x.dtype().itemsize();
  const int64_t* e = pool_entries(state, entries, r, fail);
  radixserve::Mamba2Step s{};
  s.x = x.data();
  s.dt = dt.data();
  s.A = A.data();
  s.B = B.data();
  s.C = C.data();
  s.state = state.mutable_data();
  s.out = out.mutable_data();
  s.entries = e;
  s.batch = r;
  s.heads = h;
  s.groups = g;
  s.head_dim = p;
  s.state_size = n;
  s.entry_stride = state.strides(0) / item;
  py::gil_scoped_release nogil;
  radixserve::mamba2_step(s, f64, isa, num_threads);
}

}  // namespace

PYBIND11_MODULE(_cpu_kernels, m) {
  m.doc() = "The worker's CPU kernels: paged decode attention, skinny products.";
  m.attr("KV_QUANT") = true;  // paged_decode reads quantized pools (kv_quant)
  m.def("silu_mul", &silu_mul_py, py::arg("gate_up"), py::arg("out"), py::arg("num_threads"),
        py::arg("isa") = "auto",
        "out [I, rows] = silu(gate) * up for gate_up [2 * I, rows] (float32, or bfloat16 as "
        "int16), as the one-call decode layers compute it.");
  m.def("prefix_attention", &prefix_attention_py, py::arg("q"), py::arg("pool"),
        py::arg("k_rows"), py::arg("kv_len"), py::arg("page_size"), py::arg("scale"),
        py::arg("out"), py::arg("lse"), py::arg("num_threads"), py::arg("limits") = py::none(),
        py::arg("isa") = "auto", py::arg("amx") = true,
        "out, lse [kv_heads, n] := attention of q over kv_len keys (pool rows k_rows, V the "
        "row after; bfloat16 as int16, lse float32); q and out [kv_heads, n, d] or [tokens, "
        "kv_heads, group, d] (query vector i = token * group + g); query vector i sees "
        "keys [0, limits[i]) (int32 [n]; None: all). On AMX tiles with amx, else with "
        "vdpbf16ps at isa avx512bf16; False where that form cannot run (no tiles; a lower "
        "isa).");
  m.def("prefix_attention_chunks", &prefix_attention_chunks_py, py::arg("q"), py::arg("pool"),
        py::arg("out"), py::arg("lse"), py::arg("q_begin"), py::arg("q_len"), py::arg("k_rows"),
        py::arg("page_indptr"), py::arg("kv_len"), py::arg("page_size"), py::arg("scale"),
        py::arg("num_threads"), py::arg("limits") = py::none(), py::arg("isa") = "auto",
        py::arg("amx") = true,
        "prefix_attention for every chunk of a step in one call: q and out [tokens, kv_heads, "
        "group, d]; chunk c is tokens [q_begin[c], q_begin[c] + q_len[c]) over kv_len[c] keys "
        "(pool rows k_rows[page_indptr[c]:page_indptr[c + 1]]); limits int32 [tokens * "
        "group] (None: all keys); lse float32 [tokens * kv_heads * group], chunk c's "
        "[kv_heads][q_len * group] block from q_begin[c] * kv_heads * group. Each row's "
        "bits as from its chunk alone. False where the form cannot run.");
  m.def("silu_mul_rows", &silu_mul_rows_py, py::arg("gate_up"), py::arg("out"),
        py::arg("num_threads"), py::arg("isa") = "auto",
        "out [rows, I] = silu(gate) * up for row-major gate_up [rows, 2 * I] (gate, then up, "
        "in each row; float32, or bfloat16 as int16), silu_mul's values.");
  m.def("quantize_kv_rows", &quantize_kv_rows, py::arg("x"), py::arg("kv_quant"),
        py::arg("isa") = "auto", py::arg("searched") = false, py::arg("num_threads") = 1,
        py::arg("gptq") = py::none(),
        "float32 [rows, d] -> uint8 [rows, d + 2]: codes and float16 scale per row, as the "
        "one-call decode layers write a quantized pool (radixserve/worker/kv_quant.py); "
        "searched: fp8 rows take the scale of least squared error (a rotated pool's keys); "
        "gptq: float32 [heads, d, d] factors, row i's codes GPTQ-rounded with i % heads'.");
  m.def("hadamard_rows", &hadamard_rows, py::arg("x"),
        "float32 [rows, d] -> each row times the normalized Hadamard matrix "
        "(radixserve/worker/attention/rotation.py), in float32.");
  m.def("paged_decode", &paged_decode, py::arg("q"), py::arg("kv"), py::arg("out"), py::arg("lse"),
        py::arg("row_indptr"), py::arg("rows"), py::arg("page_indptr"), py::arg("pages"),
        py::arg("kv_begin"), py::arg("kv_end"), py::arg("scale"), py::arg("num_threads"),
        py::arg("chunk"), py::arg("isa") = "auto", py::arg("softcap") = 0.0,
        py::arg("causal") = py::none(), py::arg("kv_quant") = "none", py::arg("fixed") = 0,
        py::arg("amx") = false,
        "Paged decode attention over one layer of the KV pool (csrc/paged_attention.cpp); "
        "kv_quant (int8, fp8_e4m3, fp8_e5m2): the pool holds one-byte codes and a float16 "
        "scale per token and kv head, [pages, 2, ps, kvh, d + 2] bytes; "
        "softcap > 0 caps the scores at softcap * tanh(score / softcap); causal (uint8, "
        "one per segment): row r of n in a flagged segment sees its keys up to "
        "kv_end - (n - 1 - r) (a prefill chunk's rows, bottom-right aligned); fixed > 0: "
        "batch-invariant items of exactly that many keys (the chunk is ignored); amx: "
        "bfloat16 items read by many query vectors multiply on AMX tiles where the CPU "
        "has them.");
  m.def("skinny_gemm", &skinny_gemm, py::arg("w"), py::arg("x"), py::arg("yT"),
        py::arg("num_threads"), py::arg("isa") = "auto", py::arg("amx") = false,
        py::arg("invariant") = false, py::arg("form") = "auto",
        "yT [N, M] = w [N, K] . x^T for x [M, K] (any strides), w and yT C-contiguous; "
        "float32, or bfloat16 weights (as int16) with float32 or bfloat16 x and yT. "
        "invariant: a row's result does not depend on M (batch-invariant mode). "
        "form: at avx512bf16 with bfloat16 weights, outer, dot or dot16 instead of "
        "the one auto picks by M (tests and benchmarks).");
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("w"), py::arg("y"), py::arg("eps"),
        py::arg("unit_offset"), py::arg("num_threads"), py::arg("isa") = "auto",
        "y = RMSNorm(x) * w (or * (1 + w) with unit_offset) for bfloat16 rows [rows, n] "
        "(as int16), with the torch form's roundings (csrc/rms_norm.cpp).");
  m.def("gated_delta_step", &gated_delta_step, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("g"), py::arg("beta"), py::arg("state"), py::arg("entries"), py::arg("out"),
        py::arg("num_threads"), py::arg("isa") = "auto",
        "The gated delta rule's decode step (csrc/gated_delta.cpp): for each request b and "
        "head h, S = state[entries[b], h] <- exp(g) S + k (beta (v - k^T exp(g) S))^T in "
        "place and out[b, h] = q^T S; float32 or float64.");
  m.def("mamba2_step", &mamba2_step, py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"),
        py::arg("C"), py::arg("state"), py::arg("entries"), py::arg("out"),
        py::arg("num_threads"), py::arg("isa") = "auto",
        "Mamba-2's decode step (csrc/mamba2_step.cpp): for each request r and head h, S = "
        "state[entries[r], h] <- exp(dt A) S + (dt x) B^T in place and out[r, h] = S C "
        "(B, C of the head's group); float32 or float64.");
  m.def("argmax_columns", &argmax_columns, py::arg("x"), py::arg("out"), py::arg("isa") = "auto",
        "out [rows] (int64) = the first index of each column's maximum of x [vocab, rows] "
        "(float32, or bfloat16 as int16; C-contiguous), NaN counting as largest (torch.argmax).");
  m.def("apply_token_bitmask", &apply_token_bitmask, py::arg("logits"), py::arg("bitmask"),
        py::arg("rows"),
        "logits [n, vocab] (float32/float64) in place: -inf where a row's int32 bitmask has a "
        "0 bit, for the rows listed (int64).");
  py::class_<DecodeLayersPy>(m, "DecodeLayers",
                             "Every decoder layer of a decode step in one call "
                             "(csrc/decode_layers.cpp).")
      .def(py::init<const py::list&, const py::list&, const py::list&, const py::list&,
                    const py::list&, const py::list&, const py::list&, int64_t, int64_t,
                    int64_t, double, bool, const std::string&, bool, const py::object&,
                    const py::object&>(),
           py::arg("ln1"), py::arg("qkv"), py::arg("o"), py::arg("ln2"), py::arg("gate_up"),
           py::arg("down"), py::arg("kv"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("unit_offset"),
           py::arg("kv_quant") = "none", py::arg("rotated") = false,
           py::arg("key_shift") = py::none(), py::arg("key_gptq") = py::none())
      .def("run", &DecodeLayersPy::run, py::arg("residual"), py::arg("x"), py::arg("cos"),
           py::arg("sin"), py::arg("write_rows"), py::arg("row_indptr"), py::arg("rows"),
           py::arg("page_indptr"), py::arg("pages"), py::arg("kv_begin"), py::arg("kv_end"),
           py::arg("scale"), py::arg("chunk"), py::arg("h_out"), py::arg("residual_out"),
           py::arg("num_threads"), py::arg("isa") = "auto", py::arg("amx") = false,
           py::arg("causal") = py::none(), py::arg("fixed") = 0, py::arg("invariant") = false);
  radixserve::bind_step_kernels(m);
  m.def("best_isa", [] { return std::string(radixserve::isa_name(radixserve::best_isa())); },
        "The best instruction-set level this CPU runs (baseline, avx2, avx512, avx512bf16).");
  m.def("supported_isas", &supported_isas, "Every level this CPU runs, lowest first.");
#ifdef _OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
}
