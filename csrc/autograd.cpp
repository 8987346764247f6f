// The Autograd-key kernel of the lycoris ops, in C++.
//
// torch.library.register_autograd (and any Python Autograd kernel) costs tens of
// microseconds per call before the op's own kernel runs: a Python kernel behind the
// dispatcher, an autograd.Function with its ctx, setup_context in Python. Here the
// forward side is C++ only: check grad mode and requires_grad, redispatch below
// autograd, and when a gradient is needed record one graph node that holds the saved
// tensors and the scalar arguments. Python runs only in the backward: the node calls
// the op's Python backward (lycoris_ops/autograd.py) once, with the saved arguments.
// Ops whose backward is one call of their *_bwd op (the bypass ops, the LoKr merges,
// IA3) register that call instead (a "direct" backward): the node calls the *_bwd op
// through the dispatcher and never takes the GIL. On CUDA the autograd engine runs
// the backward on its device thread, and there the GIL hand-over from the Python main
// thread is most of a small op's backward host time.
//
// Registered per op at run time from Python (_C._register_autograd), so the same
// kernel also serves the probe ops of bench/host_overhead.py.
#include "python_bridge.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace lycoris {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
// torch 2.11 holds graph nodes in std::shared_ptr, torch 2.13 in c10::intrusive_ptr.
using NodePtr = std::decay_t<decltype(std::declval<const at::TensorBase&>().grad_fn())>;

// A backward that is one call of the op's *_bwd op, with the incoming gradient, saved
// tensors and scalar arguments; its outputs are the gradients of some arguments, and
// one argument (the bypass ops' base) may get the incoming gradient itself.
struct DirectBackward {
  std::optional<c10::OperatorHandle> op;  // the *_bwd op
  std::vector<int64_t> args;     // per argument of the *_bwd op: -1 the gradient, else a forward argument
  std::vector<int64_t> targets;  // per output of the *_bwd op: the forward argument it is the gradient of, or -1
  int64_t passthrough = -1;      // the forward argument whose gradient is the incoming one (in its dtype), or -1
};

// Off: every node runs its Python backward (bench/host_overhead.py's A/B rows, tests).
std::atomic<bool> direct_enabled{true};

// What an op's node keeps and whom it calls; one per registered op, never freed.
struct Spec {
  std::string name;              // "lycoris::lora_bypass_fwd"
  PyObject* backward = nullptr;  // backward(args, outputs, grads, need) -> grads; null: first order only
  std::vector<bool> save_input;  // per argument: keep the tensor (else only its dtype and shape)
  std::vector<bool> save_output;  // per output: keep it (non-differentiable outputs only)
  std::vector<bool> differentiable_output;
  std::vector<bool> dtype_arg;  // ScalarType arguments (a torch.dtype in Python)
  size_t num_args = 0;
  std::unique_ptr<DirectBackward> direct;  // set: the backward never enters Python
};

struct LycorisBackward final : Node {
  const Spec* spec;
  std::vector<c10::IValue> args;  // the forward's arguments, tensors taken out
  std::vector<SavedVariable> saved_inputs;  // per argument (empty where not saved)
  std::vector<SavedVariable> saved_outputs;  // per output (empty where not saved)
  std::vector<std::pair<at::ScalarType, std::vector<c10::SymInt>>> absent;  // unsaved tensors: dtype, shape
  at::ScalarType passthrough_dtype = at::ScalarType::Undefined;  // a direct backward's passthrough argument
  std::mutex mutex;

  explicit LycorisBackward(const Spec* s) : spec(s) {}

  std::string name() const override {
    return spec->name + "Backward";
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& v : saved_inputs) v.reset_data();
    for (auto& v : saved_outputs) v.reset_data();
  }

  variable_list apply(variable_list&& grads) override;

 private:
  variable_list apply_direct(const at::Tensor& grad, std::vector<at::Tensor>& inputs);
};

