// Python bindings of the small kernels a decode step calls per layer: the merge of
// two partial attention results (lse_merge.cpp), the residual add fused with RMSNorm
// (add_rms_norm.cpp) and rotary embedding from the q/k/v product (rotary.cpp). Arrays arrive as NumPy views of
// torch tensors (bfloat16 as int16); shapes, dtypes, strides and every index are
// checked here, before any pointer is read.
#include "step_bindings.h"

#include <pybind11/numpy.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "cpu_kernels.h"

namespace py = pybind11;

namespace {

using radixserve::Isa;
using radixserve::KVType;

KVType value_type(const py::array& a, const char* where) {
  const char kind = a.dtype().kind();
  const auto size = a.dtype().itemsize();
  if (kind == 'f' && size == 4) return KVType::kFloat32;
  if (kind == 'f' && size == 8) return KVType::kFloat64;
  if ((kind == 'i' || kind == 'u') && size == 2) return KVType::kBFloat16;
  throw std::invalid_argument(std::string(where) +
                              ": arrays must be float32, float64 or bfloat16 (as int16)");
}

using radixserve::parse_isa;

// float32 or bfloat16 (as int16) for the norm and rotary kernels: true for bfloat16.
bool bf16_or_f32(const py::array& a, const std::string& where) {
  const KVType t = value_type(a, where.c_str());
  if (t == KVType::kFloat64) throw std::invalid_argument(where + ": float64 is not taken");
  return t == KVType::kBFloat16;
}

// Element strides of a 2-D array (bytes must be whole elements, non-negative).
void strides2(const py::array& a, int64_t* row, int64_t* col, const std::string& where) {
  const int64_t item = a.dtype().itemsize();
  if (a.strides(0) % item || a.strides(1) % item || a.strides(0) < 0 || a.strides(1) < 0)
    throw std::invalid_argument(where + ": strides must be whole, non-negative elements");
  *row = a.strides(0) / item;
  *col = a.strides(1) / item;
}


// out [rows, dim], lse [rows] (C-contiguous, writeable); part [heads, len, dim] (features
// contiguous), part_lse [heads, len], index int64 [heads, len] (C-contiguous).
void merge_attention_py(py::array& out, py::array& lse, const py::array& part,
                     const py::array& part_lse, const py::array& index) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("merge_attention: " + what);
  };
  const auto c = py::array::c_style;
  radixserve::MergeAttention m{};
  m.type = value_type(out, "merge_attention");
  if (value_type(part, "merge_attention") != m.type) fail("out and part dtypes differ");
  const bool f64 = m.type == KVType::kFloat64;
  auto is_lse = [&](const py::array& a) {
    return a.dtype().is(f64 ? py::dtype::of<double>() : py::dtype::of<float>());
  };
  if (!is_lse(lse) || !is_lse(part_lse))
    fail("lse arrays must be float64 for float64 values, float32 otherwise");
  if (out.ndim() != 2 || lse.ndim() != 1 || part.ndim() != 3 || part_lse.ndim() != 2 ||
      index.ndim() != 2)
    fail("out must be 2-D, lse 1-D, part 3-D, part_lse and index 2-D");
  if (!(out.flags() & c) || !(lse.flags() & c) || !(index.flags() & c) || !out.writeable() ||
      !lse.writeable())
    fail("out, lse and index must be C-contiguous (out and lse writeable)");
  if (!index.dtype().is(py::dtype::of<int64_t>())) fail("index must be int64");
  const int64_t rows = out.shape(0);
  m.dim = out.shape(1);
  m.heads = part.shape(0);
  m.len = part.shape(1);
  if (lse.shape(0) != rows) fail("lse needs one entry per row of out");
  if (part.shape(2) != m.dim) fail("part's vectors must have out's width");
  if (part_lse.shape(0) != m.heads || part_lse.shape(1) != m.len || index.shape(0) != m.heads ||
      index.shape(1) != m.len)
    fail("part_lse and index must be [heads, len] like part");
  const int64_t item = part.dtype().itemsize(), litem = part_lse.dtype().itemsize();
  if (m.dim > 1 && part.strides(2) != item) fail("part's features must be contiguous");
  if (part.strides(0) % item || part.strides(1) % item || part_lse.strides(0) % litem ||
      part_lse.strides(1) % litem || part.strides(0) < 0 || part.strides(1) < 0 ||
      part_lse.strides(0) < 0 || part_lse.strides(1) < 0)
    fail("strides must be whole, non-negative elements");
  m.stride_h = part.strides(0) / item;
  m.stride_l = part.strides(1) / item;
  m.lse_stride_h = part_lse.strides(0) / litem;
  m.lse_stride_l = part_lse.strides(1) / litem;
  m.index = static_cast<const int64_t*>(index.data());
  for (int64_t i = 0; i < m.heads * m.len; ++i)
    if (m.index[i] < 0 || m.index[i] >= rows) fail("an index is out of range");
  m.out = out.mutable_data();
  m.lse = lse.mutable_data();
  m.part = part.data();
  m.part_lse = part_lse.data();
  py::gil_scoped_release nogil;
  radixserve::merge_attention(m);
}

