"""Where an op's host time goes, layer by layer, on tiny CUDA tensors (GPU idle).

For each op named, one call is traced to record the Triton launches it makes
(``JITFunction.run`` is wrapped while tracing), then these are timed per call:

* ``op``            torch.ops.lycoris.<op> (autograd kernel, no input needs grad)
* ``below autograd`` the op under ``_AutoDispatchBelowAutograd`` (dispatcher -> our CUDA kernel)
* ``select kernel`` our registered CUDA kernel function, called from Python
* ``op set``        ``lycoris_ops.backends.triton.ops.<op>`` (tuner lookup + launcher)
* ``jit launches``  the recorded ``kernel[grid](...)`` calls replayed (Triton's binder + launch)
* ``direct``        the same compiled kernels launched through ``CompiledKernel.run``
* ``torch.add``     the yardstick

then a cProfile of the op (top functions by own time; ``--top 0``: none). Last, the
forward+backward of ``lora_bypass_fwd`` in pieces: the forward with factors that need
grad, ``.sum().backward()`` whole, and the backward op alone with the gradient autograd
hands it (``sum``'s expanded ones: zero strides) and with a contiguous one, with the
tier each takes, forward+backward through ``autograd.grad``, the backward alone of a
retained graph, and the backward op called from another Python thread. Prints
microseconds per call.

    python bench/host_profile.py [--ops lora_bypass_fwd,add_scaled] [--calls 2000]
"""
import argparse
import cProfile
import io
import pstats
import time

import torch


def per_call_us(fn, calls, rounds=5):
    """Host µs per call: the best of ``rounds`` rounds (the host is shared and noisy)."""
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    n = max(1, calls // rounds)
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def record_launches(call):
    """[(jit_function, grid, args, kwargs, compiled kernel)] of one ``call()``."""
    from triton.runtime.jit import JITFunction

    seen, original = [], JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        if not warmup:
            seen.append((self, grid, args, dict(kwargs), kernel))
        return kernel

    JITFunction.run = run
    try:
        call()
    finally:
        JITFunction.run = original
    return seen


def direct_launchers(seen):
    """Callables launching each recorded compiled kernel with no binding step."""
    out = []
    for jit, grid, args, kwargs, kernel in seen:
        values = list(args)
        for p in jit.params[len(args):]:
            values.append(kwargs[p.name] if p.name in kwargs else p.default)
        g = tuple(grid(dict(zip(jit.arg_names, values)))) if callable(grid) else tuple(grid)
        g = g + (1,) * (3 - len(g))
        dev = torch.cuda.current_device()
        raw_stream = torch._C._cuda_getCurrentRawStream
        kernel._init_handles()

        def launch(kernel=kernel, g=g, values=values):
            kernel.run(g[0], g[1], g[2], raw_stream(dev), kernel.function, kernel.packed_metadata,
                       None, None, None, *values)
        out.append(launch)
    return out


def op_args(op):
    """Tiny bf16 operands of ``op`` (T=16 tokens, 64 features, rank 8)."""
    def t(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    x, g, base = t(16, 64), t(16, 64), t(16, 64)
    up, down = t(64, 8), t(8, 64)
    return {
        "lora_bypass_fwd": (x, up, down, 0.5, base),
        "lora_bypass_bwd": (g, x, up, down, 0.5),
        "add_scaled": (base, x, 0.5),
        "ia3_fwd": (x, t(64), 1, 1.0, 0.5),
        "lokr_bypass_fwd": (x, t(8, 8), t(8, 8), 0.5, base),
        "lokr_bypass_bwd": (g, x, t(8, 8), t(8, 8), 0.5),
    }[op]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="lora_bypass_fwd,lora_bypass_bwd,add_scaled,ia3_fwd,lokr_bypass_fwd")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--trace", action="store_true",
                    help="only a torch.profiler table (CPU, both threads) of lora_bypass_fwd forward+backward")
    args = ap.parse_args()
    import lycoris_ops  # noqa: F401
    from lycoris_ops.backends import select
    from lycoris_ops.backends.triton import ops as triton_ops

    if args.trace:
        return trace_forward_backward()
    a, b = torch.randn(4, 4, device="cuda"), torch.randn(4, 4, device="cuda")
    add_us = per_call_us(lambda: torch.add(a, b), args.calls)
    print(f"torch.add {add_us:.1f} us")
    kernels = {s.op: s.fn for s in select._states if s.fn.__qualname__.startswith("cuda_kernel.")}
    for op in args.ops.split(","):
        call_args = op_args(op)
        packet = getattr(torch.ops.lycoris, op).default
        fn_op = lambda: packet(*call_args)  # noqa: E731
        fn_op()
        seen = record_launches(fn_op)
        jit_calls = [(lambda j=j, g=g, a=a_, k=k: j[g](*a, **k)) for j, g, a_, k, _ in seen]
        direct = direct_launchers(seen)

        def below():
            with torch._C._AutoDispatchBelowAutograd():
                return packet(*call_args)

        rows = [
            ("op", fn_op),
            ("below autograd", below),
            ("select kernel", lambda: kernels[op](*call_args)),
            ("op set", lambda: getattr(triton_ops, op)(*call_args)),
            (f"jit launches ({len(seen)})", lambda: [c() for c in jit_calls]),
            (f"direct ({len(direct)})", lambda: [c() for c in direct]),
        ]
        print(f"\n== {op}  (tier: {select.explain(op, *call_args)})")
        for name, fn in rows:
            us = per_call_us(fn, args.calls)
            print(f"  {name:<22} {us:8.1f} us  {us / add_us:6.1f}x torch.add")
        if args.top <= 0:
            continue
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn_op()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
        start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
        print("\n".join(lines[start:start + args.top + 1]))
    forward_backward(args.calls, add_us)


