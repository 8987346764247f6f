"""lycoris-lora 4.1.3 as a peer column: its functional API against the natural eager
formula, timed in this process. Never imports lycoris_ops: lycoris-lora registers the
same ``torch.ops.lycoris`` namespace, so bench.py runs this script as a subprocess.

    python bench/peer_lycoris.py --specs lora_bypass,dora --configs large:bf16,small:fp32 \
        --json out/peer.json [--device cuda] [--max-seconds 120] [--host]
    python bench/peer_lycoris.py --cells cells.json --json out/peer.json   # bench/matrix.py's cells

For every spec with a peer mapping it reports (JSON): the peer's fwd and fwd+bwd
medians (its functional API with ``backend=None``, i.e. its own auto choice), the
natural eager formula's in the same process (``--cells``: each matrix cell's form, from
bench/matrix.py's table, rows keyed by the cell's id), the cold first calls, the relative
error of the peer output against the eager formula (the mapping tries whether the
peer returns the full result or only the delta and keeps the reading that matches),
and with ``--host`` the host time per call on tiny tensors next to one torch.add.
If ``import lycoris`` fails the JSON says so and every peer column is n/a.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import specs as S  # noqa: E402
import timing  # noqa: E402

# (eager output, peer output) tolerance for the "does the reading match" test
MATCH_TOL = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 3e-2, torch.bfloat16: 8e-2}


_SCALARS: dict = {}


def _scalar(v: float, like: torch.Tensor) -> torch.Tensor:
    """A cached 0-d tensor scale on ``like``'s device (no grad)."""
    key = (v, like.device)
    if key not in _SCALARS:
        _SCALARS[key] = torch.tensor(v, device=like.device)
    return _SCALARS[key]


def both(f, base_idx):
    """The raw reading of ``f`` and "+ base" (``ts[base_idx]``): the API may return the delta only."""
    return [f, lambda *ts: ts[base_idx] + f(*ts)]


def peer_candidates(L):
    """spec name -> list of callables over the spec's input tensors (dict order); the first
    whose output matches the eager formula is the peer column. Where the functional API
    returns only a delta, the candidate adds the base eagerly (what a user of the package
    writes to get the same result)."""
    locon, loha, lokr, diag_oft, boft, general = L
    g = S.GAMMA

    def tucker(up, mid, down):
        R, kk = mid.shape[0], mid.shape[2]
        kh = int(round(kk ** 0.5))
        out = locon.diff_weight(down.reshape(R, -1, 1, 1), up.reshape(-1, R, 1, 1), mid.reshape(R, R, kh, kk // kh),
                                gamma=g)
        return out.reshape(up.shape[0], down.shape[1], kk)

    return {
        "lora_merge_plain": [lambda W, up, down: W + locon.diff_weight(down, up, None, gamma=g)],
        # LoHa: (w1d, w1u, w2d, w2u, t1, t2); its backward wants a tensor gamma on some tiers
        "lora_merge_hada": [lambda W, a1, b1, a2, b2: W + loha.diff_weight(b1, a1, b2, a2, None, None, gamma=g),
                            lambda W, a1, b1, a2, b2: W + loha.diff_weight(b1, a1, b2, a2, None, None,
                                                                           gamma=_scalar(g, W))],
        "lora_bypass": both(lambda x, up, down, base: locon.bypass_forward_diff(x, base, down, up, None, gamma=g), 3),
        "lora_tucker": [tucker],
        "loha_bypass": both(lambda x, a1, b1, a2, b2, base:
                            loha.bypass_forward_diff(x, base, b1, a1, b2, a2, None, None, gamma=g), 5)
        + both(lambda x, a1, b1, a2, b2, base:
               loha.bypass_forward_diff(x, base, b1, a1, b2, a2, None, None, gamma=_scalar(g, x)), 5),
        "lokr_full_merge": [lambda W, w1, w2: W + lokr.kron_weight(w1, None, None, w2, None, None, None, scale=g)],
        "lokr_merge": [lambda W, w1, w2a, w2b: W + lokr.kron_weight(w1, None, None, None, w2a, w2b, None, scale=g)],
        "lokr_bypass": both(lambda x, w1, w2, base: lokr.kron_bypass(x, w1, None, None, w2, None, None, None,
                                                                     scale=g), 3),
        "dora": [lambda W, m: general.weight_decompose(W, m, S.DORA_MULT, wd_on_out=True)],
        "oft_bypass": [lambda blocks, y: diag_oft.bypass_forward_diff(y, y, blocks, None, constraint=None),
                       lambda blocks, y: diag_oft.bypass_forward_diff(y, y, blocks, None, constraint=None) - y],
        "oft_merge": [lambda blocks, W: diag_oft.diff_weight(W, blocks, None, constraint=None),
                      lambda blocks, W: diag_oft.diff_weight(W, blocks, None, constraint=None) - W],
        "boft": [lambda blocks, y: boft.bypass_forward_diff(y, blocks, None, constraint=None, scale=S.BOFT_SCALE),
                 lambda blocks, y: boft.bypass_forward_diff(y, blocks, None, constraint=None, scale=S.BOFT_SCALE) - y],
        "add_scaled": [lambda W, delta: general.add_scaled(W, delta, gamma=S.ADD_GAMMA)],
    }


def _pick(cands, ts, want, dtype, targets, device):
    """(callable, rel_err, note, cold): the first candidate matching ``want`` whose backward
    also runs; else the first that matches forward only; else the closest one. ``cold`` =
    (seconds of the first forward call, of the first forward+backward call) in this
    process for this input geometry: the calls made here are the peer's cold calls."""
    best = (None, float("inf"), "", (None, None))
    fwd_only = None
    cold = [None, None]
    for i, f in enumerate(cands):
        try:
            with torch.no_grad():
                out, sec = timing.cold_call(lambda: f(*ts), device)
            cold[0] = sec if cold[0] is None else cold[0]
            err = timing.rel_err(out, want)
        except Exception as exc:
            if best[0] is None:
                best = (None, float("inf"), f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200],
                        tuple(cold))
            continue
        if err <= MATCH_TOL[dtype]:
            try:
                _, sec = timing.cold_call(lambda: torch.autograd.grad(f(*ts), targets, torch.ones_like(want)), device)
                cold[1] = sec if cold[1] is None else cold[1]
            except Exception as exc:
                if fwd_only is None:
                    fwd_only = (f, err, f"reading {i}; backward fails: {type(exc).__name__}: {exc}"[:200], tuple(cold))
                continue
            return f, err, f"reading {i}", tuple(cold)
        if err < best[1]:
            best = (f, err, f"reading {i} does not match (rel_err {err:.2e})", tuple(cold))
    return fwd_only or best


