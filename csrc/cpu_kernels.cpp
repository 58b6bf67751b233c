// Python bindings of the worker's CPU kernels (module radixserve.worker._cpu_kernels).
//
// Arrays arrive as NumPy views of torch tensors (torch is imported first, so
// OpenMP regions run in torch's own runtime); shapes, dtypes and contiguity are
// checked here, before any pointer is read.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "cpu_kernels.h"

namespace py = pybind11;

namespace {

void skinny_gemm(const py::array& w, const py::array& x, py::array& yT, int num_threads) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("skinny_gemm: " + what); };
  const auto c = py::array::c_style;
  if (w.ndim() != 2 || x.ndim() != 2 || yT.ndim() != 2) fail("w, x and yT must be 2-D");
  for (const py::array* a : {&w, &x, static_cast<const py::array*>(&yT)}) {
    if (!a->dtype().is(py::dtype::of<float>())) fail("arrays must be float32");
  }
  if (!(w.flags() & c) || !(yT.flags() & c)) fail("w and yT must be C-contiguous");
  if (x.strides(0) % 4 || x.strides(1) % 4) fail("x's strides must be whole elements");
  if (!yT.writeable()) fail("yT must be writeable");
  const int64_t N = w.shape(0), K = w.shape(1), M = x.shape(0);
  if (x.shape(1) != K) fail("x must be [M, K] with w's K");
  if (yT.shape(0) != N || yT.shape(1) != M) fail("yT must be [N, M]");
  if (num_threads < 1) fail("num_threads must be positive");
  const float* wp = static_cast<const float*>(w.data());
  const float* xp = static_cast<const float*>(x.data());
  float* yp = static_cast<float*>(yT.mutable_data());
  py::gil_scoped_release nogil;
  const int64_t sm = x.strides(0) / 4, sk = x.strides(1) / 4;
  radixserve::skinny_gemm_f32(wp, xp, sm, sk, yp, N, K, M, num_threads);
}

}  // namespace

PYBIND11_MODULE(_cpu_kernels, m) {
  m.doc() = "The worker's CPU kernels: paged decode attention, skinny float32 products.";
  radixserve::register_paged_attention(m);
  m.def("skinny_gemm", &skinny_gemm, py::arg("w"), py::arg("x"), py::arg("yT"),
        py::arg("num_threads"),
        "yT [N, M] = w [N, K] . x^T for x [M, K] (any strides); float32, w and yT C-contiguous.");
#ifdef _OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
}
