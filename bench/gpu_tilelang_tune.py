"""GPU check of the TileLang tier's tuner (backends/tilelang/runner.py): cold first calls with an empty
tuning table and an empty TileLang disk cache, a fresh process that must neither time nor
compile, and the tuned tile configs against the kernels' fixed defaults and eager.

    LYCORIS_TILELANG_SITE=/tmp/tl PYTHONPATH=/tmp/tl python bench/gpu_tilelang_tune.py
    python bench/gpu_tilelang_tune.py --shapes 3072x3072:r32 --tokens 8192 --ops lora_bypass_fwd

Phases, each a fresh process, sharing one fresh ``LYCORIS_KERNEL_CACHE_DIR`` and
``TILELANG_CACHE_DIR``; every call goes through ``torch.ops.lycoris.<op>`` with
``LYCORIS_KERNEL_BACKEND=tilelang`` (the warm-up samples, ``lycoris_ops/testing/samples.py``):

1. ``cold``: per (op, layer, tokens) the wall time of the first call (the first config's
   kernels built in forked children; with ``LYCORIS_TILELANG_DEFER=0`` the whole shortlist,
   then every shortlisted config and eager timed); for a deferred key the seconds it waited
   for the background builds (``settle``) and its second call, which times the shortlist;
   TileLang kernels built or loaded in this process and their seconds, the tuner's timer
   calls, the winner (the stored row), and the result against the eager body.
2. ``warm``: the same calls: tuned 0, timer calls 0; per key the first-call wall time and
   the TileLang build seconds (loads from the disk cache only).
3. in the warm process, ``--compare``: for the ops with a TileLang model, the stored
   winner against the kernel's fixed default config and eager (best of 5 CUDA-event
   rounds, L2 flushed: ``tune.cuda_timer``).

Exit status 0 when every result equals eager and the warm process timed nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

FAMILIES = ("lora", "tucker", "loha", "lokr", "dora", "oft", "boft", "ia3", "add")


def _best(fn, rounds: int = 5) -> float:
    from lycoris_ops.tuner import tune

    fn()
    torch.cuda.synchronize()
    return min(tune.cuda_timer(fn) for _ in range(rounds))


def worker(opts) -> int:
    import lycoris_ops  # noqa: F401  (registers the ops)
    from lycoris_ops import reference
    from lycoris_ops.backends.tilelang import runner as tl_pick
    from lycoris_ops.testing.samples import SAMPLES, parse_layer
    from lycoris_ops.tuner import tune
    from lycoris_ops.backends.tilelang import common as _common

    tune.set_tuning(True)
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.ones(1, device=dev).add_(1)
    torch.cuda.synchronize()
    layers = [parse_layer(s, opts.rank) for s in opts.shapes.split(",") if s.strip()]
    tokens = [int(t) for t in opts.tokens.split(",") if t.strip()]
    only = {o.strip() for o in opts.ops.split(",") if o.strip()}
    L = torch.ops.lycoris
    results, bad = [], 0
    for fam in opts.families.split(","):
        for layer in layers:
            for T in tokens:
                gen = torch.Generator(device="cuda")
                gen.manual_seed(0)
                for op, args in SAMPLES[fam](layer, T, torch.bfloat16, dev, gen):
                    if only and op not in only:
                        continue
                    st0, tl0, pre0 = tune.stats(), _common.stats(), tl_pick.stats()
                    keys0 = set(tune.table().rows)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    try:
                        out = getattr(L, op)(*args)
                        torch.cuda.synchronize()
                        err = None
                    except Exception as exc:  # reported, the run goes on
                        out, err = None, f"{type(exc).__name__}: {str(exc)[:160]}"
                    first = time.perf_counter() - t0
                    settle_s = timed_s = None
                    if err is None and tl_pick._exact(op, args) in tl_pick._deferred:
                        # its first config ran; the rest of the shortlist builds in the background
                        t0 = time.perf_counter()
                        tl_pick.settle()
                        settle_s = time.perf_counter() - t0
                        t0 = time.perf_counter()
                        out = getattr(L, op)(*args)  # times the shortlist
                        torch.cuda.synchronize()
                        timed_s = time.perf_counter() - t0
                    st, tl, pre = tune.stats(), _common.stats(), tl_pick.stats()
                    ok = err is None
                    if ok:
                        want = reference.eager(op)(*args)
                        got = out if isinstance(out, (tuple, list)) else (out,)
                        want = want if isinstance(want, (tuple, list)) else (want,)
                        for g, w in zip(got, want):
                            if g is None or w is None:
                                continue
                            d = (g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12)
                            ok = ok and bool(d <= 4e-2)
                    bad += not ok
                    winner = tl_pick._front.get(tl_pick._exact(op, args))  # this call's pick (or None)
                    new = [r for k, r in tune.table().rows.items() if k not in keys0 and "|tilelang|" in k]
                    times = {(lab or "fixed"): ms for lab, ms in (new[0].get("times", {}) if new else {}).items()}
                    rec = dict(op=op, layer=f"{layer.out_features}x{layer.in_features}:r{layer.rank}", T=T,
                               first_s=round(first, 3),
                               background_s=None if settle_s is None else round(settle_s, 3),
                               timed_s=None if timed_s is None else round(timed_s, 3),
                               tuned=st["tuned"] - st0["tuned"],
                               timer=st["timer_calls"] - st0["timer_calls"], built=tl["kernels"] - tl0["kernels"],
                               build_s=round(tl["build_s"] - tl0["build_s"], 2),
                               children=pre["children"] - pre0["children"], winner=winner, times=times,
                               failed=new[0].get("failed") if new else None,
                               ok=ok, error=err)
                    if opts.compare and ok and op in tl_pick.models() and winner is not None:
                        kernel = tl_pick.LAUNCHERS[op]
                        win = winner
                        eager = reference.eager(op)
                        run_win = (lambda: eager(*args)) if tune.is_eager(win) else (
                            lambda: tl_pick._call(kernel, args, win))
                        rec["ms_winner"] = round(_best(run_win) * 1e3, 4)
                        rec["ms_default"] = round(_best(lambda: kernel(*args)) * 1e3, 4)
                        rec["ms_eager"] = round(_best(lambda: eager(*args)) * 1e3, 4)
                    results.append(rec)
                    print(json.dumps(rec), flush=True)
    stats = tune.stats()
    print(json.dumps({"summary": True, "tuned": stats["tuned"], "timer_calls": stats["timer_calls"],
                      "table_hits": stats["table_hits"], "bad": bad}), flush=True)
    return 1 if bad else 0


def _run_phase(phase: str, argv, env) -> list:
    """Run one phase in a fresh process; its records, each also printed as it arrives (a
    run stopped early still shows what it measured)."""
    p = subprocess.Popen([sys.executable, __file__, "--phase", phase, *argv], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    recs = []
    for line in p.stdout:
        if line.startswith("{"):
            r = json.loads(line)
            recs.append(r)
            if "op" in r:
                print(f"  {phase} {r['op']:20s} {r['layer']} T={r['T']} first {r['first_s']:.2f} s built {r['built']} "
                      f"({r['build_s']} s) children {r['children']} timed {r['timer']} ok {r['ok']}", flush=True)
    err = p.stderr.read()
    if p.wait() not in (0, 1):
        print(f"{phase}: exit {p.returncode}\n{err[-3000:]}")
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="3072x3072:r32,4096x4096:r64")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--ops", default="")
    ap.add_argument("--compare", action="store_true", help="warm phase: winner vs the fixed default and eager")
    ap.add_argument("--phase", default=None, choices=["cold", "warm"])
    opts = ap.parse_args(argv)
    if opts.phase:
        return worker(opts)
    if not torch.cuda.is_available():
        print("no GPU")
        return 2
    tmp = tempfile.mkdtemp(prefix="lycoris_tl_tune_")
    env = dict(os.environ, LYCORIS_KERNEL_BACKEND="tilelang", LYCORIS_KERNEL_CACHE_DIR=os.path.join(tmp, "table"),
               TILELANG_CACHE_DIR=os.path.join(tmp, "tilelang"))
    env.pop("LYCORIS_KERNEL_TUNE", None)
    base = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--compare"]
    cold = _run_phase("cold", base, env)
    warm = _run_phase("warm", base + (["--compare"] if opts.compare else []), env)
    print("\n'bg s': seconds the deferred shortlist's background builds took after the cold call; 'tune s': the "
          "call that then timed it")
    print(f"\n{'op':22s} {'layer':14s} {'T':>6s} {'cold s':>7s} {'bg s':>6s} {'tune s':>6s} {'built':>5s} {'kids':>4s} "
          f"{'timed':>5s}  "
          f"{'warm s':>7s} {'load s':>6s} {'t':>2s}  winner")
    wk = {(r["op"], r["layer"], r["T"]): r for r in warm if "op" in r}
    for r in cold:
        if "op" not in r:
            continue
        w = wk.get((r["op"], r["layer"], r["T"]), {})
        win = r["winner"] if isinstance(r["winner"], str) or r["winner"] is None else (
            ",".join(f"{k}={v}" for k, v in r["winner"].items()) or "the fixed config")
        bg, tn = (f"{r[k]:6.2f}" if r.get(k) is not None else f"{'-':>6s}" for k in ("background_s", "timed_s"))
        print(f"{r['op']:22s} {r['layer']:14s} {r['T']:6d} {r['first_s']:7.2f} {bg} {tn} {r['built']:5d} "
              f"{r['children']:4d} "
              f"{r['timer']:5d}  {w.get('first_s', float('nan')):7.2f} {w.get('build_s', float('nan')):6.2f} "
              f"{w.get('timer', -1):2d}  {win}{'' if r['ok'] else '  NOT OK ' + str(r['error'])}")
    timed = [r for r in cold if r.get("times")]
    if timed:
        print("\ncandidates timed on the cold call (ms, best of three; 'fixed' = the kernel's fixed config)")
        for r in timed:
            t = r["times"]
            tiles = {k: v for k, v in t.items() if k not in ("fixed", "eager")}
            best_tile = min(tiles.items(), key=lambda kv: kv[1]) if tiles else None
            print(f"  {r['op']:20s} {r['layer']} T={r['T']}: fixed {t.get('fixed', float('nan')):.4f}  eager "
                  f"{t.get('eager', float('nan')):.4f}" + (f"  best tile {best_tile[1]:.4f} [{best_tile[0]}]"
                                                          if best_tile else "")
                  + (f"  failed: {r['failed']}" if r.get("failed") else ""))
    cmp_rows = [r for r in warm if "ms_winner" in r]
    if cmp_rows:
        print(f"\n{'tuned vs default (warm)':22s} {'layer':14s} {'T':>6s} {'winner ms':>9s} {'default':>9s} "
              f"{'eager':>9s} {'def/win':>7s} {'eag/win':>7s}")
        for r in cmp_rows:
            print(f"{r['op']:22s} {r['layer']:14s} {r['T']:6d} {r['ms_winner']:9.4f} {r['ms_default']:9.4f} "
                  f"{r['ms_eager']:9.4f} {r['ms_default'] / r['ms_winner']:7.2f} {r['ms_eager'] / r['ms_winner']:7.2f}")
    cs = [r for r in cold if "op" in r]
    ws = [r for r in warm if "summary" in r]
    over = [r for r in cs if r["first_s"] > 10.0]
    print(f"\ncold: {len(cs)} calls, max first call {max((r['first_s'] for r in cs), default=0):.2f} s, "
          f"{len(over)} over 10 s; not ok: {sum(not r['ok'] for r in cs)}")
    if ws:
        print(f"warm: tuned={ws[0]['tuned']} timer_calls={ws[0]['timer_calls']} table_hits={ws[0]['table_hits']} "
              f"max first call {max((r['first_s'] for r in warm if 'op' in r), default=0):.2f} s")
    good = bool(ws) and ws[0]["tuned"] == 0 and ws[0]["timer_calls"] == 0 and all(r["ok"] for r in cs)
    print("PASS" if good else "FAIL")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