// N is a parameter only so that the branch not taken is never instantiated.
template <class P, class N = LycorisBackward>
P make_node(const Spec* spec) {
  if constexpr (std::is_same_v<P, std::shared_ptr<Node>>) {
    return P(new N(spec), [](auto* p) { deleteNode(p); });  // torch's iterative delete of long chains
  } else {
    return c10::make_intrusive<N>(spec);
  }
}

variable_list LycorisBackward::apply(variable_list&& grads) {
  const size_t n = spec->num_args;
  if (!spec->backward) {
    std::string dotted = spec->name;
    dotted.replace(dotted.find("::"), 2, ".");
    LYCORIS_CHECK(false, dotted, " is a first-order backward op: double backward (create_graph=True through a lycoris op, "
                "then differentiating again) is not supported");
  }
  // an output nobody used gets a zero gradient, as autograd.Function's materialize_grads does
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined() && spec->differentiable_output[i]) grads[i] = input_metadata(i).zeros_like();
  }
  std::vector<at::Tensor> inputs(n), outputs(spec->save_output.size());
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (size_t i = 0; i < n; ++i)
      if (spec->save_input[i]) inputs[i] = saved_inputs[i].unpack();
    for (size_t i = 0; i < outputs.size(); ++i)
      if (spec->save_output[i]) outputs[i] = saved_outputs[i].unpack();
  }
  if (spec->direct && direct_enabled.load(std::memory_order_relaxed)) return apply_direct(grads[0], inputs);
  pybind11::gil_scoped_acquire gil;
  PyRef py_args(PyTuple_New(n));
  PyRef py_need(PyTuple_New(n));
  size_t next_absent = 0;
  for (size_t i = 0; i < n; ++i) {
    PyObject* item;
    if (args[i].isTensor()) {  // a placeholder: the tensor argument sits in inputs / absent
      if (spec->save_input[i]) {
        item = THPVariable_Wrap(inputs[i]);
      } else {  // (dtype, shape): what the Python side's setup_context may read
        const auto& a = absent[next_absent++];
        PyRef shape(PyTuple_New(a.second.size()));
        for (size_t d = 0; d < a.second.size(); ++d)
          PyTuple_SET_ITEM(shape.p, d, pybind11::cast(a.second[d]).release().ptr());
        PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(a.first));
        Py_INCREF(dtype);
        item = PyTuple_Pack(2, dtype, shape.p);
        Py_DECREF(dtype);
      }
    } else {
      item = scalar_to_python(args[i], spec->dtype_arg[i]);
    }
    if (!item) raise_python_error();
    PyTuple_SET_ITEM(py_args.p, i, item);
    PyObject* need = task_should_compute_output(i) ? Py_True : Py_False;
    Py_INCREF(need);
    PyTuple_SET_ITEM(py_need.p, i, need);
  }
  const size_t m = grads.size();
  PyRef py_grads(PyTuple_New(m));
  for (size_t i = 0; i < m; ++i) {
    PyObject* g = grads[i].defined() ? THPVariable_Wrap(grads[i]) : (Py_INCREF(Py_None), Py_None);
    PyTuple_SET_ITEM(py_grads.p, i, g);
  }
  PyRef py_outputs(PyTuple_New(outputs.size()));
  for (size_t i = 0; i < outputs.size(); ++i) {
    PyObject* o = outputs[i].defined() ? THPVariable_Wrap(outputs[i]) : (Py_INCREF(Py_None), Py_None);
    PyTuple_SET_ITEM(py_outputs.p, i, o);
  }
  PyObject* result = PyObject_CallFunctionObjArgs(spec->backward, py_args.p, py_outputs.p, py_grads.p, py_need.p, nullptr);
  if (!result) raise_python_error();
  PyRef owned(result);
  LYCORIS_CHECK(PyTuple_Check(result) && static_cast<size_t>(PyTuple_GET_SIZE(result)) == n, spec->name,
              ": the backward must return a tuple of ", n, " gradients (one per argument)");
  variable_list out(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* g = PyTuple_GET_ITEM(result, i);
    if (g == Py_None) continue;
    LYCORIS_CHECK(THPVariable_Check(g), spec->name, ": gradient ", i, " is not a tensor");
    if (should_compute_output(i)) out[i] = THPVariable_Unpack(g);
  }
  return out;
}

