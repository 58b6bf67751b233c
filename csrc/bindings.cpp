// Python bindings of the native radix tree (module radixserve.scheduler._radix_native).
//
// Only conversion lives here: token and page arrays are read in place, never
// as per-token Python objects (an int32 C-contiguous 1-D ndarray or buffer is
// used without a copy; anything else goes through the reference's as_tokens
// first), results go out as the
// reference's own types (MatchResult, RadixCacheError), and the pages that
// evict/reset free are handed to the caller's PageAllocator in one free() call,
// so the allocator ends in exactly the state the Python tree would leave.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <vector>

#include "page_free.h"
#include "radix_tree.h"

namespace py = pybind11;
using radixserve::NodeRef;
using radixserve::RadixTree;

namespace {

// Objects of the Python reference, looked up when the first tree is made (not
// at import: the allocator imports this module, and radix_cache imports the
// allocator) and kept for the life of the process.
struct Glue {
  PyObject* as_tokens = nullptr;
  PyObject* ascontiguousarray = nullptr;
  PyObject* match_result = nullptr;
  PyObject* cache_error = nullptr;
};
Glue glue;

PyObject* attr(const py::module_& m, const char* name) {
  py::object o = m.attr(name);
  return o.release().ptr();
}

void load_glue() {
  if (glue.as_tokens != nullptr) return;
  const py::module_ ref = py::module_::import("radixserve.scheduler.radix_cache");
  glue.match_result = attr(ref, "MatchResult");
  glue.cache_error = attr(ref, "RadixCacheError");
  glue.ascontiguousarray = attr(py::module_::import("numpy"), "ascontiguousarray");
  glue.as_tokens = attr(ref, "as_tokens");  // last: it marks the glue as loaded
}

bool is_int32_format(const char* f) {
  if (f == nullptr) return false;
  if (*f == '@' || *f == '=' || *f == '<') ++f;  // native / little endian (x86, arm)
  if (f[0] == '\0' || f[1] != '\0') return false;
  return f[0] == 'i' || (f[0] == 'l' && sizeof(long) == 4);
}

// A read-only int32 view of a 1-D token or page sequence, released on scope exit.
class Int32Buffer {
 public:
  explicit Int32Buffer(py::handle obj) {
    if (view_ndarray(obj)) return;
    if (acquire(obj.ptr())) return;
    // Lists, other dtypes, strided views: convert like the reference does
    // (same errors for bad shapes), then view the contiguous copy.
    keep_ = py::reinterpret_steal<py::object>(PyObject_CallOneArg(glue.as_tokens, obj.ptr()));
    if (!keep_) throw py::error_already_set();
    keep_ = py::reinterpret_steal<py::object>(
        PyObject_CallOneArg(glue.ascontiguousarray, keep_.ptr()));
    if (!keep_) throw py::error_already_set();
    if (!acquire(keep_.ptr())) throw py::value_error("tokens must be a 1-D sequence of ints");
  }
  Int32Buffer(const Int32Buffer&) = delete;
  Int32Buffer& operator=(const Int32Buffer&) = delete;
  ~Int32Buffer() {
    if (held_) PyBuffer_Release(&view_);
  }
  const int32_t* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  // The common case, an int32 C-contiguous ndarray, read straight from the
  // array struct: numpy's buffer export would build a format string per call.
  bool view_ndarray(py::handle obj) {
    using Arr = py::array_t<int32_t, py::array::c_style>;
    if (!Arr::check_(obj)) return false;
    const auto* a = py::detail::array_proxy(obj.ptr());
    if (a->nd != 1) return false;
    data_ = reinterpret_cast<const int32_t*>(a->data);
    size_ = a->dimensions[0];
    return true;
  }
  bool acquire(PyObject* obj) {
    if (PyObject_GetBuffer(obj, &view_, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      PyErr_Clear();
      return false;
    }
    if (view_.ndim == 1 && view_.itemsize == 4 && is_int32_format(view_.format)) {
      held_ = true;
      data_ = static_cast<const int32_t*>(view_.buf);
      size_ = view_.shape[0];
      return true;
    }
    PyBuffer_Release(&view_);
    return false;
  }
  const int32_t* data_ = nullptr;
  int64_t size_ = 0;
  Py_buffer view_{};
  bool held_ = false;
  py::object keep_;
};

py::array_t<int32_t> to_array(const std::vector<int32_t>& v) {
  py::array_t<int32_t> out(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), sizeof(int32_t) * v.size());
  return out;
}

py::array_t<int64_t> to_array64(const std::vector<int64_t>& v) {
  py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), sizeof(int64_t) * v.size());
  return out;
}

class PyRadixTree {
 public:
  PyRadixTree(py::object allocator, int32_t page_size)
      : tree_(page_size), free_(allocator.attr("free")) {
    load_glue();
  }

