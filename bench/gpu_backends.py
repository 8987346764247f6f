"""GPU check of backend selection: every case of ``lycoris_ops.testing.cases()`` on
CUDA, under each ``LYCORIS_KERNEL_BACKEND`` value, against the CPU result; then each
op inside ``torch.compile(fullgraph=True)`` (no graph break, the op opaque in the
graph), again under each backend value without recompiling.

    python bench/gpu_backends.py                      # all families, fp32/bf16/fp16
    python bench/gpu_backends.py --families lora,ia3 --dtypes float32 --no-graph
    python bench/gpu_backends.py --device cpu --compile-backend eager   # dry run without a GPU

One process; the backend is switched with ``lycoris_ops.set_backend``. Prints one
line per (case, dtype): for each backend value the tier that ran and ok/FAIL,
then the compiled-graph result. Exit status: 0 all equal, 1 a mismatch or an
error, 2 nothing ran.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter

import torch

import lycoris_ops
from lycoris_ops.backends import registry as dispatch, select
from lycoris_ops import testing

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def _outputs(out):
    return out if isinstance(out, (tuple, list)) else (out,)


def compare(got, want, dtype, tol_scale):
    """None when every output matches (shape, dtype, values within tolerance), else why."""
    got, want = _outputs(got), _outputs(want)
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
            return f"out{i} {tuple(g.shape)} {g.dtype}, expected {tuple(w.shape)} {w.dtype}"
        if w.numel() == 0:
            continue
        if not bool(torch.isfinite(g.detach().float().cpu()).all()) and bool(torch.isfinite(w.float()).all()):
            return f"out{i} not finite"
        # the compute dtype of the case bounds the error, whatever the output dtype
        tol = tol_scale * max(testing.REL_TOL.get(w.dtype, 0.0), testing.REL_TOL[dtype])
        err = testing.rel_err(g, w)
        if err > tol:
            return f"out{i} rel_err {err:.2e} > {tol:.1e}"
    return None


def _graph_fn(case, index):
    """A fresh function (its own code object, so Dynamo caches never collide) taking
    the case's tensors; the non-tensor arguments are constants of the graph."""
    slots = [i for i, a in enumerate(case.args) if isinstance(a, torch.Tensor)]
    consts = list(case.args)
    src = (f"def case_{index}(*tensors):\n"
           f"    args = list(consts)\n"
           f"    for i, t in zip(slots, tensors):\n"
           f"        args[i] = t\n"
           f"    return op(*args)\n")
    ns = {"consts": consts, "slots": slots, "op": getattr(torch.ops.lycoris, case.op)}
    exec(compile(src, f"<gpu_backends case {index}>", "exec"), ns)
    return ns[f"case_{index}"], [case.args[i] for i in slots]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--families", default=",".join(testing.FAMILIES))
    ap.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--backends", default=",".join(dispatch.valid_values()))
    ap.add_argument("--no-graph", action="store_true", help="skip the torch.compile(fullgraph=True) check")
    ap.add_argument("--graph-dtypes", default="float32", help="dtypes for the compiled-graph check")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the graph check")
    ap.add_argument("--tol-scale", type=float, default=2.0, help="tolerance = scale x testing.REL_TOL[dtype]")
    ap.add_argument("--max-seconds", type=float, default=540.0, help="stop starting new cases after this")
    ap.add_argument("-v", "--verbose", action="store_true")
    opts = ap.parse_args(argv)

    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    ops = set(filter(None, opts.ops.split(",")))
    backends = [b for b in opts.backends.split(",") if b]
    dtypes = [DTYPES[d] for d in opts.dtypes.split(",") if d]
    graph_dtypes = {DTYPES[d] for d in opts.graph_dtypes.split(",") if d}
    start = time.time()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"lycoris_ops {lycoris_ops.__version__}, torch {torch.__version__}, device {device} ({name})")
    print(f"available: {', '.join(dispatch.available_backends(device))}; fused op sets: "
          + ", ".join(f"{n} ({sum(getattr(dispatch.opset(n), op, None) is not None for op in lycoris_ops.OP_NAMES)}"
                      f" ops)" for n in dispatch.fused_backends()))
    usable = [b for b in backends if b == "auto" or dispatch._probe(b)]
    for b in backends:
        if b not in usable:
            print(f"backend {b}: not available here ({dispatch.probe_error(b)}): column shows n/a")

    failures, rows, tiers = [], 0, Counter()
    caught = []
    graph_breaks = torch._dynamo.utils.counters["graph_break"]
    header = f"{'op / case':44s} {'dtype':8s} " + " ".join(f"{b:>16s}" for b in backends) + "  graph      s"
    print(header)
    print("-" * len(header))
    index = 0
    stopped = False
    for fam in opts.families.split(","):
        for dtype in dtypes:
            try:
                cases = testing.cases(fam, dtype=dtype)
            except Exception as exc:
                failures.append(f"{fam} {dtype}: case table failed: {type(exc).__name__}: {exc}")
                print(f"{fam:44s} {str(dtype)[6:]:8s} case table failed: {type(exc).__name__}: {exc}")
                continue
            for case in cases:
                if ops and case.op not in ops:
                    continue
                if time.time() - start > opts.max_seconds:
                    stopped = True
                    break
                index += 1
                label = f"{case.op}/{case.id}"[:44]
                case_start = time.time()
                cells, notes = [], []
                try:
                    want = case()  # the CPU kernel (eager body)
                except Exception as exc:
                    print(f"{label:44s} {str(dtype)[6:]:8s} CPU reference failed: {type(exc).__name__}: {exc}")
                    failures.append(f"{label} {dtype}: CPU reference failed: {exc}")
                    continue
                gcase = case.to(device=device)
                for b in backends:
                    if b not in usable:
                        cells.append("n/a")
                        continue
                    dispatch.set_backend(b)
                    try:
                        with warnings.catch_warnings(record=True) as w:
                            warnings.simplefilter("always")
                            got = gcase()
                            if device.type == "cuda":
                                torch.cuda.synchronize(device)
                        caught.extend(str(x.message) for x in w)
                        tier = select.explain(case.op, *gcase.args)
                        why = compare(got, want, dtype, opts.tol_scale)
                    except Exception as exc:
                        tier, why = "?", f"{type(exc).__name__}: {str(exc)[:200]}"
                    tiers[(b, tier)] += 1
                    cells.append(f"{tier}:{'ok' if why is None else 'FAIL'}")
                    if why is not None:
                        notes.append(f"{b}: {why}")
                        failures.append(f"{label} {dtype} backend={b}: {why}")
                graph = "-"
                if not opts.no_graph and dtype in graph_dtypes:
                    graph = _graph_check(case, gcase, want, dtype, index, backends, usable, opts, notes, failures,
                                         label, device)
                rows += 1
                print(f"{label:44s} {str(dtype)[6:]:8s} " + " ".join(f"{c:>16s}" for c in cells)
                      + f"  {graph:5s} {time.time() - case_start:6.1f}")  # the case's seconds: first calls tune
                for n in notes:
                    print(f"    {n}")
            if stopped:
                break
        if stopped:
            break
    dispatch.set_backend("auto")

    print("-" * len(header))
    print(f"{rows} case runs in {time.time() - start:.0f} s; graph breaks: {sum(graph_breaks.values())}")
    for reason, n in sorted(graph_breaks.items(), key=lambda kv: -kv[1])[:3]:  # where they come from
        print(f"  graph break x{n}: {str(reason)[:240]}")
    for b in backends:
        took = {t: n for (bb, t), n in tiers.items() if bb == b}
        if took:
            print(f"  {b:9s} ran as: " + ", ".join(f"{t} x{n}" for t, n in sorted(took.items())))
    if "tilelang" in backends:
        from lycoris_ops.backends.tilelang import common as tl_common
        st = tl_common.stats()
        print(f"  tilelang kernels built in this process: {st['kernels']} in {st['build_s']:.1f} s "
              f"(compiles, or loads from TileLang's disk cache)")
    for (bk, dev), err in dispatch.demotions().items():
        print(f"  DEMOTED {bk} on {dev}: {err}")
    for msg in sorted(set(caught)):
        print(f"  warning: {msg[:300]}")
    if stopped:
        print(f"  stopped after --max-seconds={opts.max_seconds:.0f}: later cases not run")
    if failures:
        print(f"{len(failures)} FAILURES")
        for f in failures:
            print(f"  {f}")
        return 1
    if rows == 0:
        return 2
    print("all equal")
    return 0


