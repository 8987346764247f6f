// The CUDA-key kernel of the lycoris ops: a call whose signature was seen before
// replays the launches recorded for it, in C++, without entering Python.
//
// The Python CUDA kernel (lycoris_ops/select.py: backend choice, tuning, the Triton
// op set) costs tens of microseconds of host time per call. Here a call's signature
// (per tensor: dtype, device, sizes, strides, 16-byte alignment; every scalar by
// value) keys a plan. The first calls of a signature run the Python kernel; the third
// runs it under lycoris_ops/_launch_record.py, which returns a plan when everything the
// call did on the GPU was allocations and Triton launches: the allocations to make,
// the outputs as views of them, and per launch the CUfunction, grid, block, shared
// memory and each parameter (a pointer into an input or an allocation at a byte
// offset, or constant bytes). Later calls allocate and launch from the plan on the
// current stream. A signature whose call did anything else (a torch op, another
// backend, the eager sentinel) keeps calling Python.
//
// Built only where CUDA's headers are (setup.py defines LYCORIS_CUDA_LAUNCH); elsewhere
// the CUDA key keeps the Python kernel.
#include <torch/extension.h>
#include <torch/library.h>

#ifdef LYCORIS_CUDA_LAUNCH
#include <ATen/Context.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/SmallVector.h>
#include <dlfcn.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include "python_bridge.h"

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace lycoris {
namespace {

// cuLaunchKernel and cuMemsetD8Async, looked up in the driver torch already loaded (no
// link to libcuda).
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                         void**);
using MemsetFn = int (*)(unsigned long long, unsigned char, size_t, void*);

void* driver_symbol(const char* name) {
  static void* lib = [] {
    void* l = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    LYCORIS_CHECK(l, "lycoris: libcuda.so.1 not found");
    return l;
  }();
  void* f = dlsym(lib, name);
  LYCORIS_CHECK(f, "lycoris: ", name, " not found in libcuda.so.1");
  return f;
}

LaunchFn launch_fn() {
  static LaunchFn fn = reinterpret_cast<LaunchFn>(driver_symbol("cuLaunchKernel"));
  return fn;
}

MemsetFn memset_fn() {
  static MemsetFn fn = reinterpret_cast<MemsetFn>(driver_symbol("cuMemsetD8Async"));
  return fn;
}

enum ParamKind : int { kInput = 0, kAlloc = 1, kConst = 2, kNull = 3 };

struct Param {
  int kind;
  int64_t index;  // input argument / allocation
  int64_t value;  // byte offset (pointers) or the constant's bits
  int64_t nbytes;
};

struct Launch {
  void* function;
  unsigned grid[3];
  unsigned threads;
  unsigned shared;
  std::vector<Param> params;
};

struct Alloc {  // a tensor of (sizes, strides, dtype) over a storage of nbytes (packed workspaces past it)
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  int64_t nbytes;
  std::vector<std::pair<int64_t, int64_t>> zero;  // (byte offset, bytes) cleared before the launches
};

struct Output {  // a view of allocation `index`
  int64_t index, offset;
  std::vector<int64_t> sizes, strides;
};

struct Plan {
  int device;
  std::vector<Alloc> allocs;
  std::vector<Output> outputs;
  std::vector<Launch> launches;
};

struct Entry {
  int calls = 0;
  std::shared_ptr<const Plan> plan;  // null: not (yet) replayable
  bool python_only = false;
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& k) const noexcept {
    size_t h = k.size();
    for (int64_t v : k) h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
  }
};

constexpr int kRecordAt = 3;  // the call of a signature that is recorded (tuning and JIT done by then)
constexpr size_t kMaxKeys = 4096;

struct OpState {
  std::string name;
  size_t num_args = 0;
  std::vector<bool> dtype_arg;  // ScalarType arguments (an int in the IValue, a torch.dtype in Python)
  PyObject* python_kernel = nullptr;
  PyObject* recorder = nullptr;
  std::mutex mutex;
  std::unordered_map<std::vector<int64_t>, Entry, KeyHash> entries;
  std::unordered_map<std::string, int64_t> strings;  // interned str arguments
};

std::vector<OpState*>& op_states() {
  static std::vector<OpState*> states;
  return states;
}

