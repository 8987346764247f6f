"""Host time per call on tiny tensors (the device idles): one torch.add, the eager
LoRA formula, and torch.ops.lycoris.lora_bypass_fwd / add_scaled without and with
autograd, so the Python kernel and Python autograd layers show separately.

The ``probe`` rows are the framework floor: a no-op custom op with the signature of
lora_bypass_fwd (namespace ``lycoris_probe``, a Python CPU/CUDA kernel returning
``empty_like(x)``), bare, with torch.library.register_autograd, and with the lean
Python kernel of lycoris_ops/_library/autograd_kernel.py, and with the C++ Autograd kernel the
lycoris ops use (csrc/autograd.cpp). The last rows
time forward+backward of the eager formula and of the op, then of the probes with
autograd (the floor of a Python-registered op with a Python backward) and of a plain
one-op ``autograd.Function``. ``--layers`` times instead the forward+backward of whole
adapter layers (a plain ``nn.Linear``, ``lycoris_ops.nn`` LoRA and DoRA, PEFT's DoRA when
PEFT is installed), best of five rounds.

    python bench/host_overhead.py [--device cpu|cuda] [--calls 3000] [--layers | --plans | --ops | --specs | --fb]
"""
import argparse
import time

import torch
import torch.nn.functional as F

import lycoris_ops  # noqa: F401
from lycoris_ops._library.autograd_kernel import direct_backward, register_autograd as lycoris_register_autograd

_PROBE_SCHEMA = "(Tensor x, Tensor up, Tensor down, float gamma, Tensor? base=None) -> Tensor"
_probe_lib = None


def probe_ops():
    """(bare, torch autograd, lycoris autograd) no-op ops ``lycoris_probe::*``, defined once."""
    global _probe_lib
    if _probe_lib is None:
        _probe_lib = torch.library.Library("lycoris_probe", "DEF")

        def kernel(x, up, down, gamma, base=None):
            return torch.empty_like(x)

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs[:3])

        def backward(ctx, grad):
            return None, None, None, None, None

        for name in ("noop", "noop_torch_ag", "noop_lycoris_py", "noop_lycoris_ag"):
            _probe_lib.define(name + _PROBE_SCHEMA)
            for key in ("CPU", "CUDA"):
                _probe_lib.impl(name, kernel, key)
        torch.library.register_autograd("lycoris_probe::noop_torch_ag", backward, setup_context=setup_context)
        # save=None: the Python kernel; save=(...): the C++ kernel the lycoris ops use
        lycoris_register_autograd("lycoris_probe::noop_lycoris_py", backward, setup_context=setup_context)
        lycoris_register_autograd("lycoris_probe::noop_lycoris_ag", backward, setup_context=setup_context,
                                  save=("x", "up", "down"))
    P = torch.ops.lycoris_probe
    return P.noop, P.noop_torch_ag, P.noop_lycoris_py, P.noop_lycoris_ag


#: calls enqueued back to back between two (untimed) drains of the GPU: few enough launches
#: in flight that the launch queue never fills (a full queue blocks the host, and the
#: timing would then be the GPU's pace, not the host's)
CHUNK = 32


