"""Benchmark harness of lycoris_ops: every forward op, forward and forward+backward,
eager torch vs torch.compile vs each fused backend vs lycoris-lora 4.1.3 (and PEFT).

    python bench/bench.py                         # full default run (~6 min on an H200)
    python bench/bench.py --quick                 # small bf16 only, no compile column
    python bench/bench.py --ops lora_bypass,dora --shapes large --dtypes bf16
    python bench/bench.py --smoke                 # CPU, tiny sizes: eager vs our op agree (CI)

Options: ``--shapes small,large`` (small = N 8192, D 3072, r 32; large = N 32768,
D 4096, r 64), ``--dtypes bf16,fp16,fp32`` (the first dtype runs at every shape,
the others at one shape: small if listed), ``--columns`` (default
eager,compile,triton,tilelang,peer,peft; also op-compile = our op through the
compile tier, op-torch = our op through its eager tier), ``--compile-dtypes``
(dtypes that get the compile column; default bf16; ``all``; ``none``), ``--no-peer``,
``--peer-path DIR`` (put on the peer's PYTHONPATH: where lycoris-lora is installed),
``--max-seconds S`` (no new op is started past it; the run says what it
skipped), ``--out DIR`` (CSV, summary, peer JSON; default bench/out/),
``--results FILE`` (the dated summary is appended there; default bench/RESULTS.md).

What is measured (one process, one GPU):

- columns: ``eager`` = the formula a user writes without us (bench/specs.py);
  ``compile`` = ``torch.compile`` of that formula; ``triton`` / ``tilelang`` /
  ``op-compile`` / ``op-torch`` = ``torch.ops.lycoris.<op>`` under
  ``lycoris_ops.use_backend(name)``, with the tier that actually ran
  (``select.explain``, forward op / backward op) so a step-down is visible;
  ``auto`` = the default setting, measured only when its tiers differ from every
  measured column; ``peer`` = lycoris-lora 4.1.3's functional API (its own auto
  backend) in a subprocess (bench/peer_lycoris.py: the package owns the same
  ``lycoris`` op namespace), next to the eager formula timed in that process;
  ``peft`` = peft.tuners.lora.Linear's forward (lora_bypass only, base layer's
  output precomputed).
- order: the lycoris-lora subprocess first (a --peer-share of the budget), then
  pass 1 over the configs (large bf16, small bf16, small fp16, small fp32) with
  every column but ``compile``, then pass 2 adding the ``compile`` column while
  time is left (its first calls are the costliest), then the host section.
- phases: ``fwd`` = one training forward (inputs that train require grad);
  ``fwdbwd`` = forward + ``torch.autograd.grad`` w.r.t. the trained inputs with a
  fixed upstream grad. Device time by CUDA events, L2 flushed before each rep,
  host launch gaps hidden (bench/timing.py); median of 5-40 reps.
- floor = (bytes of every input read once + every output written once [+ upstream
  grad read + one gradient per trained input written]) / copy bandwidth measured
  in the same run (1 GiB device-to-device copy, read + write bytes).
- ``xE`` = eager ms / column ms (> 1: faster than eager); ``/fl`` = column ms /
  floor ms; cold = the first call of the column in this process (includes Triton
  JIT, tuning, Inductor compile).
- host: tiny CUDA tensors (N 16, D 64, r 8), calls back to back, wall clock per
  call with the GPU idle, next to one ``torch.add`` and the eager formula.
- targets (pass/fail): every op >= 1.0x eager (fwd and fwd+bwd); lora_bypass fwd
  <= 1.3x floor and fwd+bwd <= 1.6x at the large shape; oft_bypass and dora fwd
  <= 1.3x floor at the large shape; faster than lycoris-lora (fwd and fwd+bwd);
  boft >= 3x eager; host: lora_bypass_fwd <= 2x torch.add, its fwd+bwd <= 0.5x
  the eager formula's fwd+bwd. Targets are read on ``ours`` = the tiers the
  default (auto) setting takes.

Outputs: ``<out>/bench-<stamp>.csv`` (one row per spec, shape, dtype, column,
phase), ``<out>/summary.md`` and the same summary appended to ``--results``; the
short table is printed last.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402

import specs as S  # noqa: E402
import timing as T  # noqa: E402

DEFAULT_COLUMNS = ("eager", "compile", "triton", "tilelang", "peer", "peft")
KNOWN_COLUMNS = DEFAULT_COLUMNS + ("op-compile", "op-torch")
TIER_LETTER = {"triton": "T", "tilelang": "L", "compile": "C", "torch": "E"}
#: relative error of a column against the eager formula above which the table flags it
CHECK_TOL = {torch.float64: 1e-6, torch.float32: 2e-3, torch.float16: 3e-2, torch.bfloat16: 8e-2}
SMOKE_TOL = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 6e-2}
FLOOR_TARGETS = {"lora_bypass": (1.3, 1.6), "oft_bypass": (1.3, None), "dora": (1.3, None)}
BOFT_MIN_SPEEDUP = 3.0
HOST_ADD_MAX, HOST_FB_MAX = 2.0, 0.5


# --------------------------------------------------------------------------- setup

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small bf16 only, fewer reps, no compile column")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, eager vs our op must agree (CI)")
    ap.add_argument("--ops", default="all", help="spec or op names, comma-separated (default: all)")
    ap.add_argument("--shapes", default=None, help="comma list of small,large,tiny (default large,small)")
    ap.add_argument("--dtypes", default=None, help="comma list of bf16,fp16,fp32 (default bf16,fp16,fp32)")
    ap.add_argument("--columns", default=None, help=f"comma list of {','.join(KNOWN_COLUMNS)}")
    ap.add_argument("--compile-dtypes", default=None, help="dtypes that get compile columns (default bf16; 'all')")
    ap.add_argument("--no-peer", action="store_true", help="skip the lycoris-lora subprocess")
    ap.add_argument("--peer-path", default=os.environ.get("LYCORIS_PEER_PATH", ""),
                    help="a directory put on the peer's PYTHONPATH (where lycoris-lora is installed)")
    ap.add_argument("--peer-share", type=float, default=0.25, help="share of --max-seconds given to the peer")
    ap.add_argument("--no-host", action="store_true", help="skip the host-overhead section")
    ap.add_argument("--max-seconds", type=float, default=None, help="time budget (default 330; smoke 120)")
    ap.add_argument("--out", default=None, help="output directory (default bench/out)")
    ap.add_argument("--results", default=None, help="file the dated summary is appended to")
    ap.add_argument("--commit", default=os.environ.get("LYCORIS_BENCH_COMMIT", ""))
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-ms", type=float, default=None, help="device time per measurement (sizes the reps)")
    ap.add_argument("--max-reps", type=int, default=None)
    ap.add_argument("--host-n", type=int, default=None, help="calls per round of the host measurement")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    smoke, quick = args.smoke, args.quick
    args.device = args.device or ("cpu" if smoke else ("cuda" if torch.cuda.is_available() else "cpu"))
    args.shapes = args.shapes or ("tiny" if smoke else ("small" if quick else "large,small"))
    args.dtypes = args.dtypes or ("fp32,bf16" if smoke else ("bf16" if quick else "bf16,fp16,fp32"))
    if args.columns is None:
        cols = ["eager", "op-torch"] if smoke else list(DEFAULT_COLUMNS)
        if quick and args.compile_dtypes is None:
            cols.remove("compile")
        args.columns = ",".join(cols)
    args.columns = [c for c in args.columns.split(",") if c]
    for c in args.columns:
        if c not in KNOWN_COLUMNS:
            raise SystemExit(f"unknown column {c!r}; known: {', '.join(KNOWN_COLUMNS)}")
    if args.no_peer:
        args.columns = [c for c in args.columns if c != "peer"]
    args.compile_dtypes = (args.compile_dtypes or "bf16").split(",")
    args.max_seconds = args.max_seconds if args.max_seconds is not None else (120.0 if smoke else 330.0)
    args.out = args.out or os.path.join(HERE, "out")
    if args.results is None:
        args.results = os.path.join(args.out, "RESULTS.md") if smoke else os.path.join(HERE, "RESULTS.md")
    args.target_ms = args.target_ms or (1.0 if smoke else (10.0 if quick else 25.0))
    args.max_reps = args.max_reps or (2 if smoke else (15 if quick else 40))
    args.min_reps = 1 if smoke else 5
    args.host_n = args.host_n or (3 if smoke else (30 if quick else 50))
    args.host_rounds = 1 if smoke else 5
    return args


def configs(args) -> List[tuple]:
    """[(shape name, dtype name)]: the first dtype at every shape, the others at one shape."""
    shapes = [s for s in args.shapes.split(",") if s]
    dtypes = [d for d in args.dtypes.split(",") if d]
    for s in shapes:
        if s not in S.SHAPES:
            raise SystemExit(f"unknown shape {s!r}; known: {', '.join(S.SHAPES)}")
    for d in dtypes:
        if d not in S.DTYPES:
            raise SystemExit(f"unknown dtype {d!r}; known: {', '.join(S.DTYPES)}")
    one = "small" if "small" in shapes else shapes[0]
    out = []
    for s in shapes:
        for i, d in enumerate(dtypes):
            if i == 0 or s == one:
                out.append((s, d))
    return out


def environment(args) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "torch": torch.__version__, "device": args.device}
    dev = torch.device(args.device)
    env["gpu"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    from importlib import metadata
    for name, dist in (("triton", "triton"), ("tilelang", "tilelang"), ("peft", "peft")):
        try:
            env[name] = metadata.version(dist)
        except Exception:
            env[name] = "n/a"
    commit = args.commit
    if not commit:
        try:
            root = os.path.dirname(HERE)
            commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
            dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            commit = (commit + ("+dirty" if dirty else "")) if commit else ""
        except Exception:
            commit = ""
    env["commit"] = commit or "unknown"
    return env


# --------------------------------------------------------------------------- columns

class Bench:
    def __init__(self, args):
        import lycoris_ops  # noqa: F401  (registers torch.ops.lycoris.*)
        from lycoris_ops.backends import registry as dispatch, select

        self.lo, self.dispatch, self.select = lycoris_ops, dispatch, select
        self.args = args
        self.device = torch.device(args.device)
        self.t0 = time.perf_counter()
        self.host_rows: List[dict] = []     # CSV rows of the host section
        self.cells: Dict[tuple, dict] = {}  # (spec, shape, dtype) -> summary cell
        self.host: List[dict] = []
        self.skipped: List[str] = []
        self.notes: List[str] = []
        self.context_lost = False  # set by a CUDA error: the process cannot use the GPU again
        self.compiled: Dict[str, object] = {}
        self.gen = torch.Generator().manual_seed(args.seed)
        self.bw = None
        self.timer = None
        self.peer = None
        self.add_host_us = None

    # which fused backends can take calls here
    def fused_columns(self) -> List[str]:
        return [c for c in self.args.columns if c in self.dispatch.FUSED]

    def backend_absent(self, name: str) -> Optional[str]:
        if name in self.dispatch.fused_backends(self.device):
            return None
        return (self.dispatch.opset_error(name) or f"{name} does not serve {self.device}")[:200]

    def use(self, name):
        return self.lo.use_backend(name) if name else contextlib.nullcontext()

    def tiers(self, spec, ts, G, setting) -> tuple:
        """(fwd tier, bwd tier) the op and its backward op take under ``setting``."""
        with self.use(setting):
            try:
                tf = self.select.explain(spec.op, *spec.op_args(*ts))
            except Exception as exc:
                tf = f"?({type(exc).__name__})"
            tb = "eager"
            if spec.bwd is not None:
                try:
                    # the forward's outputs as uninitialised tensors of the right geometry (DoRA's
                    # norms): explain reads shapes only, and no real call may warm a cold column
                    with torch.no_grad():
                        meta = spec.ours_all(*[t.detach().to("meta") for t in ts])
                    outs = tuple(torch.empty(o.shape, dtype=o.dtype, device=self.device) for o in meta)
                    op, a = spec.bwd(*ts, G, outs)
                    tb = self.select.explain(op, *a)
                except Exception as exc:
                    tb = f"?({type(exc).__name__})"
        return tf, tb

    def compiled_eager(self, spec):
        if spec.name not in self.compiled:
            self.compiled[spec.name] = torch.compile(spec.eager, dynamic=None)
        return self.compiled[spec.name]

    # ------------------------------------------------------------------ one spec at one config
    def run_spec(self, spec, shape: str, dt_name: str, pass_no: int = 1):
        """Pass 1: eager, our op per backend (+ auto when its tiers differ), PEFT, the peer's
        numbers. Pass 2: the compile column (the costliest to start; run while time is left)."""
        args, dev = self.args, self.device
        geo, dtype = S.SHAPES[shape], S.DTYPES[dt_name]
        inp = spec.build(geo, dtype, dev, self.gen)
        names = list(inp)
        ts = [t.requires_grad_(k in spec.grads) for k, t in inp.items()]
        grad_idx = [names.index(k) for k in spec.grads]
        with torch.no_grad():
            probe = spec.eager(*ts)
        G = torch.randn(probe.shape, generator=self.gen, dtype=torch.float32).to(device=dev, dtype=probe.dtype)
        del probe
        key = (spec.name, shape, dt_name)
        if key not in self.cells:
            floor_fwd, floor_fb = self.floor_bytes(spec, ts, grad_idx, G)
            self.cells[key] = {"spec": spec.name, "op": spec.op, "shape": shape, "dtype": dt_name, "geo": geo,
                               "floor_fwd_bytes": floor_fwd, "floor_fb_bytes": floor_fb, "cols": {}}
        cell = self.cells[key]

        def record(col, res, tier_f="", tier_b="", note=""):
            cell["cols"][col] = {"res": strip(res), "tier": (tier_f, tier_b), "note": note}

        measure = lambda fn, ref: T.measure_column(fn, ts, grad_idx, G, self.timer, dev, ref=ref)  # noqa: E731
        if pass_no == 2:
            out = spec.eager(*ts)
            ref = (out.detach(), torch.autograd.grad(out, [ts[i] for i in grad_idx], G))
            del out
            record("compile", measure(self.compiled_eager(spec), ref), note="torch.compile(eager formula)")
            return
        eager = measure(spec.eager, None)
        ref = (eager.get("out"), eager.get("grads"))
        record("eager", eager, note=spec.note)
        measured_tiers = {}
        for col in args.columns:
            if col not in self.dispatch.FUSED and col not in ("op-compile", "op-torch"):
                continue
            name = {"op-compile": "compile", "op-torch": "torch"}.get(col, col)
            if col in self.dispatch.FUSED:
                why = self.backend_absent(col)
                if why:
                    record(col, {"error": f"n/a: {why}"})
                    continue
            with self.use(name):
                res = measure(spec.ours, ref)
            tf, tb = self.tiers(spec, ts, G, name)
            record(col, res, tf, tb)
            if not res.get("error"):
                measured_tiers.setdefault((tf, tb), col)
        if args.smoke:
            cell["ours"] = "op-torch" if "op-torch" in cell["cols"] else None
        else:
            auto = self.tiers(spec, ts, G, "auto")
            if auto in measured_tiers:
                cell["ours"] = measured_tiers[auto]
            else:
                with self.use("auto"):
                    res = measure(spec.ours, ref)
                record("auto", res, *auto)
                cell["ours"] = "auto"
        if "peft" in args.columns and spec.name == "lora_bypass" and not args.smoke:
            try:
                fn, params = make_peft(inp)
                res = T.measure_column(lambda x: fn(x), [ts[0]], [], G, self.timer, dev, ref=ref, phases=("fwd",))
                # fwd+bwd w.r.t. x and PEFT's own lora_A / lora_B weights
                res_fb = T.measure_column(lambda x, A, B: fn(x), [ts[0]] + params, [0, 1, 2], G, self.timer, dev,
                                          phases=("fwdbwd",))
                res.update({k: v for k, v in res_fb.items() if k in ("fwdbwd", "cold_fwdbwd_s", "error")})
                record("peft", res, note="peft.tuners.lora.Linear, base layer output precomputed")
            except Exception as exc:
                record("peft", {"error": f"n/a: {type(exc).__name__}: {exc}"[:200]})
        if self.peer is not None:
            self.add_peer(cell)
        del inp, ts, G, eager, ref

    def add_peer(self, cell):
        for r in self.peer.get("results", []):
            if (r["spec"], r["shape"], r["dtype"]) != (cell["spec"], cell["shape"], cell["dtype"]):
                continue
            peer, pe = dict(r.get("peer") or {}), r.get("eager") or {}
            if r.get("error"):
                peer = {"error": r["error"]}
            if r.get("rel_err") is not None:
                peer["rel_err"] = r["rel_err"]
            note = (r.get("match_note") or "") + " (separate process)"
            cell["cols"]["peer"] = {"res": peer, "tier": ("", ""), "note": note, "match": r.get("match")}
            cell["cols"]["peer-eager"] = {"res": pe, "tier": ("", ""), "note": "eager formula, the peer's process"}

    def csv_rows(self) -> List[dict]:
        """One row per (spec, shape, dtype, column, phase) from the cells, then the host rows."""
        rows = []
        for cell in self.cells.values():
            geo = cell["geo"]
            base = dict(kind="time", spec=cell["spec"], op=cell["op"], shape=cell["shape"], N=geo.N, D=geo.D,
                        r=geo.r, dtype=cell["dtype"])
            for col, c in cell["cols"].items():
                res = c.get("res") or {}
                ref_col = "peer-eager" if col in ("peer", "peer-eager") else "eager"
                for phase in ("fwd", "fwdbwd"):
                    fb = cell["floor_fwd_bytes" if phase == "fwd" else "floor_fb_bytes"]
                    ms = _med(c, phase)
                    e_ms = _med(cell["cols"].get(ref_col), phase)
                    c_ms = _med(cell["cols"].get("compile"), phase)
                    x = res.get(phase) or {}
                    rows.append(dict(
                        base, column=col, ours="yes" if col == cell.get("ours") else "",
                        tier_fwd=c["tier"][0], tier_bwd=c["tier"][1], phase=phase,
                        median_ms=ms, min_ms=x.get("min_ms"), reps=x.get("reps"),
                        cold_s=res.get("cold_fwd_s" if phase == "fwd" else "cold_fwdbwd_s"),
                        floor_bytes=fb, floor_ms=self.ms(fb),
                        x_eager=(e_ms / ms) if ms and e_ms else None,
                        x_floor=(ms / self.ms(fb)) if ms and self.bw else None,
                        x_compile=(c_ms / ms) if ms and c_ms and col not in ("compile", "peer", "peer-eager") else None,
                        rel_err=res.get("rel_err"), grad_err=res.get("grad_err"), error=res.get("error") or "",
                        note=c.get("note") or ""))
        return rows + self.host_rows

    def ms(self, nbytes):
        return nbytes / self.bw * 1e3 if self.bw and nbytes is not None else None

    def floor_bytes(self, spec, ts, grad_idx, G) -> tuple:
        """Bytes of inputs read once + outputs written once (fwd), + G and the grads (fwd+bwd)."""
        try:
            meta = [t.detach().to("meta") for t in ts]
            with torch.no_grad():
                outs = spec.ours_all(*meta)
        except Exception:
            with torch.no_grad():
                outs = (spec.eager(*ts),)
        return S.floor_bytes(ts, outs, G, [ts[i] for i in grad_idx])

    # ------------------------------------------------------------------ host overhead
    def run_host(self, spec_list, budget_end):
        dev, args = self.device, self.args
        geo = S.SHAPES["tiny"]
        a, b = torch.randn(geo.N, geo.D, device=dev), torch.randn(geo.N, geo.D, device=dev)
        self.add_host_us = T.host_time(lambda: torch.add(a, b), dev, n=args.host_n, rounds=args.host_rounds) * 1e6
        self.host_rows.append(dict(kind="host", spec="torch.add", op="add", shape="tiny", N=geo.N, D=geo.D, r=geo.r,
                              dtype="fp32", column="torch", phase="host_fwd", host_us=self.add_host_us))
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        # eager and our op under auto everywhere; every backend column on lora_bypass (the host target)
        extra = [c for c in args.columns if c in ("op-compile", "op-torch")] + \
            [c for c in self.fused_columns() if not self.backend_absent(c)]
        # lora_bypass first: it carries the host target (the smoke run only exercises the code on it)
        order = sorted(spec_list, key=lambda s: s.name != "lora_bypass")
        if args.smoke:
            order = order[:1]
        for spec in order:
            if time.perf_counter() > budget_end:
                self.skipped.append(f"host {spec.name} (time budget)")
                continue
            inp = spec.build(geo, dtype, dev, self.gen)
            ts = [t.requires_grad_(k in spec.grads) for k, t in inp.items()]
            targets = [t for k, t in zip(inp, ts) if k in spec.grads]
            with torch.no_grad():
                G = torch.randn_like(spec.eager(*ts))
            h = {"spec": spec.name, "cols": {}}
            cols = ["eager"] + (extra if spec.name == "lora_bypass" or args.smoke else []) + \
                ([] if args.smoke else ["auto"])
            for col in cols:
                name = {"op-compile": "compile", "op-torch": "torch"}.get(col, col)
                fn = spec.eager if col == "eager" else spec.ours
                ctx = (lambda: contextlib.nullcontext()) if col == "eager" else (lambda n=name: self.use(n))
                try:
                    with ctx():
                        f_us = T.host_time(lambda: fn(*ts), dev, n=args.host_n, rounds=args.host_rounds) * 1e6
                        fb_us = T.host_time(lambda: torch.autograd.grad(fn(*ts), targets, G), dev,
                                            n=args.host_n, rounds=args.host_rounds) * 1e6
                    tiers = ("", "") if col == "eager" else self.tiers(spec, ts, G, name)
                    h["cols"][col] = {"fwd_us": f_us, "fwdbwd_us": fb_us, "tier": tiers}
                    for phase, v in (("host_fwd", f_us), ("host_fwdbwd", fb_us)):
                        self.host_rows.append(dict(kind="host", spec=spec.name, op=spec.op, shape="tiny", N=geo.N,
                                              D=geo.D, r=geo.r, dtype=str(dtype).replace("torch.", ""),
                                              column=col, tier_fwd=tiers[0], tier_bwd=tiers[1], phase=phase,
                                              host_us=v))
                except Exception as exc:
                    h["cols"][col] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            self.host.append(h)

    # ------------------------------------------------------------------ the run
    def _step(self, spec, shape, dt_name, pass_no, stop):
        what = f"{spec.name} {shape} {dt_name}" + (" compile" if pass_no == 2 else "")
        if time.perf_counter() > stop:
            self.skipped.append(what)
            return
        if self.context_lost:
            self.skipped.append(what)
            return
        print(f"-- {what} ({time.perf_counter() - self.t0:.0f} s)", file=sys.stderr, flush=True)
        try:
            self.run_spec(spec, shape, dt_name, pass_no)
        except Exception as exc:  # a spec that cannot even build is reported, the run goes on
            self.notes.append(f"{what}: {type(exc).__name__}: {exc}"[:300])
            traceback.print_exc()
            # a device fault (illegal address, ...) poisons the CUDA context: every later call
            # fails too, so the run stops here and reports what it has
            self.context_lost = "CUDA error" in str(exc)
        if self.device.type == "cuda" and not self.context_lost:
            torch.cuda.empty_cache()

    def run(self, spec_list, cfgs) -> int:
        args, dev = self.args, self.device
        end = self.t0 + args.max_seconds
        host_reserve = 0.0 if args.no_host else (0.12 * args.max_seconds)
        if "peer" in args.columns:
            self.peer = run_peer(args, spec_list, cfgs, args.peer_share * args.max_seconds)
            if not self.peer.get("ok"):
                self.notes.append(f"peer n/a: {self.peer.get('error')}")
        self.bw = T.copy_bandwidth(dev)
        self.timer = T.DeviceTimer(dev, target_ms=args.target_ms, min_reps=args.min_reps, max_reps=args.max_reps,
                                   warmup=1 if args.smoke else 2)
        stop = end - host_reserve
        for shape, dt_name in cfgs:  # pass 1: everything but the compile column
            for spec in spec_list:
                self._step(spec, shape, dt_name, 1, stop)
        if "compile" in args.columns:  # pass 2: the compile column, while time is left
            for shape, dt_name in cfgs:
                if "all" in args.compile_dtypes or dt_name in args.compile_dtypes:
                    for spec in spec_list:
                        if (spec.name, shape, dt_name) in self.cells:
                            self._step(spec, shape, dt_name, 2, stop)
        if not args.no_host:
            self.run_host(spec_list, end)
        return 0


def strip(res: dict) -> dict:
    return {k: v for k, v in res.items() if k not in ("out", "grads")}


def make_peft(inp):
    """PEFT's LoRA Linear over a base layer whose output is the precomputed ``base``: its
    forward is base + lora_B(lora_A(x))·scaling, the same op as lora_bypass. Returns
    (forward(x), [lora_A.weight, lora_B.weight])."""
    from peft.tuners.lora import Linear as LoraLinear

    x, up, down, base = inp["x"], inp["up"], inp["down"], inp["base"]
    r, D = down.shape

    class FixedOut(torch.nn.Linear):
        def forward(self, x, *a, **k):  # the base layer's output, already computed
            return base.detach()

    layer = FixedOut(D, up.shape[0], bias=False, device=x.device, dtype=x.dtype)
    layer.weight.requires_grad_(False)
    import inspect

    if "config" in inspect.signature(LoraLinear.__init__).parameters:  # peft >= 0.18 takes a LoraConfig
        from peft import LoraConfig

        cfg = LoraConfig(r=r, lora_alpha=S.GAMMA * r, lora_dropout=0.0)
        peft = LoraLinear(layer, "default", cfg, r=r, lora_alpha=S.GAMMA * r)
    else:
        peft = LoraLinear(layer, "default", r=r, lora_alpha=S.GAMMA * r, lora_dropout=0.0)
    peft.to(device=x.device, dtype=x.dtype)
    A, B = peft.lora_A["default"].weight, peft.lora_B["default"].weight
    with torch.no_grad():
        A.copy_(down.detach())
        B.copy_(up.detach())
    return peft, [A, B]


def run_peer(args, spec_list, cfgs, budget) -> dict:
    """bench/peer_lycoris.py in a subprocess -> its JSON (or {'ok': False, 'error': ...})."""
    path = os.path.join(args.out, "peer.json")
    cmd = [sys.executable, os.path.join(HERE, "peer_lycoris.py"), "--specs", ",".join(s.name for s in spec_list),
           "--configs", ",".join(f"{s}:{d}" for s, d in cfgs), "--device", args.device, "--json", path,
           "--max-seconds", str(budget), "--target-ms", str(args.target_ms), "--max-reps", str(args.max_reps),
           "--min-reps", str(args.min_reps), "--host-n", str(args.host_n), "--seed", str(args.seed)]
    if not args.no_host:
        cmd.append("--host")
    # lycoris-lora keeps its own tuning table (another format) at the same default path as
    # ours (~/.cache/lycoris_kernels/tuning.json): each library would overwrite the other's
    return peer_subprocess(cmd, path, budget, args.peer_path, os.path.join(os.path.abspath(args.out), "peer-cache"))


def peer_subprocess(cmd, path, budget, peer_path, cache_dir, grace: float = 120.0) -> dict:
    """Run bench/peer_lycoris.py's command line ``cmd`` (which writes its JSON to ``path``) with
    ``peer_path`` on its PYTHONPATH and lycoris-lora's tuning table under ``cache_dir``; its log
    lands beside ``path``. Returns the JSON (or {'ok': False, 'error': ...}); a peer killed at
    ``budget`` + ``grace`` s keeps the rows it wrote."""
    out_dir = os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ)
    env["LYCORIS_KERNEL_CACHE_DIR"] = cache_dir
    if peer_path:
        env["PYTHONPATH"] = peer_path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if os.path.exists(path):
        os.remove(path)
    error = None
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=budget + grace)
        with open(os.path.join(out_dir, "peer.log"), "w") as f:
            f.write(proc.stdout[-20000:] + "\n--- stderr ---\n" + proc.stderr[-20000:])
        if proc.returncode != 0:
            error = f"peer subprocess exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"[:300]
    except subprocess.TimeoutExpired:
        error = f"peer subprocess timed out after {budget + grace:.0f}s (rows so far kept)"
    except Exception as exc:
        error = f"peer subprocess failed: {type(exc).__name__}: {exc}"[:300]
    try:
        with open(path) as f:
            report = json.load(f)  # written after every spec, so a killed peer keeps its rows
    except Exception:
        report = {"ok": False, "results": []}
    if error:
        report["ok"], report["error"] = False, error
    return report


# --------------------------------------------------------------------------- report

def _med(col, phase):
    if not col:
        return None
    return ((col.get("res") or {}).get(phase) or {}).get("median_ms")


def _tier(col) -> str:
    if not col or not col.get("tier") or not col["tier"][0]:
        return ""
    tf, tb = col["tier"]
    lf = TIER_LETTER.get(tf, "?")
    lb = TIER_LETTER.get(tb, "e" if tb == "eager" else "?")
    return lf if lb in (lf, "e") else f"{lf}/{lb}"


def _f(v, w=7) -> str:
    return f"{T.fmt_ms(v):>{w}}"


def _x(v, w=5) -> str:
    if v is None:
        return f"{'-':>{w}}"
    return f"{v:>{w}.0f}" if abs(v) >= 100 else f"{v:>{w}.2f}"


def evaluate(b: "Bench", cell) -> dict:
    """Per-target 'P' / 'F' / '-' for one (spec, config) cell."""
    ours = cell["cols"].get(cell.get("ours") or "")
    eager = cell["cols"].get("eager")
    peer = cell["cols"].get("peer")
    out = {}
    o = {p: _med(ours, p) for p in ("fwd", "fwdbwd")}
    e = {p: _med(eager, p) for p in ("fwd", "fwdbwd")}
    pe = {p: _med(peer, p) for p in ("fwd", "fwdbwd")}
    if o["fwd"] and e["fwd"]:
        ok = all(o[p] and e[p] and e[p] / o[p] >= 1.0 for p in ("fwd", "fwdbwd") if e[p])
        out["E>=1"] = "P" if ok else "F"
    lim = FLOOR_TARGETS.get(cell["spec"])
    fl_f, fl_b = b.ms(cell["floor_fwd_bytes"]), b.ms(cell["floor_fb_bytes"])
    if lim and cell["shape"] == "large" and o["fwd"] and fl_f:
        ok = o["fwd"] / fl_f <= lim[0]
        if lim[1] is not None:
            ok = ok and bool(o["fwdbwd"]) and o["fwdbwd"] / fl_b <= lim[1]
        out["floor"] = "P" if ok else "F"
    if pe["fwd"] and o["fwd"]:
        ok = all(o[p] and o[p] < pe[p] for p in ("fwd", "fwdbwd") if pe[p])
        out[">peer"] = "P" if ok else "F"
    if cell["spec"] == "boft" and o["fwd"] and e["fwd"]:
        ok = all(o[p] and e[p] / o[p] >= BOFT_MIN_SPEEDUP for p in ("fwd", "fwdbwd") if e[p])
        out["B>=3"] = "P" if ok else "F"
    return out


TARGET_KEYS = ("E>=1", "floor", ">peer", "B>=3")


def table(b: Bench, cfgs) -> List[str]:
    lines = []
    hdr = (f"{'spec':<17}{'cfg':<7}|{'fwd: floor':>10} {'eager':>7} {'compile':>7} {'ours':>9} {'xE':>5} {'/fl':>5} "
           f"{'peer':>7} |{'f+b: floor':>10} {'eager':>7} {'compile':>7} {'ours':>9} {'xE':>5} {'/fl':>5} {'peer':>7} "
           f"| {'E>=1':>4} {'floor':>5} {'>peer':>5} {'B>=3':>4}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    tally = {k: [0, 0, []] for k in TARGET_KEYS}
    for shape, dt in cfgs:
        for (spec, sh, d), cell in b.cells.items():
            if (sh, d) != (shape, dt):
                continue
            cols = cell["cols"]
            ours = cols.get(cell.get("ours") or "")
            row = f"{spec:<17}{sh[0].upper()} {d:<5}|"
            for phase in ("fwd", "fwdbwd"):
                e = _med(cols.get("eager"), phase)
                c = _med(cols.get("compile"), phase)
                o = _med(ours, phase)
                p = _med(cols.get("peer"), phase)
                fl = b.ms(cell["floor_fwd_bytes" if phase == "fwd" else "floor_fb_bytes"])
                bad = ""
                res = (ours or {}).get("res") or {}
                tol = CHECK_TOL[S.DTYPES[d]]
                if (res.get("rel_err") or 0) > tol or (res.get("grad_err") or 0) > tol:
                    bad = "!"
                ot = (T.fmt_ms(o) + _tier(ours) + bad) if o else "n/a"
                row += (f"{_f(fl, 10)} {_f(e)} {_f(c)} {ot:>9} {_x(e / o if e and o else None)} "
                        f"{_x(o / fl if o and fl else None)} {_f(p)} |")
            ev = {} if b.args.smoke else evaluate(b, cell)
            for k in TARGET_KEYS:
                v = ev.get(k, "-")
                row += f" {v:>{max(4, len(k))}}"
                if v in ("P", "F"):
                    tally[k][0 if v == "P" else 1] += 1
                    if v == "F":
                        tally[k][2].append(f"{spec} {sh[0].upper()} {d}")
            lines.append(row)
    if b.args.smoke:
        lines.append("targets: n/a (smoke run: no timing claims)")
        return lines
    lines.append("targets: " + "; ".join(
        f"{k} {p}/{p + f} pass" + (f" (fail: {', '.join(fl[:6])}{' ...' if len(fl) > 6 else ''})" if fl else "")
        for k, (p, f, fl) in tally.items() if p + f))
    return lines


def host_lines(b: Bench) -> List[str]:
    if not b.host:
        return []
    peer = {h["spec"]: h for h in ((b.peer or {}).get("host") or [])}
    pa = (b.peer or {}).get("torch_add_host_us")
    lines = [f"host us/call on tiny tensors (N16 D64 r8, GPU idle): torch.add {T.fmt_ms(b.add_host_us)} us; "
             f"ours = auto tier; peer = lycoris-lora in its process (torch.add there {T.fmt_ms(pa)} us)",
             f"{'spec':<17}{'eager fwd':>10}{'ours fwd':>10}{'/add':>7}{'eager f+b':>11}{'ours f+b':>10}"
             f"{'/eager':>8}{'peer fwd':>10}{'peer f+b':>10}  target"]
    for h in b.host:
        e, o = h["cols"].get("eager") or {}, h["cols"].get("auto") or h["cols"].get("op-torch") or {}
        of, ofb, ef, efb = o.get("fwd_us"), o.get("fwdbwd_us"), e.get("fwd_us"), e.get("fwdbwd_us")
        ra = of / b.add_host_us if of and b.add_host_us else None
        rf = ofb / efb if ofb and efb else None
        p = peer.get(h["spec"]) or {}
        tgt = "-"
        if h["spec"] == "lora_bypass" and ra is not None and rf is not None and not b.args.smoke:
            tgt = "P" if ra <= HOST_ADD_MAX and rf <= HOST_FB_MAX else "F"
            tgt += f" (fwd<={HOST_ADD_MAX:g}x add, f+b<={HOST_FB_MAX:g}x eager)"
        lines.append(f"{h['spec']:<17}{_f(ef, 10)}{_f(of, 10)}{_x(ra, 7)}{_f(efb, 11)}{_f(ofb, 10)}{_x(rf, 8)}"
                     f"{_f(p.get('peer_fwd_us'), 10)}{_f(p.get('peer_fwdbwd_us'), 10)}  {tgt}"
                     + (f"  [{_tier(o)}]" if o.get("tier") else "")
                     + (f"  {o['error']}" if o.get("error") else ""))
    return lines


def cold_lines(b: Bench, cfgs) -> List[str]:
    if not cfgs:
        return []
    shape, dt = cfgs[0]
    names = ["eager", "compile"] + [c for c in KNOWN_COLUMNS if c in b.dispatch.FUSED] + ["op-compile", "auto", "peer"]
    lines = [f"cold first call s ({shape} {dt}; fwd/f+b; includes JIT, tuning, compile)"]
    for (spec, sh, d), cell in b.cells.items():
        if (sh, d) != (shape, dt):
            continue
        parts = []
        for n in names:
            c = cell["cols"].get(n)
            if not c:
                continue
            r = c.get("res") or {}
            if r.get("cold_fwd_s") is None:
                continue
            bg = [r.get(k) for k in ("background_fwd_s", "background_fwdbwd_s")]
            parts.append(f"{n} {r['cold_fwd_s']:.2f}/{(r.get('cold_fwdbwd_s') or float('nan')):.2f}"
                         + (" (bg " + "/".join("-" if v is None else f"{v:.1f}" for v in bg) + ")"
                            if any(v is not None for v in bg) else ""))
        lines.append(f"  {spec:<17}" + "  ".join(parts))
    if any(" (bg " in ln for ln in lines):
        lines.append("  (bg a/b: seconds after the cold call until the deferred TileLang shortlists were built; "
                     "the next call timed them. The f+b cold call comes after the forward's wait, which included "
                     "its backward's kernels built ahead: bench/gpu_tilelang_tune.py times each op's cold call alone)")
    return lines


def fused_lines(b: Bench, cfgs) -> List[str]:
    """The fused backends side by side where a cell timed both Triton and TileLang: their
    medians, TileLang ÷ Triton, TileLang × eager, TileLang's cold first call, and issue #6's
    targets (TileLang >= 1.0x eager, within 1.2x of Triton, cold <= 10 s)."""
    rows, cnt = [], {"E>=1": [0, 0], "<=1.2T": [0, 0], "cold<=10s": [0, 0]}
    for (spec, sh, d), cell in b.cells.items():
        tr, tl, ea = (cell["cols"].get(n) for n in ("triton", "tilelang", "eager"))
        if not (tr and tl) or _med(tl, "fwd") is None or _med(tr, "fwd") is None:
            continue
        part = []
        for ph in ("fwd", "fwdbwd"):
            t, l, e = _med(tr, ph), _med(tl, ph), _med(ea, ph)
            if t is None or l is None:
                part.append("    n/a      n/a    n/a    n/a")
                continue
            part.append(f"{T.fmt_ms(t):>7} {T.fmt_ms(l):>8} {l / t:6.2f} " + (f"{e / l:6.2f}" if e else "   n/a"))
            cnt["<=1.2T"][0] += l <= 1.2 * t
            cnt["<=1.2T"][1] += 1
            if e:
                cnt["E>=1"][0] += l <= e
                cnt["E>=1"][1] += 1
        r = tl.get("res") or {}
        colds = [r.get(k) for k in ("cold_fwd_s", "cold_fwdbwd_s") if r.get(k) is not None]
        for c in colds:
            cnt["cold<=10s"][0] += c <= 10.0
            cnt["cold<=10s"][1] += 1
        cold = "/".join(f"{c:.1f}" for c in colds) or "n/a"
        rows.append(f"{spec:<16} {sh[0].upper()} {d:<4} | " + " | ".join(part) + f" | {cold}")
    if not rows:
        return []
    head = (f"{'spec':<16} cfg    | {'fwd: T':>7} {'TL':>8} {'TL/T':>6} {'TLxE':>6} | {'f+b: T':>7} {'TL':>8} "
            f"{'TL/T':>6} {'TLxE':>6} | TL cold s")
    tally = "; ".join(f"{k} {v[0]}/{v[1]}" for k, v in cnt.items() if v[1])
    return ["fused backends side by side (median ms; T triton, TL tilelang; TLxE = eager/tilelang)", head,
            "-" * len(head)] + rows + [f"tilelang targets: {tally}"]


def extra_lines(b: Bench, cfgs) -> List[str]:
    lines = []
    no_peer = set()
    same: Dict[Tuple[str, str], List[str]] = {}  # (column, error) -> the cells: one line each, not one per cell
    for (spec, sh, d), cell in b.cells.items():
        pf = cell["cols"].get("peft")
        if pf:
            r = pf.get("res") or {}
            if r.get("error"):
                lines.append(f"peft {spec} {sh} {d}: {r['error']}")
            else:
                o = cell["cols"].get(cell.get("ours") or "")
                lines.append(f"peft lora.Linear {sh} {d}: fwd {T.fmt_ms(_med(pf, 'fwd'))} ms, f+b "
                             f"{T.fmt_ms(_med(pf, 'fwdbwd'))} ms; ours fwd {T.fmt_ms(_med(o, 'fwd'))}, "
                             f"f+b {T.fmt_ms(_med(o, 'fwdbwd'))}")
        for n, c in cell["cols"].items():
            err = (c.get("res") or {}).get("error")
            if err and n == "peer" and err.startswith("no matching"):
                no_peer.add(spec)
            elif err and n != "peft":
                same.setdefault((n, err), []).append(f"{spec} {sh} {d}")
            if n == "peer" and c.get("match") is False:
                lines.append(f"peer {spec} {sh} {d}: {c.get('note')}")
    for (n, err), where in same.items():
        lines.append(f"{n} {where[0]}: {err}"[:200] if len(where) == 1
                     else f"{n}, {len(where)} cells ({where[0]} ... {where[-1]}): {err}"[:200])
    if no_peer:
        lines.append(f"peer: lycoris-lora has no functional API for {', '.join(sorted(no_peer))}")
    tiers = set()
    for (spec, sh, d), cell in b.cells.items():
        for n, c in cell["cols"].items():
            tf, tb = c.get("tier") or ("", "")
            if n in b.dispatch.FUSED and tf and (tf != n or (tb not in (n, "eager"))):
                tiers.add(f"{spec}: {n} column ran {tf}/{tb}")
    if tiers:
        lines.append("step-downs: " + "; ".join(sorted(tiers)))
    return lines


def write_outputs(b: Bench, env, cfgs, args) -> List[str]:
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    csv_path = os.path.join(args.out, f"bench-{stamp}.csv")
    fields = ["kind", "spec", "op", "shape", "N", "D", "r", "dtype", "column", "ours", "tier_fwd", "tier_bwd", "phase",
              "median_ms", "min_ms", "reps", "cold_s", "floor_bytes", "floor_ms", "x_eager", "x_floor", "x_compile",
              "host_us", "rel_err", "grad_err", "error", "note"]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in b.csv_rows():
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    peer_v = (b.peer or {}).get("version", "n/a") if b.peer else "off"
    head = (f"{env['date']} | {env['gpu']} | torch {env['torch']}, triton {env['triton']}, tilelang {env['tilelang']}, "
            f"peft {env['peft']}, lycoris-lora {peer_v} | commit {env['commit']} | copy "
            + (f"{b.bw / 1e12:.2f} TB/s" if b.bw and b.device.type == "cuda" else "n/a (cpu)"))
    legend = ("median ms, device time (L2 flushed, launch gaps hidden); ours = the tier auto takes "
              "[T triton, L tilelang, C compile tier, E eager tier; a/b = fwd/bwd op]; xE = eager/ours; "
              "/fl = ours/floor; ! = differs from eager beyond tolerance; targets P/F/-")
    main = table(b, cfgs)
    tail = []
    if b.skipped:
        tail.append(f"time budget ({args.max_seconds:.0f}s) reached: not started: " + ", ".join(b.skipped[:20])
                    + (" ..." if len(b.skipped) > 20 else ""))
    tail += b.notes
    fused = fused_lines(b, cfgs)
    summary = [head, ""] + cold_lines(b, cfgs) + [""] + host_lines(b) + [""] + extra_lines(b, cfgs) + \
        ["", legend] + main + ([""] + fused if fused else []) + tail
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(summary) + "\n")
    entry = (f"\n## {env['date']} — {env['gpu']} — commit {env['commit']}\n\n"
             f"`bench.py {' '.join(args.argv) or '(defaults)'}`; CSV {os.path.basename(csv_path)}\n\n```text\n"
             + "\n".join(summary) + "\n```\n")
    # the entry also lands in --out, so a run on a remote machine can be appended here later:
    #   cat <out>/RESULTS-entry.md >> bench/RESULTS.md
    with open(os.path.join(args.out, "RESULTS-entry.md"), "w") as f:
        f.write(entry)
    with open(args.results, "a") as f:
        f.write(entry)
    return summary + [f"csv: {csv_path}", f"summary appended to {args.results} (entry also in "
                                          f"{os.path.join(args.out, 'RESULTS-entry.md')})"]


# --------------------------------------------------------------------------- smoke check

def smoke_failures(b: Bench) -> List[str]:
    """Smoke mode: every spec ran, and our op agrees with the eager formula (output and grads)."""
    bad = []
    for (spec, sh, d), cell in b.cells.items():
        tol = SMOKE_TOL[S.DTYPES[d]]
        for n, c in cell["cols"].items():
            r = c.get("res") or {}
            if n == "peer":
                continue
            if r.get("error"):
                bad.append(f"{spec} {d} {n}: {r['error']}")
            elif n != "eager":
                for k in ("rel_err", "grad_err"):
                    if r.get(k) is None or r[k] > tol:
                        bad.append(f"{spec} {d} {n}: {k} {r.get(k)} > {tol}")
    for note in b.notes:
        bad.append(note)
    return bad


def main(argv=None) -> int:
    args = parse_args(argv)
    spec_list = S.select([o for o in args.ops.split(",") if o])
    cfgs = configs(args)
    env = environment(args)
    threads = torch.get_num_threads()
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(1)  # CPU runs make no timing claims; keep them from fighting over cores
    try:
        b = Bench(args)
        b.run(spec_list, cfgs)
        lines = write_outputs(b, env, cfgs, args)
    finally:
        torch.set_num_threads(threads)
    rc = 0
    if args.smoke:
        bad = smoke_failures(b)
        missing = [f"{s.name} {sh} {d}" for sh, d in cfgs for s in spec_list if (s.name, sh, d) not in b.cells]
        bad += [f"not run: {m}" for m in missing]
        lines.append("smoke: " + ("OK, every spec agrees with its eager formula" if not bad else
                                  f"{len(bad)} problem(s):\n  " + "\n  ".join(bad)))
        rc = 1 if bad else 0
    sys.stdout.flush()
    print("\n".join(lines), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