variable_list LycorisBackward::apply_direct(const at::Tensor& grad, std::vector<at::Tensor>& inputs) {
  const DirectBackward& d = *spec->direct;
  variable_list out(spec->num_args);
  bool any = false;
  for (auto t : d.targets) any = any || (t >= 0 && task_should_compute_output(t));
  if (any) {
    // a merge whose out_dtype is the other 16-bit dtype than its operands': G widened to fp32
    // (exact), as autograd.py's _grad_for does; fp16 and bf16 never meet in one call
    at::Tensor g_in = grad;
    const auto half = [](at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; };
    for (auto src : d.args) {
      if (src >= 0 && args[src].isTensor() && inputs[src].defined() && half(g_in.scalar_type()) &&
          half(inputs[src].scalar_type()) && inputs[src].scalar_type() != g_in.scalar_type())
        g_in = grad.to(at::kFloat);
    }
    torch::jit::Stack stack;
    stack.reserve(d.args.size());
    for (auto src : d.args) {
      if (src < 0) {
        stack.emplace_back(g_in);
      } else if (args[src].isTensor()) {  // a tensor argument: saved (checked at registration)
        stack.emplace_back(inputs[src]);
      } else {
        stack.emplace_back(args[src]);
      }
    }
    d.op->callBoxed(stack);
    for (size_t k = 0; k < d.targets.size(); ++k) {
      const auto t = d.targets[k];
      if (t < 0 || !should_compute_output(t)) continue;
      at::Tensor g = stack[k].toTensor();
      if (g.defined() && g.scalar_type() != inputs[t].scalar_type()) g = g.to(inputs[t].scalar_type());
      out[t] = std::move(g);
    }
  }
  if (d.passthrough >= 0 && should_compute_output(d.passthrough)) {
    out[d.passthrough] = grad.scalar_type() == passthrough_dtype ? grad : grad.to(passthrough_dtype);
  }
  return out;
}

struct AutogradKernel final : c10::OperatorKernel {
  const Spec* spec;
  explicit AutogradKernel(const Spec* s) : spec(s) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const size_t n = spec->num_args;
    auto first = stack->end() - n;
    bool needs_grad = false;
    if (at::GradMode::is_enabled()) {
      for (auto it = first; it != stack->end(); ++it) {
        if (it->isTensor()) {
          const auto& t = it->toTensor();
          LYCORIS_CHECK(!t._fw_grad(/*level=*/0).defined(), spec->name,
                      " has no forward-mode derivative (a dual tensor was passed)");
          needs_grad = needs_grad || t.requires_grad();
        }
      }
    }
    if (!needs_grad) {
      at::AutoDispatchBelowADInplaceOrView guard;
      op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
      return;
    }
    NodePtr node = make_node<NodePtr>(spec);
    auto node_raw = static_cast<LycorisBackward*>(node.get());
    torch::autograd::edge_list edges(n);
    node_raw->args.assign(first, stack->end());
    node_raw->saved_inputs.resize(n);
    for (size_t i = 0; i < n; ++i) {
      auto& arg = node_raw->args[i];
      if (!arg.isTensor()) continue;
      const at::Tensor& t = arg.toTensor();
      edges[i] = torch::autograd::impl::gradient_edge(t);
      if (spec->save_input[i]) {
        node_raw->saved_inputs[i] = SavedVariable(t, /*is_output=*/false);
      } else {
        // sym_sizes: sizes() would specialize a symbolic shape while tracing
        node_raw->absent.emplace_back(t.scalar_type(), t.sym_sizes().vec());
      }
      if (spec->direct && static_cast<int64_t>(i) == spec->direct->passthrough)
        node_raw->passthrough_dtype = t.scalar_type();
      arg = c10::IValue(at::Tensor());  // the tensor lives in saved_inputs (or not at all)
    }
    node_raw->set_next_edges(std::move(edges));
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
    }
    const size_t m = spec->differentiable_output.size();
    node_raw->saved_outputs.resize(m);
    auto out = stack->end() - m;
    for (size_t i = 0; i < m; ++i, ++out) {
      const at::Tensor& t = out->toTensor();
      if (spec->differentiable_output[i] && t.defined() && torch::autograd::isDifferentiableType(t.scalar_type())) {
        torch::autograd::set_history(t, node);
      } else {
        node_raw->add_input_metadata(Node::undefined_input());
      }
      if (spec->save_output[i]) node_raw->saved_outputs[i] = SavedVariable(t, /*is_output=*/false);
    }
  }
};

