// Bindings of the per-step helper kernels (step_bindings.cpp) into the module
// radixserve.layers._cpu_kernels, whose other functions are in cpu_kernels.cpp.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "cpu_kernels.h"

namespace radixserve {
void bind_step_kernels(pybind11::module_& m);

// "auto" (the best this CPU runs) or a level's name; a level the CPU lacks is
// refused (std::invalid_argument naming ``where``), so a kernel never executes an
// instruction the CPU does not have. Defined in cpu_kernels.cpp.
Isa parse_isa(const std::string& name, const char* where);
}