// The call's signature in `key`; false where an argument has a kind the key cannot hold.
bool key_of(OpState& st, const torch::jit::Stack& stack, size_t first, std::vector<int64_t>& key) {
  key.clear();
  for (size_t i = first; i < stack.size(); ++i) {
    const auto& v = stack[i];
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      key.push_back(1000 + static_cast<int64_t>(t.scalar_type()));
      key.push_back(t.device().index());
      key.push_back((reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0);
      key.push_back(t.dim());
      for (auto s : t.sizes()) key.push_back(s);
      for (auto s : t.strides()) key.push_back(s);
    } else if (v.isNone()) {
      key.push_back(-1);
    } else if (v.isDouble()) {
      double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      key.push_back(-2);
      key.push_back(bits);
    } else if (v.isBool()) {
      key.push_back(-3);
      key.push_back(v.toBool());
    } else if (v.isInt()) {
      key.push_back(-4);
      key.push_back(v.toInt());
    } else if (v.isString()) {
      const std::string& s = v.toStringRef();
      auto it = st.strings.find(s);
      int64_t id = it != st.strings.end() ? it->second : (st.strings[s] = static_cast<int64_t>(st.strings.size()));
      key.push_back(-5);
      key.push_back(id);
    } else if (v.isIntList()) {
      auto l = v.toIntList();
      key.push_back(-6);
      key.push_back(static_cast<int64_t>(l.size()));
      for (size_t j = 0; j < l.size(); ++j) key.push_back(l.get(j));
    } else {
      return false;
    }
  }
  return true;
}

PyObject* arg_to_python(const OpState& st, size_t i, const c10::IValue& v) {
  return v.isTensor() ? THPVariable_Wrap(v.toTensor()) : scalar_to_python(v, st.dtype_arg[i]);
}

void push_result(PyObject* r, torch::jit::Stack* stack, const std::string& name) {
  if (THPVariable_Check(r)) {
    stack->emplace_back(THPVariable_Unpack(r));
    return;
  }
  LYCORIS_CHECK(PyTuple_Check(r), name, ": the kernel must return a tensor or a tuple of tensors");
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(r); ++i) {
    PyObject* t = PyTuple_GET_ITEM(r, i);
    LYCORIS_CHECK(THPVariable_Check(t), name, ": output ", i, " is not a tensor");
    stack->emplace_back(THPVariable_Unpack(t));
  }
}

std::vector<int64_t> int_list(PyObject* o) {
  std::vector<int64_t> out;
  PyRef seq(PySequence_Fast(o, "expected a sequence"));
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq.p); ++i)
    out.push_back(PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq.p, i)));
  return out;
}

// (device, allocs, outputs, launches) from _launch_record.py's plan()
std::shared_ptr<const Plan> parse_plan(PyObject* o) {
  auto plan = std::make_shared<Plan>();
  plan->device = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(o, 0)));
  PyObject* allocs = PyTuple_GET_ITEM(o, 1);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(allocs); ++i) {
    PyObject* a = PyList_GET_ITEM(allocs, i);
    PyObject* dt = PyTuple_GET_ITEM(a, 2);
    LYCORIS_CHECK(THPDtype_Check(dt), "plan: allocation dtype");
    Alloc alloc{int_list(PyTuple_GET_ITEM(a, 0)), int_list(PyTuple_GET_ITEM(a, 1)),
                reinterpret_cast<THPDtype*>(dt)->scalar_type, PyLong_AsLongLong(PyTuple_GET_ITEM(a, 3)), {}};
    PyObject* zero = PyTuple_GET_ITEM(a, 4);
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(zero); ++j) {
      PyObject* z = PyList_GET_ITEM(zero, j);
      alloc.zero.emplace_back(PyLong_AsLongLong(PyTuple_GET_ITEM(z, 0)), PyLong_AsLongLong(PyTuple_GET_ITEM(z, 1)));
    }
    plan->allocs.push_back(std::move(alloc));
  }
  PyObject* outs = PyTuple_GET_ITEM(o, 2);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outs); ++i) {
    PyObject* x = PyList_GET_ITEM(outs, i);
    plan->outputs.push_back({PyLong_AsLongLong(PyTuple_GET_ITEM(x, 0)), PyLong_AsLongLong(PyTuple_GET_ITEM(x, 1)),
                             int_list(PyTuple_GET_ITEM(x, 2)), int_list(PyTuple_GET_ITEM(x, 3))});
  }
  PyObject* launches = PyTuple_GET_ITEM(o, 3);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(launches); ++i) {
    PyObject* l = PyList_GET_ITEM(launches, i);
    Launch launch;
    launch.function = reinterpret_cast<void*>(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(l, 0)));
    for (int d = 0; d < 3; ++d) launch.grid[d] = static_cast<unsigned>(PyLong_AsLong(PyTuple_GET_ITEM(l, 1 + d)));
    launch.threads = static_cast<unsigned>(PyLong_AsLong(PyTuple_GET_ITEM(l, 4)));
    launch.shared = static_cast<unsigned>(PyLong_AsLong(PyTuple_GET_ITEM(l, 5)));
    PyObject* params = PyTuple_GET_ITEM(l, 6);
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(params); ++j) {
      PyObject* p = PyList_GET_ITEM(params, j);
      Param param;
      param.kind = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(p, 0)));
      param.index = PyLong_AsLongLong(PyTuple_GET_ITEM(p, 1));
      param.value = PyLong_AsLongLong(PyTuple_GET_ITEM(p, 2));
      param.nbytes = PyLong_AsLongLong(PyTuple_GET_ITEM(p, 3));
      LYCORIS_CHECK(param.nbytes > 0 && param.nbytes <= 8, "plan: parameter size");
      launch.params.push_back(param);
    }
    plan->launches.push_back(std::move(launch));
  }
  if (PyErr_Occurred()) raise_python_error();
  return plan;
}

