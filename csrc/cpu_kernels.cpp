// Python bindings of the worker's CPU kernels (module radixserve.layers._cpu_kernels).
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

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("paged_decode: " + what);
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
                  int num_threads, int64_t chunk) {
  require(q.ndim() == 3 && kv.ndim() == 5 && out.ndim() == 3, "q/out must be 3-D, kv 5-D");
  const auto c = py::array::c_style;
  require((q.flags() & c) && (kv.flags() & c) && (out.flags() & c), "arrays must be C-contiguous");
  require(out.writeable(), "out must be writeable");
  require(q.dtype().is(kv.dtype()) && q.dtype().is(out.dtype()), "q, kv, out dtypes differ");
  radixserve::PagedDecode P{};
  P.num_heads = q.shape(1);
  P.head_dim = q.shape(2);
  P.page_size = kv.shape(2);
  P.num_kv_heads = kv.shape(3);
  require(kv.shape(1) == 2 && kv.shape(4) == P.head_dim, "kv must be [pages, 2, ps, kvh, d]");
  require(P.num_kv_heads > 0 && P.num_heads % P.num_kv_heads == 0,
          "heads not a multiple of kv heads");
  require(out.shape(0) == q.shape(0) && out.shape(1) == P.num_heads && out.shape(2) == P.head_dim,
          "out must have q's shape");
  P.group = P.num_heads / P.num_kv_heads;
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
  P.scale = scale;
  const int64_t R = q.shape(0), NP = kv.shape(0), ps = P.page_size;
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
  for (int64_t i = 0; i < pages.shape(0); ++i)
    require(0 <= P.pages[i] && P.pages[i] < NP, "page out of range");
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
  radixserve::paged_decode(P, type, qp, kvp, outp, lse_f, lse_d, num_threads, chunk);
}

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
  m.def("paged_decode", &paged_decode, py::arg("q"), py::arg("kv"), py::arg("out"), py::arg("lse"),
        py::arg("row_indptr"), py::arg("rows"), py::arg("page_indptr"), py::arg("pages"),
        py::arg("kv_begin"), py::arg("kv_end"), py::arg("scale"), py::arg("num_threads"),
        py::arg("chunk"),
        "Paged decode attention over one layer of the KV pool (csrc/paged_attention.cpp).");
  m.def("skinny_gemm", &skinny_gemm, py::arg("w"), py::arg("x"), py::arg("yT"),
        py::arg("num_threads"),
        "yT [N, M] = w [N, K] . x^T for x [M, K] (any strides); float32, w and yT C-contiguous.");
#ifdef _OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
}