def per_call_us(fn, calls, sync, rounds=5, warmup=200, chunk=CHUNK):
    """Host microseconds per call: best of ``rounds`` rounds of ``calls / rounds`` calls (the
    machines are shared), each round timed in chunks of ``chunk`` calls with the GPU drained,
    untimed, before each chunk: a call whose kernels outlast its host time (BOFT's Cayley
    launch, a backward's several kernels) is still timed on the host."""
    for _ in range(warmup):
        fn()
    sync()
    n, best = max(1, calls // rounds), float("inf")
    for _ in range(rounds):
        spent, done = 0.0, 0
        while done < n:
            k = min(chunk, n - done)
            sync()
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            spent += time.perf_counter() - t0
            done += k
        best = min(best, spent / n * 1e6)
    sync()
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--layers", action="store_true", help="adapter layers' forward+backward instead")
    ap.add_argument("--plans", action="store_true",
                    help="which call signatures of every op's test cases get a C++ replay plan (CUDA)")
    ap.add_argument("--ops", action="store_true", help="host time per call of every op (its first test case)")
    ap.add_argument("--specs", action="store_true",
                    help="the benchmark's tiny host specs (inputs requiring grad, as bench.py times them): host "
                         "time, replay plans and why not, the tuner's pick (CUDA)")
    ap.add_argument("--why", default="",
                    help="comma-separated ops: torch.profiler's CPU events of 300 calls of each op's first test "
                         "case (bf16, replayed), by self time: where a call's host time goes (CUDA)")
    ap.add_argument("--fb", action="store_true",
                    help="forward+backward of the bypass ops: direct C++ backward, Python backward, eager formula")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.layers:
        return layers(dev, args.calls)
    if args.plans:
        return plans()
    if args.ops:
        return ops(dev, args.calls)
    if args.specs:
        return specs(dev, args.calls)
    if args.fb:
        return forward_backward(dev, args.calls)
    if args.why:
        return why(args.why.split(","))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)

    def t(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dev).requires_grad_(grad)

    x, up, down, base = t(16, 64), t(64, 8), t(8, 64), t(16, 64)
    upg, downg = up.detach().clone().requires_grad_(), down.detach().clone().requires_grad_()
    a, b = t(4, 4), t(4, 4)
    op, add = torch.ops.lycoris.lora_bypass_fwd, torch.ops.lycoris.add_scaled
    bare, torch_ag, lycoris_py, lycoris_ag = probe_ops()

    def eager_fwd_bwd():
        (base + 0.5 * F.linear(F.linear(x, downg), upg)).sum().backward()

    def op_fwd_bwd():
        op(x, upg, downg, 0.5, base).sum().backward()

    def op_fwd_bwd_python_backward():  # the C++ node runs the Python backward (no direct *_bwd call)
        with direct_backward(False):
            op_fwd_bwd()

    def probe_fwd_bwd(probe):  # the framework's floor: a no-op kernel, backward returns None
        def run():
            torch.autograd.grad(probe(x, upg, downg, 0.5, base).float().sum() * 0, (upg,), allow_unused=True)
        return run

    class _NoOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 1

        @staticmethod
        def backward(ctx, g):
            return g

    def function_fwd_bwd():
        _NoOp.apply(upg).sum().backward()
    rows = [
        ("torch.add", lambda: torch.add(a, b, alpha=0.5)),
        ("eager LoRA formula", lambda: base + 0.5 * F.linear(F.linear(x, down), up)),
        ("lycoris.add_scaled, no_grad", lambda: _no_grad(add, a, b, 0.5)),
        ("lycoris.add_scaled", lambda: add(a, b, 0.5)),
        ("lycoris.lora_bypass_fwd, no_grad", lambda: _no_grad(op, x, up, down, 0.5, base)),
        ("lycoris.lora_bypass_fwd", lambda: op(x, up, down, 0.5, base)),
        ("lycoris.lora_bypass_fwd, factors need grad", lambda: op(x, upg, downg, 0.5, base)),
        ("probe no-op op, no autograd", lambda: bare(x, up, down, 0.5, base)),
        ("probe + torch register_autograd, no_grad", lambda: _no_grad(torch_ag, x, up, down, 0.5, base)),
        ("probe + torch register_autograd", lambda: torch_ag(x, up, down, 0.5, base)),
        ("probe + torch register_autograd, need grad", lambda: torch_ag(x, upg, downg, 0.5, base)),
        ("probe + lycoris Python autograd kernel", lambda: lycoris_py(x, up, down, 0.5, base)),
        ("probe + lycoris Python autograd, need grad", lambda: lycoris_py(x, upg, downg, 0.5, base)),
        ("probe + lycoris C++ autograd, no_grad", lambda: _no_grad(lycoris_ag, x, up, down, 0.5, base)),
        ("probe + lycoris C++ autograd", lambda: lycoris_ag(x, up, down, 0.5, base)),
        ("probe + lycoris C++ autograd, need grad", lambda: lycoris_ag(x, upg, downg, 0.5, base)),
        ("eager LoRA formula, forward+backward", eager_fwd_bwd),
        ("lycoris.lora_bypass_fwd, forward+backward", op_fwd_bwd),
        ("lycoris.lora_bypass_fwd, f+b, Python backward", op_fwd_bwd_python_backward),
        ("probe + torch register_autograd, f+b", probe_fwd_bwd(torch_ag)),
        ("probe + lycoris Python autograd, f+b", probe_fwd_bwd(lycoris_py)),
        ("probe + lycoris C++ autograd, f+b", probe_fwd_bwd(lycoris_ag)),
        ("plain autograd.Function (t*1), f+b", function_fwd_bwd),
    ]
    ref = None
    seen = {}
    print(f"host us/call on {dev} (torch {torch.__version__}, {args.calls} calls each)")
    for name, fn in rows:
        us = seen[name] = per_call_us(fn, args.calls, sync)
        ref = ref or us
        print(f"  {name:45s} {us:8.1f} us  ({us / ref:5.1f}x torch.add)")
    eager = seen["eager LoRA formula, forward+backward"]
    print(f"forward+backward x eager formula: {seen['lycoris.lora_bypass_fwd, forward+backward'] / eager:.2f} "
          f"(Python backward: {seen['lycoris.lora_bypass_fwd, f+b, Python backward'] / eager:.2f})")


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