// A plan's allocation on the current device, as at::empty_strided makes it but without the
// dispatcher: a storage of a.nbytes from the CUDA caching allocator (so the CUDA graph pools,
// record_stream and the memory stats see it as usual) and the tensor over it. Where torch is
// asked to fill uninitialized memory (deterministic mode), a filled at::empty of a.nbytes bytes
// with the tensor set over its storage.
at::Tensor allocate(const Alloc& a, c10::DeviceIndex device) {
  auto& ctx = at::globalContext();
  if (ctx.deterministicAlgorithms() && ctx.deterministicFillUninitializedMemory()) {
    auto t = at::empty({a.nbytes}, at::TensorOptions().device(at::kCUDA, device).dtype(at::kByte));
    return at::empty({0}, t.options().dtype(a.dtype)).set_(t.storage(), 0, a.sizes, a.strides);
  }
  c10::Allocator* allocator = c10::cuda::CUDACachingAllocator::get();
  auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), a.nbytes,
                                                       allocator->allocate(a.nbytes), allocator, /*resizable=*/false);
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                                    c10::scalarTypeToTypeMeta(a.dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(a.sizes, a.strides);
  return t;
}

void replay(const Plan& plan, torch::jit::Stack* stack, size_t first, size_t num_args) {
  const auto device = static_cast<c10::DeviceIndex>(plan.device);
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  c10::SmallVector<at::Tensor, 8> allocs;
  // each allocation's storage address: the plan's offsets count from it (the recorder's
  // untyped_storage().data_ptr()). Not Tensor::data_ptr(), which is null for a tensor of no
  // elements, and a workspace pack may ride on one (an empty side output of the call).
  c10::SmallVector<char*, 8> bases;
  for (const auto& a : plan.allocs) {
    allocs.push_back(allocate(a, device));
    bases.push_back(static_cast<char*>(allocs.back().storage().mutable_data()));
    if (!a.zero.empty()) {
      auto base = reinterpret_cast<unsigned long long>(bases.back());
      for (const auto& z : a.zero) {
        int rc = memset_fn()(base + z.first, 0, static_cast<size_t>(z.second), stream);
        LYCORIS_CHECK(rc == 0, "lycoris: cuMemsetD8Async failed with CUresult ", rc);
      }
    }
  }
  c10::SmallVector<char*, 16> inputs(num_args, nullptr);
  for (size_t i = 0; i < num_args; ++i) {
    const auto& v = (*stack)[first + i];
    if (v.isTensor()) inputs[i] = static_cast<char*>(v.toTensor().data_ptr());
  }
  LaunchFn launch = launch_fn();
  uint64_t slots[64];
  void* params[64];
  for (const auto& l : plan.launches) {
    LYCORIS_CHECK(l.params.size() <= 64, "lycoris: too many kernel parameters");
    for (size_t j = 0; j < l.params.size(); ++j) {
      const Param& p = l.params[j];
      uint64_t bits = 0;
      switch (p.kind) {
        case kInput:
          bits = reinterpret_cast<uint64_t>(inputs[p.index] + p.value);
          break;
        case kAlloc:
          bits = reinterpret_cast<uint64_t>(bases[p.index] + p.value);
          break;
        case kConst:
          bits = static_cast<uint64_t>(p.value);
          break;
        default:
          bits = 0;
      }
      slots[j] = bits;  // little endian: a 4-byte parameter is the low half
      params[j] = &slots[j];
    }
    int rc = launch(l.function, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.shared, stream, params, nullptr);
    LYCORIS_CHECK(rc == 0, "lycoris: cuLaunchKernel failed with CUresult ", rc);
  }
  stack->erase(stack->begin() + first, stack->end());
  for (const auto& o : plan.outputs) {
    const at::Tensor& a = allocs[o.index];
    if (o.offset == 0 && a.sizes().equals(o.sizes) && a.strides().equals(o.strides)) {
      stack->emplace_back(a);
    } else {
      stack->emplace_back(a.as_strided(o.sizes, o.strides, o.offset));
    }
  }
}

