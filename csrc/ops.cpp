// Registers the lycoris operator namespace. Kernels (CPU, CUDA), fakes and
// autograd are attached from Python (lycoris_ops/registry.py, fakes.py,
// autograd.py); this file only owns the schemas, so a graph that holds a
// lycoris op can be loaded by anything that loads this library.
#include <torch/library.h>

#include "schemas.h"

TORCH_LIBRARY(lycoris, m) {
  for (const char* schema : lycoris::kSchemas) {
    // pt2_compliant: the op is functional and has a fake, so torch.compile and
    // torch.export may keep it as one opaque node.
    m.def(schema, {at::Tag::pt2_compliant_tag});
  }
}