def run(args, report: dict, dump=lambda: None) -> dict:
    """Fills ``report``; ``dump()`` is called after every spec (a killed run keeps its rows)."""
    t_start = time.perf_counter()
    try:
        import lycoris  # noqa: F401
        from lycoris.functional import boft, diag_oft, general, lokr, loha, locon
    except Exception as exc:
        report["error"] = f"import lycoris failed: {type(exc).__name__}: {exc}"[:300]
        return report
    try:
        from importlib.metadata import version
        report["version"] = version("lycoris_lora")
    except Exception:
        report["version"] = getattr(lycoris, "__version__", "unknown")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # CPU runs make no timing claims
    mods = (locon, loha, lokr, diag_oft, boft, general)
    cands = peer_candidates(mods)
    names = [n for n in args.specs.split(",") if n]
    timer = timing.DeviceTimer(device, target_ms=args.target_ms, max_reps=args.max_reps, min_reps=args.min_reps)
    gen = torch.Generator().manual_seed(args.seed)
    configs = [c.split(":") for c in args.configs.split(",") if c]
    if args.cells:
        _run_cells(args, report, mods, timer, device, t_start, dump)
    for shape, dt_name in configs:
        geo, dtype = S.SHAPES[shape], S.DTYPES[dt_name]
        for name in names:
            row = {"spec": name, "shape": shape, "dtype": dt_name}
            report["results"].append(row)
            if name not in cands:
                row["error"] = "no matching lycoris-lora functional API"
                continue
            if time.perf_counter() - t_start > args.max_seconds * (0.85 if args.host else 1.0):
                row["error"] = "skipped: time budget"
                continue
            spec = S.BY_NAME[name]
            _measure_row(row, spec.build(geo, dtype, device, gen), spec.eager, spec.grads, cands[name], dtype,
                         timer, device, gen)
            dump()
    if args.host:
        geo = S.SHAPES["tiny"]
        a, b = torch.randn(geo.N, geo.D, device=device), torch.randn(geo.N, geo.D, device=device)
        report["torch_add_host_us"] = timing.host_time(lambda: torch.add(a, b), device, n=args.host_n) * 1e6
        for name in sorted(names, key=lambda n: n != "lora_bypass"):  # the host target first
            if name not in cands or time.perf_counter() - t_start > args.max_seconds:
                continue
            spec = S.BY_NAME[name]
            inp = spec.build(geo, torch.float32 if device.type == "cpu" else torch.bfloat16, device, gen)
            ts = [t.requires_grad_(k in spec.grads) for k, t in inp.items()]
            targets = [t for k, t in zip(inp, ts) if k in spec.grads]
            with torch.no_grad():
                want = spec.eager(*ts)
            fn, err, _, _ = _pick(cands[name], ts, want, ts[0].dtype, targets, device)
            if fn is None:
                continue
            G = torch.randn_like(want)
            h = {"spec": name}
            try:
                for col, f in (("eager", spec.eager), ("peer", fn)):
                    h[f"{col}_fwd_us"] = timing.host_time(lambda: f(*ts), device, n=args.host_n) * 1e6
                    h[f"{col}_fwdbwd_us"] = timing.host_time(
                        lambda: torch.autograd.grad(f(*ts), targets, G), device, n=args.host_n) * 1e6
            except Exception as exc:
                h["error"] = f"{type(exc).__name__}: {exc}"[:200]
            report["host"].append(h)
            dump()
    report["ok"] = True
    report["seconds"] = time.perf_counter() - t_start
    return report


