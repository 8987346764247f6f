"""GPU check of the tuner (lycoris_ops/backends/triton/tuning): tune from an empty table, rerun in a fresh
process and show that no timing happened there; every tuned result equals eager.

    python bench/gpu_tuning.py                                    # default layers, bf16
    python bench/gpu_tuning.py --shapes 3072x3072:r32 --tokens 8192 --dtypes bfloat16,float32
    python bench/gpu_tuning.py --families lora,ia3 --compare-default
    python bench/gpu_tuning.py --via-ops        # through torch.ops.lycoris (once the op set is wired)

Phases, each in its own process, sharing one fresh ``LYCORIS_KERNEL_CACHE_DIR``:

1. ``cold``: each (op, layer, tokens, dtype) of the planners' warm-up samples
   (``lycoris_ops/testing/samples.py``) goes through the op's ``<op>_kwargs`` glue — a
   miss: the shortlist is compiled, checked against the eager body and timed — then
   runs with the picked config. Per key: wall time of that first call (target
   <= 2 s per (op, shape bucket) on an H200; Triton compiles included unless its
   cache is warm), the winner, the agreement with eager, and the precompile
   (``plans/precompile.py``: kernels compiled by forked children / kernels captured,
   children, seconds).
2. ``warm``: the same calls in a fresh process: must time nothing
   (``tune.stats()``: tuned 0, timer calls 0) and answer every key from the table,
   with the same results. With ``--compare-default`` it also times each tuned config
   against the launcher's fixed default config (best of 5 CUDA-event rounds).

Exit status: 0 when every result equals eager and the warm process timed nothing;
1 otherwise; 2 when there is no GPU.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

FAMILIES = ("lora", "tucker", "loha", "lokr", "dora", "oft", "boft", "ia3", "add")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


_CPU = [False]  # --device cpu: a dry run under the Triton interpreter (wall-clock timer)


def _sync():
    if not _CPU[0]:
        torch.cuda.synchronize()


def _cpu_timer(fn, cand=None) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _time_best(fn, rounds: int = 5) -> float:
    from lycoris_ops.tuner import tune

    fn()
    _sync()
    timer = _cpu_timer if _CPU[0] else tune.cuda_timer
    return min(timer(fn) for _ in range(rounds))


def worker(opts) -> int:
    import logging

    import lycoris_ops  # noqa: F401  (registers the ops)
    from lycoris_ops._library import register as registry
    from lycoris_ops.backends import scope, select
    from lycoris_ops.backends.triton import precompile
    from lycoris_ops.testing.samples import SAMPLES, parse_layer
    from lycoris_ops.tuner import tune

    logging.basicConfig(level=logging.INFO if opts.verbose else logging.WARNING, format="  %(message)s")
    tune.set_tuning(True)
    if opts.device == "cpu":  # dry run: tune CPU calls with a wall-clock timer (Triton interpreter)
        from lycoris_ops.tuner import device as pdev

        _CPU[0] = True
        tune.set_timer(_cpu_timer)
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
        t0 = time.perf_counter()
        _process_startup(dev)
        print(f"  process start-up (CUDA context, cuBLAS, Triton's driver and one trivial kernel): "
              f"{time.perf_counter() - t0:.2f} s, paid once per process, not counted in any key", flush=True)
    jit = _watch_triton_compiles()
    layers = [parse_layer(s, opts.rank) for s in opts.shapes.split(",") if s.strip()]
    tokens = [int(t) for t in opts.tokens.split(",") if t.strip()]
    ops_filter = {o.strip() for o in opts.ops.split(",") if o.strip()}
    results = []
    for fam in opts.families.split(","):
        pm = importlib.import_module(f"lycoris_ops.backends.triton.tuning.{fam}")
        if _CPU[0]:
            pm.DEVICE_TYPES = ("cpu", "cuda")
            pm.facts = lambda d: pdev.synthetic()
        for dtype_name in opts.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            for layer in layers:
                for T in tokens:
                    gen = torch.Generator(device=dev.type)
                    gen.manual_seed(0)
                    for op, args in SAMPLES[fam](layer, T, dtype, dev, gen):
                        if op not in pm.KWARGS or (ops_filter and op not in ops_filter):
                            continue
                        full = select._full_args(op, args)
                        why = scope.why_not(op, "triton", full)
                        if why is not None:
                            continue
                        ref_fn = getattr(registry.FAMILY[op], op)
                        before = tune.stats()
                        pre_before = precompile.stats()
                        jit_before = dict(jit)
                        _sync()
                        profiler = None
                        if op in opts.profile.split(","):
                            import cProfile

                            profiler = cProfile.Profile()
                            profiler.enable()
                        t0 = time.perf_counter()
                        if opts.via_ops:
                            out = getattr(torch.ops.lycoris, op)(*full)
                            kw = None
                        else:
                            kw = pm.KWARGS[op](*full)
                            out = ref_fn(*full) if tune.is_eager(kw) else pm.LAUNCHERS[op](*full, **kw)
                        _sync()
                        first_s = time.perf_counter() - t0
                        if profiler is not None:
                            import pstats

                            profiler.disable()
                            print(f"  profile of {op}'s cold first call ({first_s:.2f} s), top 30 cumulative:")
                            pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(30)
                        after = tune.stats()
                        pre = {k: v - pre_before[k] for k, v in precompile.stats().items()}
                        jit_key = {k: v - jit_before[k] for k, v in jit.items()}
                        ref = ref_fn(*full)
                        bad = tune.mismatch(out, ref)
                        row = dict(op=op, layer=f"{layer.out_features}x{layer.in_features}:r{layer.rank}", T=T,
                                   dtype=dtype_name, first_s=round(first_s, 3),
                                   tuned=after["tuned"] - before["tuned"],
                                   timer_calls=after["timer_calls"] - before["timer_calls"],
                                   table_hits=after["table_hits"] - before["table_hits"],
                                   tune_s=round(after["tune_s"] - before["tune_s"], 3),
                                   winner=None if kw is None else ("eager" if tune.is_eager(kw) else
                                                                   {k: str(v) for k, v in kw.items()}),
                                   ok=bad is None, why=bad,
                                   # kernels compiled by forked children before the first calls
                                   pre_captured=pre["captured"], pre_kernels=pre["compiled"],
                                   pre_children=pre["children"], pre_failures=pre["failures"],
                                   pre_s=round(pre["seconds"], 3),
                                   # Triton in this process: kernels compiled here, their seconds, loaded from disk
                                   jit_compiles=jit_key["compiles"], jit_compile_s=round(jit_key["compile_s"], 3),
                                   jit_loads=jit_key["loads"])
                        if opts.compare_default and kw is not None:
                            t_tuned = _time_best(lambda: ref_fn(*full) if tune.is_eager(kw)
                                                 else pm.LAUNCHERS[op](*full, **kw))
                            t_default = _time_best(lambda: pm.LAUNCHERS[op](*full))
                            row.update(tuned_ms=round(t_tuned * 1e3, 4), default_ms=round(t_default * 1e3, 4))
                        results.append(row)
                        print("  " + _line(row), flush=True)
                        del out, ref
    print("RESULT " + json.dumps({"rows": results, "stats": tune.stats(), "table": tune.table_path()}), flush=True)
    return 0


def _watch_triton_compiles() -> dict:
    """Counts of this process's Triton compiles (and their seconds) and of kernels loaded
    from Triton's disk cache, kept up to date by a compile listener (forked precompile
    children clear it)."""
    counts = {"compiles": 0, "compile_s": 0.0, "loads": 0}
    try:
        from triton import knobs
    except ImportError:
        return counts

    def listener(*, src, metadata, metadata_group, times, cache_hit, **_):
        if cache_hit:
            counts["loads"] += 1
            return
        counts["compiles"] += 1
        us = getattr(times, "ir_initialization", 0) + getattr(times, "store_results", 0)
        us += sum(t for _, t in getattr(times, "lowering_stages", ()))
        counts["compile_s"] += us / 1e6

    knobs.compilation.listener = listener
    return counts


def _process_startup(dev) -> None:
    """What any process pays before its first op, whatever the op: the CUDA context, a
    cuBLAS handle, and Triton's driver with one trivial kernel compiled and launched (so
    the first key's time is that key's own compiles and timing)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _touch(p):
        tl.store(p, tl.load(p) + 1.0)

    a = torch.ones(16, 16, device=dev)
    (a @ a).sum().item()
    (a.half() @ a.half()).float().sum().item()
    _touch[(1,)](a)
    torch.cuda.synchronize(dev)