  py::object match_prefix(py::handle tokens, py::handle salt) {
    Int32Buffer t(tokens);
    const int32_t root = root_for(salt, true);
    const RadixTree::Match m = tree_.match_prefix(t.data(), t.size(), root);
    py::array_t<int32_t> pages(static_cast<py::ssize_t>(m.hit_len / tree_.page_size()));
    tree_.copy_match_pages(pages.mutable_data());
    // MatchResult is a NamedTuple: build it the way tuple.__new__ does.
    py::tuple fields = py::make_tuple(m.hit_len, std::move(pages), m.last);
    py::tuple arg = py::make_tuple(std::move(fields));
    PyObject* r = PyTuple_Type.tp_new(reinterpret_cast<PyTypeObject*>(glue.match_result),
                                      arg.ptr(), nullptr);
    if (r == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(r);
  }

  int64_t peek_prefix(py::handle tokens, py::handle salt) {
    Int32Buffer t(tokens);
    const int32_t root = root_for(salt, false);
    return root == radixserve::kNoSlot ? 0 : tree_.peek_prefix(t.data(), t.size(), root);
  }

  py::array_t<int32_t> continuation(py::handle tokens, int64_t max_len, py::handle salt) {
    Int32Buffer t(tokens);
    const int32_t root = root_for(salt, false);
    tree_.continuation(t.data(), t.size(), root, max_len, scratch_);
    return to_array(scratch_);
  }

  py::tuple insert(py::handle tokens, py::handle pages, py::handle salt) {
    Int32Buffer t(tokens);
    Int32Buffer p(pages);
    const int64_t num_pages = t.size() / tree_.page_size();
    if (p.size() != num_pages)
      throw py::value_error("insert needs exactly len(tokens) // page_size = " +
                            std::to_string(num_pages) + " page ids, got " +
                            std::to_string(p.size()));
    const int32_t root = root_for(salt, true);
    const RadixTree::Match m = tree_.insert(t.data(), t.size(), p.data(), root);
    return py::make_tuple(m.hit_len, m.last);
  }

  void lock(const NodeRef& node) { tree_.lock(node); }
  void unlock(const NodeRef& node) { tree_.unlock(node); }

  int64_t evict(int64_t num_pages) {
    scratch_.clear();
    const int64_t freed = tree_.evict(num_pages, scratch_);
    if (!scratch_.empty()) free_(to_array(scratch_));
    return freed;
  }

  void reset() {
    scratch_.clear();
    tree_.reset(scratch_);
    if (!scratch_.empty()) free_(to_array(scratch_));
  }

  py::array_t<int32_t> all_pages() {
    scratch_.clear();
    tree_.all_pages(scratch_);
    return to_array(scratch_);
  }

  py::dict export_nodes(int64_t max_label, py::handle salt, bool every_namespace) const {
    RadixTree::Export e;
    std::string key;
    const std::string* only = nullptr;
    if (!every_namespace && !salt.is_none()) {
      if (!PyUnicode_Check(salt.ptr()))
        throw py::type_error(std::string("salt must be a string or None, got ") +
                             Py_TYPE(salt.ptr())->tp_name);
      key = salt.cast<std::string>();
      only = &key;
    }
    tree_.export_nodes(max_label, every_namespace, only, e);
    py::list salts;
    for (const auto& s : e.salts) {
      if (s.first)
        salts.append(py::str(s.second));
      else
        salts.append(py::none());
    }
    py::dict out;
    out["salts"] = salts;
    out["parent"] = to_array(e.parent);
    out["namespace"] = to_array(e.ns);
    out["lock_ref"] = to_array(e.lock_ref);
    out["labels"] = to_array(e.labels);
    out["node_id"] = to_array64(e.id);
    out["last_access"] = to_array64(e.last_access);
    out["num_tokens"] = to_array64(e.num_tokens);
    out["label_offsets"] = to_array64(e.label_offsets);
    return out;
  }

  py::object node_info(const NodeRef& node) const {
    auto info = tree_.info(node);
    if (!info.attached) return py::none();
    return py::make_tuple(node.id, info.lock_ref, info.last_access, info.num_tokens);
  }

  const RadixTree& tree() const { return tree_; }
  RadixTree& tree() { return tree_; }

 private:
  int32_t root_for(py::handle salt, bool create) {
    if (salt.is_none()) return tree_.root(nullptr, create);
    if (!PyUnicode_Check(salt.ptr()))
      throw py::type_error(std::string("salt must be a string or None, got ") +
                           Py_TYPE(salt.ptr())->tp_name);
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(salt.ptr(), &n);
    if (s == nullptr) throw py::error_already_set();
    const std::string key(s, static_cast<size_t>(n));
    return tree_.root(&key, create);
  }

  RadixTree tree_;
  py::object free_;                // allocator.free, bound once
  std::vector<int32_t> scratch_;   // evict/reset/all_pages output, reused
};

}  // namespace

