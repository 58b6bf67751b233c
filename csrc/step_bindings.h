// Bindings of the per-step helper kernels (step_bindings.cpp) into the module
// radixserve.layers._cpu_kernels, whose other functions are in cpu_kernels.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace radixserve {
void bind_step_kernels(pybind11::module_& m);
}