// The direct backward of `spec`'s op, checked against both schemas.
std::unique_ptr<DirectBackward> make_direct(const Spec& spec, const std::vector<bool>& tensor_arg,
                                            const std::string& bwd_qualname, const std::vector<int64_t>& args,
                                            const std::vector<int64_t>& targets, int64_t passthrough) {
  const auto& name = spec.name;
  auto d = std::make_unique<DirectBackward>();
  d->op = c10::Dispatcher::singleton().findSchemaOrThrow(bwd_qualname.c_str(), "");
  const auto& schema = d->op->schema();
  LYCORIS_REGISTRATION_CHECK(spec.differentiable_output.size() == 1, name,
                             ": a direct backward needs an op with one output");
  LYCORIS_REGISTRATION_CHECK(args.size() == schema.arguments().size(), name, ": the direct backward passes ",
                             args.size(), " arguments, ", bwd_qualname, " takes ", schema.arguments().size());
  LYCORIS_REGISTRATION_CHECK(targets.size() == schema.returns().size(), name, ": the direct backward maps ",
                             targets.size(), " outputs, ", bwd_qualname, " returns ", schema.returns().size());
  const int64_t n = static_cast<int64_t>(spec.num_args);
  for (auto src : args) {
    LYCORIS_REGISTRATION_CHECK(src >= -1 && src < n, name, ": direct backward argument index ", src);
    LYCORIS_REGISTRATION_CHECK(src < 0 || !tensor_arg[src] || spec.save_input[src], name,
                               ": the direct backward passes tensor argument ", src, ", which the node does not save");
  }
  for (auto t : targets) {
    LYCORIS_REGISTRATION_CHECK(t >= -1 && t < n && (t < 0 || spec.save_input[t]), name,
                               ": direct backward output target ", t, " is not a saved tensor argument");
  }
  LYCORIS_REGISTRATION_CHECK(passthrough >= -1 && passthrough < n && (passthrough < 0 || tensor_arg[passthrough]),
                             name, ": direct backward passthrough ", passthrough, " is not a tensor argument");
  d->args = args;
  d->targets = targets;
  d->passthrough = passthrough;
  return d;
}

