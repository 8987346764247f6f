"""Compile, for a GPU arch and without a GPU, every TileLang kernel that the op test-case
tables (``lycoris_ops.testing``: odd sizes, every layout and flag) build with the fixed
launch configs: the kernels a user's first call builds under ``LYCORIS_KERNEL_TUNE=off``.

The GPU tests run only a few sizes per op; TileLang's lowering and nvcc have refused
kernels at sizes no test used (LoKr's Kronecker build at d = 150). This sweep compiles them all; each failure is printed with the compiler's
error line. No GPU needed (nvcc on PATH); a long run with an empty TileLang cache (hundreds of
kernels, several seconds each).

    python bench/tilelang_compile_sweep.py [--arch sm_90a] [--procs 2] [--dtypes bf16,fp16]
        [--ops oft_fwd,boft] [--top 10] [--shortlists] [--list]

``--shortlists``: also every kernel of the tuner's shortlist for each case (the op's tuning
space in ``backends/tilelang/tuning/<family>.py`` with an H200's facts,
``tuner.device.synthetic``): the configs a tuned first call builds (several times the
kernels; it found the sm_90a WGMMA tile rule of ``kernels/lokr._warps_cover``). ``--list``:
print the kernels and compile none.

``--ops`` keeps the cases of ops whose names start with one of the given prefixes;
``--top`` lists the slowest kernels (seconds in one process each: TileLang's lowering,
nvcc and the disk-cache export; with --procs > 1 they share the cores).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def pending_kernels(arch: str, dtypes, ops=(), shortlists: bool = False):
    """(builder, arch, args) of every distinct kernel the in-scope test cases build (with the
    fixed configs; ``shortlists``: also with each config of the tuner's shortlist)."""
    import lycoris_ops  # noqa: F401  (registers the ops)
    from lycoris_ops.backends import scope
    from lycoris_ops import testing
    from lycoris_ops.backends.tilelang import runner as tl_pick
    from lycoris_ops.tuner import tune
    from lycoris_ops.tuner.device import synthetic
    from lycoris_ops.backends.tilelang import common as _common

    kernel_modules = [m for n, m in sys.modules.items() if n.startswith("lycoris_ops.backends.tilelang.kernels.")]
    for mod in kernel_modules:  # the launchers see a GPU of this arch (132 SMs: an H200's split choices)
        if hasattr(mod, "arch_of"):
            mod.arch_of = lambda d: arch
        if hasattr(mod, "num_sms"):
            mod.num_sms = lambda d: 132
    calls = [(c.op, c.id, c.args) for dt in dtypes for c in testing.cases(dtype=dt)
             if scope.supported(c.op, "tilelang", c.args) and (not ops or c.op.startswith(tuple(ops)))]
    h200 = synthetic()
    with _common.capturing() as pending:
        for op, cid, args in calls:
            cfgs = [{}]
            if shortlists and op in tl_pick.models():
                try:
                    cfgs += [c for c in tl_pick.models()[op][0](h200, *args) if not tune.is_eager(c) and c]
                except Exception as exc:  # a model that fails on a case the op accepts
                    print(f"MODEL ERROR {op}:{cid}: {type(exc).__name__}: {exc}", flush=True)
            for cfg in cfgs:
                try:
                    tl_pick._call(tl_pick.LAUNCHERS[op], args, cfg)
                except Exception as exc:  # a launcher that fails before any build
                    print(f"LAUNCH ERROR {op}:{cid} {cfg or ''}: {type(exc).__name__}: {exc}", flush=True)
    print(f"{len(calls)} in-scope cases, {len(pending)} distinct kernels", flush=True)
    return [(p.builder, p.arch, p.args) for p in pending]


def _compile(item):
    from lycoris_ops.backends.tilelang import common as _common

    builder, arch, args = item
    t0 = time.perf_counter()
    try:
        _common.compile_only(builder, arch, *args)
        return builder.__name__, args, None, time.perf_counter() - t0
    except Exception as exc:
        return builder.__name__, args, _common._first_error(str(exc)), time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--procs", type=int, default=max(1, (os.cpu_count() or 2)))
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--ops", default="", help="comma-separated op-name prefixes (default: every op)")
    ap.add_argument("--top", type=int, default=0, help="list the N slowest kernels")
    ap.add_argument("--shortlists", action="store_true", help="also the tuner's shortlist configs of each case")
    ap.add_argument("--list", action="store_true", help="print the kernels, compile none")
    opts = ap.parse_args(argv)
    items = pending_kernels(opts.arch, [DTYPES[d] for d in opts.dtypes.split(",")],
                            [o for o in opts.ops.split(",") if o], opts.shortlists)
    if opts.list:
        for builder, _, args in items:
            print(f"{builder.__name__}{args}")
        return 0
    t0, failed, times = time.perf_counter(), [], []
    with multiprocessing.get_context("fork").Pool(opts.procs) as pool:
        for i, (name, args, err, s) in enumerate(pool.imap_unordered(_compile, items), 1):
            times.append((s, f"{name}{args}"))
            if err is not None:
                failed.append(name)
                print(f"FAIL {name}{args}: {err}", flush=True)
            if i % 25 == 0:
                print(f"[{i}/{len(items)}] {time.perf_counter() - t0:.0f} s", flush=True)
    times.sort(reverse=True)
    slowest = times[0] if times else (0.0, "")
    print(f"{len(items)} kernels for {opts.arch} in {time.perf_counter() - t0:.0f} s, {len(failed)} failed; "
          f"slowest {slowest[0]:.1f} s: {slowest[1]}")
    if times:
        print(f"per kernel: median {times[len(times) // 2][0]:.1f} s")
    for s, what in times[:opts.top]:
        print(f"  {s:6.1f} s  {what}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