// s, y := x + a, RMSNorm(x + a) * w for x, a [rows, n] with any strides; s and y
// [n, rows] (feature-major) or [rows, n].
void add_rms_norm_py(const py::array& x, const py::array& a, const py::array& w, py::array& s,
                     py::array& y, double eps, bool unit_offset, bool feature_major,
                     int num_threads, const std::string& isa_name) {
  const std::string where = "add_rms_norm";
  auto fail = [&](const std::string& what) { throw std::invalid_argument(where + ": " + what); };
  const Isa isa = parse_isa(isa_name, "add_rms_norm");
  radixserve::AddRmsNorm p{};
  p.bf16 = bf16_or_f32(x, where);
  for (const py::array* o : std::initializer_list<const py::array*>{&a, &w, &s, &y})
    if (bf16_or_f32(*o, where) != p.bf16) fail("arrays must share one dtype");
  if (x.ndim() != 2 || a.ndim() != 2 || w.ndim() != 1 || s.ndim() != 2 || y.ndim() != 2)
    fail("x, a, s, y must be 2-D, w 1-D");
  p.rows = x.shape(0);
  p.n = x.shape(1);
  if (a.shape(0) != p.rows || a.shape(1) != p.n) fail("x and a must have one shape");
  p.feature_major = feature_major;
  for (const py::array* o : std::initializer_list<const py::array*>{&s, &y}) {
    if (feature_major ? o->shape(0) != p.n || o->shape(1) != p.rows
                      : o->shape(0) != p.rows || o->shape(1) != p.n)
      fail(feature_major ? "s and y must be [n, rows]" : "s and y must be [rows, n]");
  }
  if (w.shape(0) != p.n) fail("w must have one entry per feature");
  const auto c = py::array::c_style;
  if (!(w.flags() & c) || !(s.flags() & c) || !(y.flags() & c) || !s.writeable() ||
      !y.writeable())
    fail("w, s and y must be C-contiguous (s, y writeable)");
  if (!(eps > 0)) fail("eps must be > 0");
  if (num_threads < 1) fail("num_threads must be positive");
  strides2(x, &p.x_row, &p.x_col, where);
  strides2(a, &p.a_row, &p.a_col, where);
  p.unit_offset = unit_offset;
  p.eps = static_cast<float>(eps);
  p.x = x.data();
  p.a = a.data();
  p.w = w.data();
  p.s = s.mutable_data();
  p.y = y.mutable_data();
  py::gil_scoped_release nogil;
  radixserve::add_rms_norm(p, isa, num_threads);
}

