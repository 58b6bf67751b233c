// Python bindings of the small kernels a decode step calls per layer: the merge of
// two partial attention results (lse_merge.cpp). Arrays arrive as NumPy views of
// torch tensors (bfloat16 as int16); shapes, dtypes, strides and every index are
// checked here, before any pointer is read.
#include "step_bindings.h"

#include <pybind11/numpy.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cpu_kernels.h"

namespace py = pybind11;

namespace {

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

}  // namespace

void radixserve::bind_step_kernels(py::module_& m) {
  m.def("merge_attention", &merge_attention_py, py::arg("out"), py::arg("lse"), py::arg("part"),
        py::arg("part_lse"), py::arg("index"),
        "In place: row index[h, l] of out [rows, dim] and lse [rows] := the log-sum-exp "
        "merge of itself and vector part[h, l] with part_lse[h, l] (csrc/lse_merge.cpp).");
}
