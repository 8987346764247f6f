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
  // Which C++ error paths reach Python on this build and machine (bench/registration_errors.py):
  // on the H200 (torch 2.11) kinds 1, 2 and 5 (an integer through c10::str's stream) killed the
  // process; 6 and 7 are what this extension's checks do instead (text.h).
  m.def(
      "_error_path_probe",
      [](int64_t kind) -> std::string {
        switch (kind) {
          case 0: throw pybind11::value_error("a constant message");
          case 1: return c10::str("formatted ", kind, " ", std::string("string"));
          case 2: throw pybind11::value_error(c10::str("formatted ", kind));
          case 3: TORCH_CHECK(false, "a constant message");
          case 4: throw std::runtime_error("a constant message");
          case 5: TORCH_CHECK(false, "formatted ", kind, " ", std::string("string"));
          case 6: throw pybind11::value_error(lycoris::text("formatted ", kind, " ", 0.5, " ", std::string("string")));
          case 7: LYCORIS_CHECK(false, "formatted ", kind, " ", std::string("string"));
          default: return "no error";
        }
      },
      pybind11::arg("kind"), "Raise (or format) on one C++ error path; a diagnostic.");
  lycoris::bind_autograd(m);
  lycoris::bind_launch(m);
}