// q [T, H, D], k, v [T, KVH, D] := rotary(q), rotary(k), v of qkv [T, (H + 2 KVH) D].
void rotary_qkv_py(const py::array& qkv, const py::array& cos, const py::array& sin,
                   py::array& q, py::array& k, py::array& v, int num_threads,
                   const std::string& isa_name) {
  const std::string where = "rotary_qkv";
  auto fail = [&](const std::string& what) { throw std::invalid_argument(where + ": " + what); };
  const Isa isa = parse_isa(isa_name, "rotary_qkv");
  radixserve::RotaryQkv p{};
  p.bf16 = bf16_or_f32(qkv, where);
  for (const py::array* o : std::initializer_list<const py::array*>{&cos, &sin, &q, &k, &v})
    if (bf16_or_f32(*o, where) != p.bf16) fail("arrays must share one dtype");
  if (qkv.ndim() != 2 || cos.ndim() != 2 || sin.ndim() != 2 || q.ndim() != 3 || k.ndim() != 3 ||
      v.ndim() != 3)
    fail("qkv, cos and sin must be 2-D, q, k and v 3-D");
  p.tokens = qkv.shape(0);
  p.heads = q.shape(1);
  p.kv_heads = k.shape(1);
  p.head_dim = q.shape(2);
  p.rot_dim = cos.shape(1);
  if (q.shape(0) != p.tokens || k.shape(0) != p.tokens || v.shape(0) != p.tokens ||
      v.shape(1) != p.kv_heads || k.shape(2) != p.head_dim || v.shape(2) != p.head_dim)
    fail("q, k and v must be [tokens, heads, head_dim] with one head_dim");
  if (qkv.shape(1) != (p.heads + 2 * p.kv_heads) * p.head_dim)
    fail("qkv must have (heads + 2 kv_heads) * head_dim features");
  if (cos.shape(0) != p.tokens || sin.shape(0) != p.tokens || sin.shape(1) != p.rot_dim)
    fail("cos and sin must be [tokens, rot_dim]");
  if (p.rot_dim % 2 || p.rot_dim > p.head_dim || p.rot_dim > 512)
    fail("rot_dim must be even and at most min(head_dim, 512)");
  const auto c = py::array::c_style;
  for (const py::array* o : std::initializer_list<const py::array*>{&cos, &sin, &q, &k, &v})
    if (!(o->flags() & c)) fail("cos, sin, q, k and v must be C-contiguous");
  if (!q.writeable() || !k.writeable() || !v.writeable()) fail("q, k and v must be writeable");
  if (num_threads < 1) fail("num_threads must be positive");
  strides2(qkv, &p.row_stride, &p.col_stride, where);
  p.qkv = qkv.data();
  p.cos = cos.data();
  p.sin = sin.data();
  p.q = q.mutable_data();
  p.k = k.mutable_data();
  p.v = v.mutable_data();
  py::gil_scoped_release nogil;
  radixserve::rotary_qkv(p, isa, num_threads);
}

}  // namespace

void radixserve::bind_step_kernels(py::module_& m) {
  m.def("merge_attention", &merge_attention_py, py::arg("out"), py::arg("lse"), py::arg("part"),
        py::arg("part_lse"), py::arg("index"),
        "In place: row index[h, l] of out [rows, dim] and lse [rows] := the log-sum-exp "
        "merge of itself and vector part[h, l] with part_lse[h, l] (csrc/lse_merge.cpp).");
  m.def("add_rms_norm", &add_rms_norm_py, py::arg("x"), py::arg("a"), py::arg("w"), py::arg("s"),
        py::arg("y"), py::arg("eps"), py::arg("unit_offset"), py::arg("feature_major"),
        py::arg("num_threads"),
        py::arg("isa") = "auto",
        "s = x + a and y = RMSNorm(s) * w (or * (1 + w)) for float32 or bfloat16 (as int16) "
        "rows, x and a [rows, n] with any strides, s and y [n, rows] with feature_major, "
        "else [rows, n], "
        "with the torch form's roundings "
        "(csrc/add_rms_norm.cpp).");
  m.def("rotary_qkv", &rotary_qkv_py, py::arg("qkv"), py::arg("cos"), py::arg("sin"),
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("num_threads"), py::arg("isa") = "auto",
        "q, k rotated (rotate-half, cos/sin [tokens, rot_dim]) and v copied from the fused "
        "product qkv [tokens, features] (any strides); float32 or bfloat16 (as int16) "
        "(csrc/rotary.cpp).");
}