def _measure_row(row, inp, eager, grads, cands, dtype, timer, device, gen) -> None:
    """Fill ``row`` for the named inputs ``inp``: the eager formula's column, the first of the
    candidate peer readings ``cands`` that matches it, that reading's column; ``grads`` are
    the inputs a training step differentiates."""
    names_in = list(inp)
    ts = [t.requires_grad_(k in grads) for k, t in inp.items()]
    grad_idx = [names_in.index(k) for k in grads]
    with torch.no_grad():
        want = eager(*ts)
    G = torch.randn(want.shape, generator=gen, dtype=torch.float32, device=gen.device).to(device=device,
                                                                                      dtype=want.dtype)
    e = timing.measure_column(eager, ts, grad_idx, G, timer, device)
    row["eager"] = _strip(e)
    fn, err, note, cold = _pick(cands, ts, want, dtype, [ts[i] for i in grad_idx], device)
    row["match_note"] = note
    if fn is None:
        row["error"] = note or "no reading ran"
        return
    p = timing.measure_column(fn, ts, grad_idx, G, timer, device, ref=(e.get("out"), e.get("grads")))
    # the real first calls happened in _pick
    p["cold_fwd_s"], p["cold_fwdbwd_s"] = cold
    row["peer"] = _strip(p)
    row["rel_err"] = err
    row["match"] = err <= MATCH_TOL[dtype]


def _run_cells(args, report, mods, timer, device, t_start, dump) -> None:
    """The cells of bench/matrix.py listed in ``args.cells`` (JSON), in their order, while the
    time budget lasts; each row is keyed by the cell's id. The inputs are drawn on the device;
    ``mods``: lycoris-lora's functional modules, from which each form makes its readings."""
    from matrix import FORMS  # the cells' forms: build, eager formula, peer readings

    with open(args.cells) as f:
        cells = json.load(f)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    for cell in cells:
        row = {"id": cell["id"]}
        report["results"].append(row)
        form = FORMS[cell["form"]]
        if form.peer is None:
            row["error"] = "no matching lycoris-lora functional API"
            continue
        if time.perf_counter() - t_start > args.max_seconds:
            row["error"] = "skipped: time budget"
            continue
        dtype = S.DTYPES[cell["dtype"]]
        try:
            _measure_row(row, form.build(cell["dims"], dtype, device, gen), form.eager, form.grads,
                         form.peer(mods), dtype, timer, device, gen)
        except Exception as exc:  # one cell that cannot run (out of memory, ...) does not end the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dump()


def _strip(res: dict) -> dict:
    """The JSON-able part of a measure_column result."""
    out = {}
    for k, v in res.items():
        if k in ("out", "grads"):
            continue
        out[k] = v
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", default=",".join(s.name for s in S.SPECS))
    ap.add_argument("--configs", default="large:bf16,small:bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="-", help="output file ('-': stdout)")
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument("--target-ms", type=float, default=30.0)
    ap.add_argument("--min-reps", type=int, default=5)
    ap.add_argument("--max-reps", type=int, default=40)
    ap.add_argument("--host", action="store_true", help="also measure host time per call on tiny tensors")
    ap.add_argument("--host-n", type=int, default=100)
    ap.add_argument("--cells", default=None, help="bench/matrix.py's cells (JSON list) to run before any --configs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    report = {"ok": False, "error": None, "results": [], "host": [], "torch_add_host_us": None}

    def dump():
        text = json.dumps(report, default=str)
        if args.json == "-":
            return
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.json)

    try:
        run(args, report, dump)
    except Exception as exc:  # never leave the parent without JSON
        import traceback
        report["ok"] = False
        report["error"] = f"{type(exc).__name__}: {exc}"[:300]
        report["trace"] = traceback.format_exc()[-2000:]
    dump()
    if args.json == "-":
        print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