def forward_backward(calls, add_us):
    """lora_bypass_fwd forward+backward in pieces (see the module docstring)."""
    from lycoris_ops.backends import select

    x, up, down, _, base = op_args("lora_bypass_fwd")
    upg, downg = up.clone().requires_grad_(), down.clone().requires_grad_()
    op, bwd = torch.ops.lycoris.lora_bypass_fwd, torch.ops.lycoris.lora_bypass_bwd
    expanded = torch.ones((), device="cuda", dtype=x.dtype).expand(x.shape[0], up.shape[0])
    dense = expanded.contiguous()
    F = torch.nn.functional
    rows = [
        ("eager formula f+b", lambda: (base + 0.5 * F.linear(F.linear(x, downg), upg)).sum().backward()),
        ("op forward, factors need grad", lambda: op(x, upg, downg, 0.5, base)),
        ("op f+b (.sum().backward())", lambda: op(x, upg, downg, 0.5, base).sum().backward()),
        (f"bwd op, expanded grad [{select.explain('lora_bypass_bwd', expanded, x, up, down, 0.5)}]",
         lambda: bwd(expanded, x, up, down, 0.5)),
        (f"bwd op, contiguous grad [{select.explain('lora_bypass_bwd', dense, x, up, down, 0.5)}]",
         lambda: bwd(dense, x, up, down, 0.5)),
        ("op f+b (autograd.grad, contiguous grad)",
         lambda: torch.autograd.grad(op(x, upg, downg, 0.5, base), (upg, downg), dense)),
    ]
    retained = op(x, upg, downg, 0.5, base)
    rows.append(("backward alone of a retained graph",
                 lambda: torch.autograd.grad(retained, (upg, downg), dense, retain_graph=True)))
    print("\n== lora_bypass_fwd forward+backward")
    for name, fn in rows:
        us = per_call_us(fn, calls)
        print(f"  {name:<44} {us:8.1f} us  {us / add_us:6.1f}x torch.add")
    # the same backward op timed from another Python thread (the engine runs backward on one)
    import threading
    out = []
    thread = threading.Thread(target=lambda: out.append(per_call_us(lambda: bwd(dense, x, up, down, 0.5), calls)))
    thread.start()
    thread.join()
    print(f"  {'bwd op, contiguous grad, another thread':<44} {out[0]:8.1f} us  {out[0] / add_us:6.1f}x torch.add")


def trace_forward_backward(iters=200, top=30):
    """torch.profiler's CPU table (the autograd engine's device thread included) of the
    op's forward+backward, then of the eager formula's."""
    from torch.profiler import ProfilerActivity, profile

    x, up, down, _, base = op_args("lora_bypass_fwd")
    upg, downg = up.clone().requires_grad_(), down.clone().requires_grad_()
    op = torch.ops.lycoris.lora_bypass_fwd
    F = torch.nn.functional
    for name, fn in (("op", lambda: op(x, upg, downg, 0.5, base).sum().backward()),
                     ("eager", lambda: (base + 0.5 * F.linear(F.linear(x, downg), upg)).sum().backward())):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / iters * 1e6
        print(f"\n== {name} forward+backward: {wall:.1f} us per iteration under the profiler")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=70))


if __name__ == "__main__":
    main()