PYBIND11_MODULE(_radix_native, m) {
  m.doc() = "Native (C++17) radix tree; use it through radixserve.scheduler.radix_native.";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const radixserve::MisuseError& e) {
      PyErr_SetString(glue.cache_error, e.what());
    } catch (const radixserve::InvariantError& e) {
      PyErr_SetString(PyExc_AssertionError, e.what());
    }
  });

  m.def(
      "free_pages",
      [](py::array_t<int32_t, py::array::c_style> stack,
         py::array_t<bool, py::array::c_style> allocated, int64_t top, py::handle ids) -> int64_t {
        using Ids = py::array_t<int32_t, py::array::c_style>;
        if (!Ids::check_(ids) || py::detail::array_proxy(ids.ptr())->nd != 1) return -2;
        const auto* a = py::detail::array_proxy(ids.ptr());
        const int64_t n = stack.size();
        if (allocated.size() != n || top < 0 || top > n)
          throw py::value_error("free_pages: inconsistent allocator arrays");
        return radixserve::push_free_pages(
            stack.mutable_data(), reinterpret_cast<uint8_t*>(allocated.mutable_data()), n, top,
            reinterpret_cast<const int32_t*>(a->data), a->dimensions[0]);
      },
      py::arg("stack"), py::arg("allocated"), py::arg("top"), py::arg("ids"),
      "PageAllocator.free's hot path: the new top, -1 if an id is invalid (nothing "
      "changed), -2 if ids is not a 1-D C-contiguous int32 array (not handled).");

  py::class_<NodeRef>(m, "NodeHandle", "An opaque handle on a tree node (valid while locked).")
      .def_property_readonly("node_id", [](const NodeRef& r) { return r.id; })
      .def("__eq__",
           [](const NodeRef& a, py::object b) {
             if (!py::isinstance<NodeRef>(b)) return false;
             const NodeRef& o = b.cast<const NodeRef&>();
             return a.slot == o.slot && a.id == o.id;
           })
      .def("__hash__", [](const NodeRef& r) { return py::hash(py::make_tuple(r.slot, r.id)); })
      .def("__repr__",
           [](const NodeRef& r) { return "NodeHandle(id=" + std::to_string(r.id) + ")"; });

  py::class_<PyRadixTree>(m, "RadixTree")
      .def(py::init<py::object, int32_t>(), py::arg("allocator"), py::arg("page_size"))
      .def("match_prefix", &PyRadixTree::match_prefix, py::arg("tokens"),
           py::arg("salt") = py::none())
      .def("peek_prefix", &PyRadixTree::peek_prefix, py::arg("tokens"),
           py::arg("salt") = py::none())
      .def("continuation", &PyRadixTree::continuation, py::arg("tokens"), py::arg("max_len"),
           py::arg("salt") = py::none())
      .def("insert", &PyRadixTree::insert, py::arg("tokens"), py::arg("pages"),
           py::arg("salt") = py::none())
      .def("lock", &PyRadixTree::lock, py::arg("node"))
      .def("unlock", &PyRadixTree::unlock, py::arg("node"))
      .def("evict", &PyRadixTree::evict, py::arg("num_pages"))
      .def("reset", &PyRadixTree::reset)
      .def("all_pages", &PyRadixTree::all_pages)
      .def("export_nodes", &PyRadixTree::export_nodes, py::arg("max_label"),
           py::arg("salt") = py::none(), py::arg("every_namespace") = true,
           "The tree's shape, read-only (radix_cache.RadixCache.export_nodes)")
      .def("node_info", &PyRadixTree::node_info, py::arg("node"),
           "(node_id, lock_ref, last_access, num_tokens), or None once detached")
      .def("_check_structure", [](const PyRadixTree& t) { t.tree().check(); })
      .def_property_readonly("page_size", [](const PyRadixTree& t) { return t.tree().page_size(); })
      .def_property_readonly("evictable_pages",
                             [](const PyRadixTree& t) { return t.tree().evictable_pages(); })
      .def_property_readonly("protected_pages",
                             [](const PyRadixTree& t) { return t.tree().protected_pages(); })
      .def_property_readonly("cached_pages",
                             [](const PyRadixTree& t) {
                               return t.tree().evictable_pages() + t.tree().protected_pages();
                             })
      .def_property_readonly("num_nodes", [](const PyRadixTree& t) { return t.tree().num_nodes(); })
      .def_property_readonly("clock", [](const PyRadixTree& t) { return t.tree().clock(); });
}