struct CudaKernel final : c10::OperatorKernel {
  OpState* st;
  explicit CudaKernel(OpState* s) : st(s) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const size_t n = st->num_args, first = stack->size() - n;
    thread_local std::vector<int64_t> key;  // reused: no allocation per call
    std::vector<int64_t> recorded_key;  // a copy: a nested op call in Python reuses `key`
    std::shared_ptr<const Plan> plan;
    bool record = false;
    {
      std::lock_guard<std::mutex> lock(st->mutex);
      if (key_of(*st, *stack, first, key)) {
        auto it = st->entries.find(key);
        if (it == st->entries.end()) {
          if (st->entries.size() >= kMaxKeys) st->entries.clear();
          it = st->entries.emplace(key, Entry()).first;
        }
        Entry& e = it->second;
        if (e.plan) {
          plan = e.plan;
        } else if (!e.python_only && e.calls < kRecordAt && ++e.calls == kRecordAt) {
          record = st->recorder != nullptr;
          if (record) recorded_key = key;
        }
      }
    }
    if (plan) {
      replay(*plan, stack, first, n);
      return;
    }
    pybind11::gil_scoped_acquire gil;
    PyRef args(PyTuple_New(n));
    for (size_t i = 0; i < n; ++i) PyTuple_SET_ITEM(args.p, i, arg_to_python(*st, i, (*stack)[first + i]));
    PyRef result(PyObject_Call(record ? st->recorder : st->python_kernel, args.p, nullptr));
    PyObject* out = result.p;
    std::shared_ptr<const Plan> recorded;
    if (record) {  // (outputs, plan or None)
      LYCORIS_CHECK(PyTuple_Check(out) && PyTuple_GET_SIZE(out) == 2, st->name, ": recorder result");
      PyObject* p = PyTuple_GET_ITEM(out, 1);
      if (p != Py_None) recorded = parse_plan(p);
      out = PyTuple_GET_ITEM(out, 0);
    }
    stack->erase(stack->begin() + first, stack->end());
    push_result(out, stack, st->name);
    if (record) {
      std::lock_guard<std::mutex> lock(st->mutex);
      auto it = st->entries.find(recorded_key);
      if (it != st->entries.end()) {
        it->second.plan = recorded;
        it->second.python_only = !recorded;
      }
    }
  }
};

void register_cuda_kernel(const std::string& qualname, pybind11::object python_kernel, pybind11::object recorder) {
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(qualname.c_str(), "");
  auto st = new OpState();  // lives as long as the registration (the process)
  st->name = qualname;
  st->num_args = handle.schema().arguments().size();
  st->dtype_arg = dtype_arguments(handle.schema());
  st->python_kernel = python_kernel.release().ptr();
  if (!recorder.is_none()) st->recorder = recorder.release().ptr();
  op_states().push_back(st);
  register_kernel(qualname, c10::DispatchKey::CUDA,
                  torch::CppFunction::makeFromBoxedFunctor(std::make_unique<CudaKernel>(st)));
}

void clear_launch_plans() {
  for (auto* st : op_states()) {
    std::lock_guard<std::mutex> lock(st->mutex);
    st->entries.clear();
  }
}

pybind11::tuple launch_plan_stats(const std::string& qualname) {
  for (auto* st : op_states()) {
    if (st->name != qualname) continue;
    std::lock_guard<std::mutex> lock(st->mutex);
    int64_t plans = 0, python_only = 0;
    for (const auto& kv : st->entries) {
      plans += kv.second.plan != nullptr;
      python_only += kv.second.python_only;
    }
    return pybind11::make_tuple(static_cast<int64_t>(st->entries.size()), plans, python_only);
  }
  return pybind11::make_tuple(0, 0, 0);
}

}  // namespace

void bind_launch(pybind11::module_& m) {
  m.def("_register_cuda_kernel", value_errors(&register_cuda_kernel), pybind11::arg("qualname"), pybind11::arg("python_kernel"),
        pybind11::arg("recorder"),
        "Register the C++ CUDA kernel of an op: replays recorded launches, else calls python_kernel(*args); "
        "recorder(*args) -> (outputs, plan or None) runs at a signature's third call.");
  m.def("_clear_launch_plans", &clear_launch_plans, "Forget every recorded plan (after a backend change).");
  m.def("_launch_plan_stats", &launch_plan_stats, pybind11::arg("qualname"),
        "(signatures seen, signatures replayed from a plan, signatures that stay in Python) of an op.");
}

}  // namespace lycoris

#else  // no CUDA headers at build time: the CUDA key keeps the Python kernel

namespace lycoris {
void bind_launch(pybind11::module_& m) {}
}  // namespace lycoris

#endif