def _graph_check(case, gcase, want, dtype, index, backends, usable, opts, notes, failures, label, device):
    """torch.compile(fullgraph=True) of a call of the op: compiled once, then run under
    every backend value (the choice happens inside the opaque op at run time)."""
    seen = []
    inner = torch._dynamo.lookup_backend(opts.compile_backend)

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return inner(gm, example_inputs)

    fn, tensors = _graph_fn(gcase, index)
    torch._dynamo.reset()  # every case compiles the same wrapper code: keep clear of the recompile limit
    try:
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        ok = 0
        for b in backends:
            if b not in usable:
                continue
            dispatch.set_backend(b)
            got = compiled(*tensors)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            why = compare(got, want, dtype, opts.tol_scale)
            if why is not None:
                notes.append(f"graph {b}: {why}")
                failures.append(f"{label} {dtype} compiled backend={b}: {why}")
            else:
                ok += 1
    except Exception as exc:
        why = f"{type(exc).__name__}: {str(exc)[:300]}"
        notes.append(f"graph: {why}")
        failures.append(f"{label} {dtype} compiled: {why}")
        return "FAIL"
    finally:
        dispatch.set_backend("auto")
    # fullgraph=True already raised on any break in this graph; Dynamo's global break
    # counter also counts the compile tier's own compiles inside the op, so it is not read
    opaque = any(f"lycoris.{case.op}" in s for s in seen)
    if not opaque:
        why = f"op not in the graph ({', '.join(seen)[:200]})"
        notes.append(f"graph: {why}")
        failures.append(f"{label} {dtype} compiled: {why}")
        return "FAIL"
    return f"ok {ok}/{len(usable)}"


if __name__ == "__main__":
    sys.exit(main())