def ops(dev, calls, rounds=5):
    """Host time per call of each of the 23 ops on its first (tiny) test case, bf16 on
    CUDA (fp32 on CPU), no gradient, next to one torch.add in the same process. The rounds
    interleave: each round times torch.add, the yardsticks and every op once, and each keeps
    its best round, so a slow spell of the shared machine (seen lasting about a second)
    slows one round of everything instead of a few ops' every round."""
    from lycoris_ops import OP_NAMES

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    first = _first_cases(dev, dtype)
    a, b = torch.randn(4, 4, device=dev), torch.randn(4, 4, device=dev)
    w, bias = torch.ones(4, device=dev), torch.zeros(4, device=dev)
    # yardsticks: what each further output costs an ATen op of one launch (its allocation,
    # its tensor, its free), and one bare allocation
    fns = {"torch.add": lambda: torch.add(a, b, alpha=0.5),
           "torch.empty_like": lambda: torch.empty_like(a),
           "aminmax (2 outputs)": lambda: torch.aminmax(a, dim=0),
           "native_layer_norm (3)": lambda: torch.ops.aten.native_layer_norm(a, [4], w, bias, 1e-5)}
    fns.update((op, first[op]) for op in OP_NAMES if op in first)
    best = dict.fromkeys(fns, float("inf"))
    with torch.no_grad():
        for fn in fns.values():
            per_call_us(fn, 200, sync, rounds=1, warmup=0)
        for _ in range(rounds):
            for name, fn in fns.items():
                best[name] = min(best[name], per_call_us(fn, max(1, calls // rounds), sync, rounds=1, warmup=20))
    ref = best["torch.add"]
    print(f"host us/call on {dev} (torch {torch.__version__}, {calls} calls each, best of {rounds} interleaved rounds,"
          " no grad)")
    print(f"  {'torch.add':22s} {ref:8.1f} us")
    stats = getattr(__import__("lycoris_ops")._C, "_launch_plan_stats", None) if dev.type == "cuda" else None
    with torch.no_grad():
        for name, fn in fns.items():
            if name == "torch.add":
                continue
            us = best[name]
            extra, label = "", getattr(fn, "id", "")
            if dev.type == "cuda" and name in first:  # what one (replayed) call does: outputs, launches, plan
                plan = stats(f"lycoris::{name}") if stats else ("-", "-", "-")
                out = fn()
                k = len(out) if isinstance(out, tuple) else 1
                extra = f"  outputs {k}  launches {_launches(fn)}  plan seen/replayed/python {plan}"
            print(f"  {name:22s} {us:8.1f} us  ({us / ref:5.1f}x torch.add)  {label}{extra}".rstrip())


def _first_cases(dev, dtype):
    """{op: its first test case with tensors, moved to ``dev`` in ``dtype``}."""
    from lycoris_ops.testing import cases

    first = {}
    for case in cases():
        if case.tensors() and case.op not in first:
            first[case.op] = case.to(device=dev, dtype=dtype)
    return first


def _launches(call) -> str:
    """The kernel launches of one ``call()`` (torch.profiler): ``"<n> [name, ...]"``, the
    driver/runtime launch calls on the CPU side, then the device kernels' names."""
    import warnings
    from torch.profiler import ProfilerActivity, profile
    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = prof.events()
    n = sum(e.name in ("cuLaunchKernel", "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
            for e in events)
    kernels = [e.name[:28] for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return f"{n} {kernels}"


def why(names):
    """Per op: the CPU events of 300 replayed calls (its first bf16 test case), by self time."""
    from torch.profiler import ProfilerActivity, profile

    first = _first_cases(torch.device("cuda"), torch.bfloat16)
    for op in names:
        call = first[op]
        with torch.no_grad():
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(300):
                    call()
                torch.cuda.synchronize()
        print(f"== {op} ({call.id}): CPU events of 300 calls, us per call")
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        for e in rows:
            print(f"  {e.key[:40]:40s} calls/op {e.count / 300:5.1f}  self {e.self_cpu_time_total / 300:7.2f}  "
                  f"total {e.cpu_time_total / 300:7.2f}")


def plans():
    """Every op's bf16 test cases called four times each on CUDA (the third call of a
    signature is recorded), then per op: signatures seen, replayed from a plan, kept in
    Python, and the last reason a signature got no plan (csrc/launch.cpp)."""
    from lycoris_ops import OP_NAMES, _C
    from lycoris_ops._library import launch_record as _launch_record, register as registry
    from lycoris_ops.testing import cases

    if not (torch.cuda.is_available() and registry.replay_enabled()):
        print("no replay: needs CUDA and _C built with its CUDA launch path (LYCORIS_KERNEL_REPLAY not 0)")
        return
    for case in cases():
        if case.tensors():
            run = case.to(device="cuda", dtype=torch.bfloat16)
            for _ in range(4):
                run.to()()
    print("op                     seen  replayed  python  why not")
    for op in OP_NAMES:
        seen, planned, python = _C._launch_plan_stats(f"lycoris::{op}")
        print(f"  {op:20s} {seen:5d} {planned:9d} {python:7d}  {_launch_record.refusals.get(op, '')}")


def specs(dev, calls):
    """bench.py's host section, one row per spec: the op's forward on the tiny geometry with
    inputs that require grad (as the benchmark calls it), its host time next to torch.add's,
    whether its signature replays from a C++ plan (and the recorder's reason when not), and
    the tuner's pick for the key (rows of the tuning table this process wrote)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import specs as S  # noqa: E402
    import timing as T  # noqa: E402

    from lycoris_ops import _C
    from lycoris_ops._library import launch_record as _launch_record
    from lycoris_ops.tuner import tune

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    geo, gen = S.SHAPES["tiny"], torch.Generator().manual_seed(0)  # specs draw on the CPU, then move
    a, b = torch.randn(geo.N, geo.D, device=dev), torch.randn(geo.N, geo.D, device=dev)
    ref = T.host_time(lambda: torch.add(a, b), dev, n=50, rounds=max(5, calls // 50)) * 1e6
    replay = dev.type == "cuda" and hasattr(_C, "_launch_plan_stats")
    print(f"host us/call, bench specs at N{geo.N} D{geo.D} r{geo.r} {dtype} (inputs require grad); "
          f"torch.add {ref:.1f} us")
    print(f"  {'spec':18s} {'us':>7s} {'/add':>5s}  seen replayed python  why not / tuner's pick")
    for spec in S.SPECS:
        inp = spec.build(geo, dtype, dev, gen)
        ts = [t.requires_grad_(k in spec.grads) for k, t in inp.items()]
        # bench.py's measure: 50 calls a round, few enough that the launch queue never fills
        # (thousands back to back time the GPU for a multi-launch op, not the host)
        us = T.host_time(lambda: spec.ours(*ts), dev, n=50, rounds=max(5, calls // 50)) * 1e6
        stats = _C._launch_plan_stats(f"lycoris::{spec.op}") if replay else ("-", "-", "-")
        why = _launch_record.refusals.get(spec.op, "")
        picks = [f"{k.split('|')[2]}={_pick_label(r.get('config'))}" for k, r in tune.table().rows.items()
                 if f"|{spec.op}|" in k]
        print(f"  {spec.name:18s} {us:7.1f} {us / ref:5.2f}  {stats[0]:>4} {stats[1]:>8} {stats[2]:>6}  "
              f"{why} {'; '.join(picks)}")


def _pick_label(c):
    return c if isinstance(c, str) else ",".join(f"{k}={v}" for k, v in (c or {}).items())


def forward_backward(dev, calls, rounds=7):
    """Forward+backward host time of the three bypass ops next to their eager formulas, on
    tiny tensors, every variant once per round (rounds interleaved, so a drift of the
    shared host hits all alike; best round each): ours with the direct C++ backward, ours
    with the Python backward (``direct_backward(False)``), the eager formula."""
    L = torch.ops.lycoris
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)

    def t(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dev).requires_grad_(grad)

    x, base = t(16, 64), t(16, 64)
    up, down = t(64, 8, grad=True), t(8, 64, grad=True)
    a1, b1, a2, b2 = t(64, 8, grad=True), t(8, 64, grad=True), t(64, 8, grad=True), t(8, 64, grad=True)
    w1, w2 = t(4, 4, grad=True), t(16, 16, grad=True)
    forms = {
        "lora_bypass": (lambda: L.lora_bypass_fwd(x, up, down, 0.5, base),
                        lambda: base + 0.5 * F.linear(F.linear(x, down), up)),
        "loha_bypass": (lambda: L.loha_bypass_fwd(x, a1, b1, a2, b2, 0.5, base),
                        lambda: base + 0.5 * F.linear(x, (a1 @ b1) * (a2 @ b2))),
        "lokr_bypass": (lambda: L.lokr_bypass_fwd(x, w1, w2, 0.5, base),
                        lambda: base + 0.5 * F.linear(x, torch.kron(w1, w2))),
    }

    def fb(f):
        return lambda: f().sum().backward()

    def python_backward(f):
        def run():
            with direct_backward(False):
                f().sum().backward()
        return run

    variants = {}
    for name, (ours, eager) in forms.items():
        variants[(name, "direct")] = fb(ours)
        variants[(name, "python")] = python_backward(ours)
        variants[(name, "eager")] = fb(eager)
    best = {k: float("inf") for k in variants}
    for fn in variants.values():  # warm: tuning, JIT, replay plans
        for _ in range(20):
            fn()
    sync()
    n = max(1, calls // rounds)
    for _ in range(rounds):
        for k, fn in variants.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            best[k] = min(best[k], (time.perf_counter() - t0) / n * 1e6)
    print(f"host us per forward+backward on {dev} (torch {torch.__version__}, {rounds} interleaved rounds of {n}, "
          f"best each)")
    print(f"  {'op':14s} {'eager':>8s} {'ours':>8s} {'x eager':>8s} {'Python bwd':>11s} {'x eager':>8s}")
    for name in forms:
        e, d, p = best[(name, "eager")], best[(name, "direct")], best[(name, "python")]
        print(f"  {name:14s} {e:8.1f} {d:8.1f} {d / e:8.2f} {p:11.1f} {p / e:8.2f}")


def layers(dev, calls, rounds=5):
    """Forward+backward host time of adapter layers on a (16, 64) input, rank 8."""
    from lycoris_ops import nn as lnn

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    x = torch.randn(16, 64, device=dev)
    rows = [("nn.Linear", torch.nn.Linear(64, 64)),
            ("lycoris_ops.nn.LoRALinear", lnn.LoRALinear(torch.nn.Linear(64, 64), rank=8)),
            ("lycoris_ops.nn.DoRALinear", lnn.DoRALinear(torch.nn.Linear(64, 64), rank=8))]
    try:
        from peft import LoraConfig, get_peft_model
        rows.append(("PEFT LoRA Linear, use_dora", get_peft_model(
            torch.nn.Sequential(torch.nn.Linear(64, 64)), LoraConfig(r=8, target_modules=["0"], use_dora=True))))
    except ImportError:
        pass
    print(f"host us per forward+backward on {dev} (torch {torch.__version__}, best of {rounds} rounds)")
    for name, layer in rows:
        layer = layer.to(dev)
        best = per_call_us(lambda: layer(x).sum().backward(), calls, sync, rounds, warmup=50)
        print(f"  {name:45s} {best:8.1f} us")


if __name__ == "__main__":
    main()