def _line(r) -> str:
    s = (f"{r['op']:20s} {r['layer']:>16s} T={r['T']:<6d} {r['dtype']:9s} first {r['first_s']:7.3f}s "
         f"tuned={r['tuned']} timer={r['timer_calls']} hits={r['table_hits']} "
         f"{'ok' if r['ok'] else 'MISMATCH ' + str(r['why'])}")
    if r.get("pre_captured"):
        s += (f"  precompile {r['pre_kernels']}/{r['pre_captured']} kernels in {r['pre_children']} processes "
              f"{r['pre_s']:.2f}s" + (f" ({r['pre_failures']} failed)" if r["pre_failures"] else ""))
    if r.get("jit_compiles") or r.get("jit_loads"):
        s += f"  here: {r['jit_compiles']} compiles {r['jit_compile_s']:.2f}s, {r['jit_loads']} loads"
    s += f"  tuning {r['tune_s']:.2f}s"

    if "tuned_ms" in r:
        s += f"  tuned {r['tuned_ms']:.4f} ms vs default {r['default_ms']:.4f} ms ({r['default_ms'] / max(r['tuned_ms'], 1e-9):.2f}x)"
    return s


def _run_phase(phase: str, argv, env) -> dict:
    print(f"\n=== phase {phase} (fresh process) ===", flush=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase] + argv
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    res = None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
        else:
            print(line)
    if p.returncode != 0 or res is None:
        print(f"phase {phase} failed (exit {p.returncode})")
        return {"rows": [], "stats": {}, "failed": True}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="3072x3072:r32,4096x4096:r64")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    ap.add_argument("--cache-dir", default=None, help="table directory (default: a fresh temporary one)")
    ap.add_argument("--compare-default", action="store_true", help="warm phase: tuned vs the fixed default tile")
    ap.add_argument("--via-ops", action="store_true", help="call torch.ops.lycoris.<op> instead of the glue")
    ap.add_argument("--profile", default="", help="comma-separated ops whose cold first call is cProfiled")
    ap.add_argument("--cold-target", type=float, default=2.0, help="seconds per cold key (reported)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a dry run of the script itself under TRITON_INTERPRET=1 (tiny shapes)")
    ap.add_argument("--phase", default=None, choices=["cold", "warm"], help=argparse.SUPPRESS)
    ap.add_argument("-v", "--verbose", action="store_true", help="log each tuned key")
    opts = ap.parse_args(argv)
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    if opts.phase is not None:
        if opts.phase == "cold":
            opts.compare_default = False
        else:
            opts.profile = ""
        return worker(opts)

    cache = opts.cache_dir or tempfile.mkdtemp(prefix="lycoris_tuning_")
    env = dict(os.environ, LYCORIS_KERNEL_CACHE_DIR=cache)
    env.pop("LYCORIS_KERNEL_TUNE", None)
    if opts.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    passthrough = ["--shapes", opts.shapes, "--rank", str(opts.rank), "--tokens", opts.tokens,
                   "--dtypes", opts.dtypes, "--families", opts.families, "--ops", opts.ops, "--device", opts.device]
    passthrough += ["--via-ops"] * opts.via_ops + ["-v"] * opts.verbose
    print(f"table directory: {cache}")
    cold = _run_phase("cold", passthrough + ["--profile", opts.profile], env)
    warm = _run_phase("warm", passthrough + ["--compare-default"] * opts.compare_default, env)

    failures = []
    for phase, res in (("cold", cold), ("warm", warm)):
        if res.get("failed"):
            failures.append(f"{phase} phase crashed")
        for r in res["rows"]:
            if not r["ok"]:
                failures.append(f"{phase}: {r['op']} {r['layer']} T={r['T']} {r['dtype']}: {r['why']}")
    ws = warm.get("stats", {})
    if ws.get("tuned", 1) != 0 or ws.get("timer_calls", 1) != 0:
        failures.append(f"warm process timed: tuned={ws.get('tuned')} timer_calls={ws.get('timer_calls')}")
    cold_keys = [r for r in cold["rows"] if r["tuned"]]
    slow = [r for r in cold_keys if r["first_s"] > opts.cold_target]
    print("\n=== summary ===")
    print(f"cold: {len(cold['rows'])} calls, {cold.get('stats', {}).get('tuned')} keys tuned, "
          f"{cold.get('stats', {}).get('timer_calls')} timer calls, "
          f"{cold.get('stats', {}).get('tune_s', 0):.1f} s tuning; "
          f"max first call {max((r['first_s'] for r in cold_keys), default=0):.2f} s; "
          f"{len(slow)} keys above the {opts.cold_target:.1f} s target")
    for r in slow:
        print(f"  slow cold key: {r['op']} {r['layer']} T={r['T']} {r['dtype']}: {r['first_s']:.2f} s "
              f"(tuning {r['tune_s']:.2f} s, precompile {r.get('pre_s', 0):.2f} s)")
    print(f"warm: {len(warm['rows'])} calls, tuned={ws.get('tuned')}, timer_calls={ws.get('timer_calls')}, "
          f"table_hits={ws.get('table_hits')}")
    if opts.compare_default:
        worse = [r for r in warm["rows"] if "tuned_ms" in r and r["tuned_ms"] > 1.05 * r["default_ms"]]
        print(f"tuned vs fixed default: {len(worse)} keys more than 5% slower than the default")
        from lycoris_ops.tuner import tune
        from lycoris_ops.tuner.store import read_json_table

        table = warm.get("table")  # the path the worker processes used
        rows = read_json_table(table, tune.TABLE_VERSION, "rows")[0] if table else {}
        for r in worse:
            print(f"  {r['op']} {r['layer']} T={r['T']} {r['dtype']}: {r['tuned_ms']} ms vs {r['default_ms']} ms")
            for key, row in rows.items():  # what the tuner measured for that op (ms per candidate)
                if f"|{r['op']}|" in key:
                    print(f"    tuner's times: {row.get('times')}")
    for f in failures:
        print("FAIL", f)
    print("PASS" if not failures else f"{len(failures)} failures")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
