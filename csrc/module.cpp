// The Python module lycoris_ops._C: importing it runs the TORCH_LIBRARY block
// of ops.cpp (same shared object) and exposes the schema table in its order.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "schemas.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "lycoris_ops schemas (TORCH_LIBRARY(lycoris, m))";
  m.def(
      "schemas",
      [] { return std::vector<std::string>(std::begin(lycoris::kSchemas), std::end(lycoris::kSchemas)); },
      "The 23 operator schemas, in registration order.");
}
