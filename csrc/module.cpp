// The Python module lycoris_ops._C: importing it runs the TORCH_LIBRARY block
// of ops.cpp (same shared object), exposes the schema table in its order, and
// the registrations of the C++ Autograd kernel (autograd.cpp) and, where CUDA's
// headers were found at build time, of the replaying CUDA kernel (launch.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include "schemas.h"
#include "text.h"

namespace lycoris {
void bind_autograd(pybind11::module_& m);  // autograd.cpp
void bind_launch(pybind11::module_& m);    // launch.cpp
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "lycoris_ops schemas (TORCH_LIBRARY(lycoris, m))";
  m.def(
      "schemas",
      [] { return std::vector<std::string>(std::begin(lycoris::kSchemas), std::end(lycoris::kSchemas)); },
      "The 23 operator schemas, in registration order.");
  lycoris::bind_autograd(m);
  lycoris::bind_launch(m);
}