// _C._register_autograd(qualname, backward, save_inputs, save_outputs, nondiff_outputs[, direct_op, direct_args,
// direct_targets, direct_passthrough])
void register_autograd(const std::string& qualname, pybind11::object backward, const std::vector<int64_t>& save_inputs,
                       const std::vector<int64_t>& save_outputs, const std::vector<int64_t>& nondiff_outputs,
                       const std::string& direct_op, const std::vector<int64_t>& direct_args,
                       const std::vector<int64_t>& direct_targets, int64_t direct_passthrough) {
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(qualname.c_str(), "");
  const auto& schema = handle.schema();
  auto spec = new Spec();  // lives as long as the registration (the process)
  spec->name = qualname;
  spec->num_args = schema.arguments().size();
  std::vector<bool> tensor_arg;
  for (const auto& a : schema.arguments()) {
    const auto& type = a.type();
    bool tensor = type->kind() == c10::TypeKind::TensorType ||
                  (type->kind() == c10::TypeKind::OptionalType &&
                   type->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType);
    bool plain = tensor || type->kind() == c10::TypeKind::FloatType || type->kind() == c10::TypeKind::IntType ||
                 type->kind() == c10::TypeKind::BoolType || type->kind() == c10::TypeKind::StringType ||
                 type->kind() == c10::TypeKind::OptionalType || type->kind() == c10::TypeKind::ListType;
    LYCORIS_REGISTRATION_CHECK(plain && !a.kwarg_only(), qualname, ": argument '", a.name(),
                               "' has a kind this kernel does not take");
    tensor_arg.push_back(tensor);
  }
  spec->dtype_arg = dtype_arguments(schema);
  const size_t m = schema.returns().size();
  for (const auto& r : schema.returns())
    LYCORIS_REGISTRATION_CHECK(r.type()->kind() == c10::TypeKind::TensorType, qualname,
                               ": every return must be a Tensor");
  spec->save_input.assign(spec->num_args, false);
  spec->save_output.assign(m, false);
  spec->differentiable_output.assign(m, true);
  for (auto i : save_inputs) {
    LYCORIS_REGISTRATION_CHECK(i >= 0 && static_cast<size_t>(i) < spec->num_args && tensor_arg[i], qualname,
                               ": save_inputs index ", i, " is not a tensor argument");
    spec->save_input[i] = true;
  }
  for (auto i : nondiff_outputs) {
    LYCORIS_REGISTRATION_CHECK(i >= 0 && static_cast<size_t>(i) < m, qualname, ": nondiff_outputs index ", i);
    spec->differentiable_output[i] = false;
  }
  for (auto i : save_outputs) {
    LYCORIS_REGISTRATION_CHECK(i >= 0 && static_cast<size_t>(i) < m, qualname, ": save_outputs index ", i);
    // a differentiable output saved in its own node would form a reference cycle
    LYCORIS_REGISTRATION_CHECK(!spec->differentiable_output[i], qualname,
                               ": only non-differentiable outputs can be saved");
    spec->save_output[i] = true;
  }
  if (!direct_op.empty()) {
    LYCORIS_REGISTRATION_CHECK(!backward.is_none(), qualname,
                               ": a direct backward also needs the Python backward");
    spec->direct = make_direct(*spec, tensor_arg, direct_op, direct_args, direct_targets, direct_passthrough);
  }
  if (!backward.is_none()) spec->backward = backward.release().ptr();
  register_kernel(qualname, c10::DispatchKey::Autograd,
                  torch::CppFunction::makeFromBoxedFunctor(std::make_unique<AutogradKernel>(spec)));
}

}  // namespace

void bind_autograd(pybind11::module_& m) {
  m.def(
      "_set_direct_backward", [](bool on) { return direct_enabled.exchange(on); }, pybind11::arg("enabled"),
      "Whether nodes with a direct backward make the *_bwd call in C++ (default) or run the Python backward; "
      "returns the previous setting.");
  m.def("_register_autograd", value_errors(&register_autograd), pybind11::arg("qualname"), pybind11::arg("backward"),
        pybind11::arg("save_inputs"), pybind11::arg("save_outputs"), pybind11::arg("nondiff_outputs"),
        pybind11::arg("direct_op") = "", pybind11::arg("direct_args") = std::vector<int64_t>{},
        pybind11::arg("direct_targets") = std::vector<int64_t>{}, pybind11::arg("direct_passthrough") = -1,
        "Register the C++ Autograd kernel of an op: backward(args, outputs, grads, need) -> one gradient per "
        "argument; save_inputs / save_outputs: indices of the tensors the node keeps; nondiff_outputs: outputs "
        "without a gradient. backward=None: the op is first order only (its backward raises). direct_op: the "
        "backward is that op's call instead (no Python): direct_args per argument of it -1 (the gradient) or a "
        "forward argument; direct_targets per output of it the forward argument it is the gradient of (or -1); "
        "direct_passthrough the forward argument whose gradient is the incoming one (or -1).");
}

}  // namespace lycoris
