"""Where an op's device time goes, kernel by kernel, on a GPU:

    python bench/kernel_profile.py --specs boft,lokr_bypass [--backend tilelang] [--shape large]

For each bench spec (``specs.py``: its inputs, γ, and the backward op it registers), the op
runs under one backend (``dispatch.use_backend``) until its tuner has picked (three warm-up
calls), then ``torch.profiler`` records one forward and one backward op call. The table
lists, per phase, each CUDA kernel (the TileLang / Triton kernels and torch's own: copies,
sums, cuBLAS) with its launches, its device time and its share of the phase, then the
phase's total against the memory floor of ``bench.py`` (bytes of the phase's inputs read
once and outputs written once, over the copy bandwidth measured here). A phase far above
its floor whose time sits in one kernel says which kernel to read next; one spread over
many launches says the pass structure is the cost.

``--smoke``: CPU tensors, tiny shape (the script runs; CI): the rows are CPU ops.

``--counters``: no torch.profiler; the recorded calls run between ``cudaProfilerStart`` and
``cudaProfilerStop`` instead, for Nsight Compute's hardware counters of just those kernels
(not the tuner's timing calls)::

    ncu --profile-from-start off --clock-control none --set detailed \
        python bench/kernel_profile.py --specs boft --shape small --backend triton --counters
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specs  # noqa: E402
import timing as T  # noqa: E402


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in (out or ()) if isinstance(t, torch.Tensor)]


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _phases(spec, inputs, G):
    """[(name, call, bytes of its floor)]: the forward op, and the backward op where the spec
    has one (its gradient G drawn like bench.py's)."""
    ts = list(inputs.values())
    out = spec.ours_all(*ts)
    phases = [("fwd", lambda: spec.ours_all(*ts), _bytes(ts) + _bytes(out))]
    if spec.bwd is not None:
        op, args = spec.bwd(*ts, G, out)
        fn = getattr(torch.ops.lycoris, op)
        res = fn(*args)
        phases.append(("bwd", lambda: fn(*args), _bytes([a for a in args if isinstance(a, torch.Tensor)])
                       + _bytes(_tensors(res))))
    return phases


def _kernel_rows(prof, cuda: bool):
    """(name, calls, µs) of the recorded events: on a GPU the device events (kernels, memcpy,
    memset: their own duration), on the CPU the ops' self time."""
    rows = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t = e.time_range.elapsed_us()
        else:
            t = e.self_cpu_time_total
        r = rows[e.name]
        r[0] += 1
        r[1] += t
    return sorted(((k, c, us) for k, (c, us) in rows.items() if us > 0), key=lambda r: -r[2])


def profile(spec, geo, dt, dev, backend, bw, top: int, counters: bool = False) -> None:
    from lycoris_ops.backends import registry as dispatch

    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = spec.build(geo, dt, dev, gen)
    first = spec.ours_all(*inputs.values())[0]
    G = torch.randn(first.shape, generator=gen).to(device=dev, dtype=first.dtype)
    cuda = dev.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with dispatch.use_backend(backend, strict=False):
        phases = _phases(spec, inputs, G)
        for _, call, _ in phases:  # the tuner picks on the first calls; time what it picked
            for _ in range(3):
                call()
        if cuda:
            torch.cuda.synchronize()
        for name, call, nbytes in phases:
            if counters:  # one call inside the CUDA profiler's range (ncu --profile-from-start off)
                torch.cuda.cudart().cudaProfilerStart()
                call()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                print(f"{spec.name} {geo.tag} {name}: one call in the profiler range")
                continue
            rows, total = _profiled(call, acts, cuda)
            floor = nbytes / bw * 1e6 if bw else float("nan")
            _print_table(f"{spec.name} {geo.tag} {str(dt).replace('torch.', '')} {backend} {name}: "
                         f"{total:.1f} µs in {sum(c for _, c, _ in rows)} {'kernels' if cuda else 'ops'}, "
                         f"floor {floor:.1f} µs ({total / floor:.2f}x)", rows, total, top)


def _profiled(call, acts, cuda: bool):
    """(rows of ``_kernel_rows``, their total µs) of one profiled call."""
    with torch.profiler.profile(activities=acts) as prof:
        call()
        if cuda:
            torch.cuda.synchronize()
    rows = _kernel_rows(prof, cuda)
    return rows, sum(us for _, _, us in rows) or float("nan")


def _print_table(head: str, rows, total: float, top: int) -> None:
    print(f"\n{head}")
    for k, c, us in rows[:top]:
        print(f"  {us:9.1f} µs {us / total:6.1%} {c:4d}x  {k[:110]}")


def profile_peer(spec, geo, dt, dev, top: int) -> None:
    """The same table for lycoris-lora 4.1.3 (the bench's peer reading of the spec, picked as
    ``peer_lycoris`` picks it): its forward under no_grad, and forward+backward through
    autograd (the bench's f+b column), one profiled call each after three warm ones."""
    import peer_lycoris as PL

    from lycoris.functional import boft, diag_oft, general, locon, loha, lokr

    cands = PL.peer_candidates((locon, loha, lokr, diag_oft, boft, general)).get(spec.name)
    if not cands:
        print(f"\n{spec.name}: no lycoris-lora reading")
        return
    gen = torch.Generator(device="cpu").manual_seed(0)
    inp = spec.build(geo, dt, dev, gen)
    ts = [t.requires_grad_(k in spec.grads) for k, t in inp.items()]
    targets = [t for k, t in zip(inp, ts) if k in spec.grads]
    with torch.no_grad():
        want = spec.eager(*ts)
    fn, err, note, _ = PL._pick(cands, ts, want, dt, targets, dev)
    if fn is None:
        print(f"\n{spec.name}: peer {note}")
        return
    G = torch.randn(want.shape, generator=gen).to(device=dev, dtype=want.dtype)

    def fwd():
        with torch.no_grad():
            return fn(*ts)

    phases = [("fwd", fwd), ("f+b", lambda: torch.autograd.grad(fn(*ts), targets, G))]
    for name, call in phases:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        rows, total = _profiled(call, [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                True)
        _print_table(f"{spec.name} {geo.tag} {str(dt).replace('torch.', '')} lycoris-lora ({note}) {name}: "
                     f"{total:.1f} µs in {sum(c for _, c, _ in rows)} kernels", rows, total, top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", default="boft,lokr_bypass,lora_bypass")
    ap.add_argument("--backend", default="tilelang", help="a backend name of dispatch (tilelang, triton, ...)")
    ap.add_argument("--shape", "--shapes", dest="shape", default="large", choices=tuple(specs.SHAPES),
                    help="one bench shape (--shapes: the variants scripts' spelling, gpu_variants.sh)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--top", type=int, default=12, help="kernels listed per phase")
    ap.add_argument("--smoke", action="store_true", help="CPU tensors, tiny shape: the script runs")
    ap.add_argument("--counters", action="store_true",
                    help="run the recorded calls inside cudaProfilerStart/Stop (under ncu), not torch.profiler")
    ap.add_argument("--peer", action="store_true",
                    help="also lycoris-lora's forward and forward+backward, in a process of its own (it registers "
                         "ops of the same namespace; LYCORIS_PEER_PATH: where it is installed)")
    ap.add_argument("--peer-only", action="store_true", help=argparse.SUPPRESS)  # that process
    args = ap.parse_args(argv)
    if args.peer_only:
        if os.environ.get("LYCORIS_PEER_PATH"):
            sys.path.append(os.environ["LYCORIS_PEER_PATH"])
        dev = torch.device("cuda")
        for name in args.specs.split(","):
            profile_peer(specs.BY_NAME[name], specs.SHAPES[args.shape], specs.DTYPES[args.dtype], dev, args.top)
        return 0
    import lycoris_ops  # noqa: F401  (registers torch.ops.lycoris)

    dev = torch.device("cpu" if args.smoke else "cuda")
    geo = specs.SHAPES["tiny" if args.smoke else args.shape]
    dt = torch.float32 if args.smoke else specs.DTYPES[args.dtype]
    backend = "torch" if args.smoke else args.backend
    bw = None if args.smoke else T.copy_bandwidth(dev)
    if bw:
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for name in args.specs.split(","):
        profile(specs.BY_NAME[name], geo, dt, dev, backend, bw, args.top, args.counters and dev.type == "cuda")
    if args.peer and dev.type == "cuda":
        sys.stdout.flush()
        subprocess.run([sys.executable, os.path.abspath(__file__), "--peer-only", "--specs", args.specs,
                        "--shape", args.shape, "--dtype", args.dtype, "--top", str(args.top)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
