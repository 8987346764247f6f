"""How many distinct Triton compilations a cold key's shortlist costs, counted on CPU.

A cold key (empty table, empty Triton cache) compiles every kernel variant its
shortlist launches: one per distinct (kernel function, specialization of its
runtime arguments, constexpr values, num_warps, num_stages, ...), the key Triton
caches compiled kernels under. ``count(op, ...)`` builds the op's warm-up sample
(``plans/<family>.py: samples``) on the ``meta`` device at the given layer shape
and token count, asks the family planner for the shortlist it would time on a
device (``DeviceFacts``: a synthetic H200 by default), and runs each fused
candidate through the real launcher with the kernel launches intercepted
(``fn[grid](...)`` records instead of launching; no GPU, nothing computed), so the
count follows the launchers' own config -> kernel mapping.

Pointers are taken as 16-byte aligned (meta tensors have address 0); integers are
specialized as Triton does (== 1, divisible by 16) except ``do_not_specialize``.

    python -m lycoris_ops.backends.triton.compiles --ops oft_bwd,boft_fwd --shape 4096x4096:r64 --tokens 32768 [-v]

``--compile`` also builds each distinct kernel for sm_90 on this host (Triton's
ptxas, no GPU; run with an empty ``TRITON_CACHE_DIR`` and without
``TRITON_INTERPRET``) and prints the seconds, one after the other.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from lycoris_ops.backends.triton.tuning import MODULE_OF
from lycoris_ops.testing.samples import SAMPLES, parse_layer
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.device import DeviceFacts, synthetic

__all__ = ["Launch", "Report", "count", "compile_seconds", "build", "ptxas_usage", "SLOW_OPS", "main"]

_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
                   "launch_pdl")
_lock = threading.Lock()


@dataclass(frozen=True)
class Launch:
    """One compiled-kernel identity: what Triton's cache key depends on."""

    kernel: str
    spec: Tuple[Tuple[str, Any], ...]  # runtime arguments: (name, (type, specialization))
    constexprs: Tuple[Tuple[str, str], ...]
    options: Tuple[Tuple[str, Any], ...]
    raw: Any = field(default=None, compare=False, hash=False, repr=False)  # (kernel, {name: value})

    def short(self) -> str:
        c = ",".join(f"{k}={v}" for k, v in self.constexprs)
        o = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.kernel}[{c}|{o}]"


@dataclass
class Report:
    op: str
    candidates: List[str] = field(default_factory=list)  # labels, eager included
    per_candidate: List[List[Launch]] = field(default_factory=list)  # fused candidates' distinct compiles
    distinct: List[Launch] = field(default_factory=list)  # union, in first-seen order
    failed: Dict[str, str] = field(default_factory=dict)

    @property
    def n_distinct(self) -> int:
        return len(self.distinct)

    def by_kernel(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for launch in self.distinct:
            out[launch.kernel] = out.get(launch.kernel, 0) + 1
        return out

    def summary(self) -> str:
        kpc = [len(p) for p in self.per_candidate]
        lines = [f"{self.op}: {len(self.candidates)} candidates ({len(kpc)} fused), kernels per candidate {kpc}, "
                 f"distinct compiles {self.n_distinct} {self.by_kernel()}"]
        for label, why in self.failed.items():
            lines.append(f"  FAILED {label}: {why}")
        return "\n".join(lines)


def _kernel_fn(kernel):
    fn = getattr(kernel, "fn", None)
    while fn is not None and hasattr(fn, "fn") and not inspect.isfunction(fn):
        fn = fn.fn
    return fn


def _identity(kernel, args, kwargs) -> Launch:
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    fn = _kernel_fn(kernel)
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k in _LAUNCH_OPTIONS}
    sig = inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    dns = getattr(kernel, "do_not_specialize", None)
    if dns is None:
        dns = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    spec, const, raw = [], [], {}
    for i, (name, p) in enumerate(sig.parameters.items()):
        v = bound.arguments[name]
        if "constexpr" in str(p.annotation):
            const.append((name, str(v)))
            raw[name] = v
            continue
        specialize = not (i in dns or name in dns)
        try:
            s = native_specialize_impl(BaseBackend, v, False, specialize, True)
        except Exception:
            s = (type(v).__name__, None)
        spec.append((name, tuple(str(x) for x in s)))
        if s[0] == "constexpr":
            raw[name] = s[1]
    opts.setdefault("num_warps", 4)
    opts.setdefault("num_stages", 3)
    return Launch(f"{fn.__module__}.{fn.__qualname__}", tuple(spec), tuple(const), tuple(sorted(opts.items())),
                  (kernel, raw))


@contextlib.contextmanager
def _intercept(sink: List[Launch]):
    """``kernel[grid](...)`` records the launch's compile identity and launches nothing
    (also through ``fast(kernel)``, whose direct launcher is turned off meanwhile: it would
    look for a CUDA device)."""
    from triton.runtime.jit import KernelInterface

    from lycoris_ops.backends.triton import common as _common

    original, direct = KernelInterface.__getitem__, _common._INTERPRETED[0]

    def getitem(self, grid):
        return lambda *args, **kwargs: sink.append(_identity(self, args, dict(kwargs)))

    KernelInterface.__getitem__ = getitem
    _common._INTERPRETED[0] = True  # FastJIT then goes through kernel[grid]
    try:
        yield
    finally:
        KernelInterface.__getitem__ = original
        _common._INTERPRETED[0] = direct


@contextlib.contextmanager
def _planning(pm, dev: DeviceFacts, captured: list):
    """The family glue tunes ``meta`` calls with ``dev``'s facts; ``tune.pick`` hands its
    arguments to ``captured`` instead of timing; the launchers see ``dev``'s SM count."""
    from lycoris_ops.backends.triton import common as _common

    saved: List[Tuple[Any, str, Any]] = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def pick(op, backend, key, plan, run_fused, run_eager, **kw):
        captured.append((op, plan, run_fused, kw))
        return {}

    real_num_sms = _common.num_sms

    def num_sms(device):
        return dev.sm_count if device.type == "meta" else real_num_sms(device)

    try:
        patch(pm, "DEVICE_TYPES", tuple(pm.DEVICE_TYPES) + ("meta",))
        patch(pm, "facts", lambda d: dev)
        patch(tune, "pick", pick)
        for name, mod in list(sys.modules.items()):
            if name.startswith("lycoris_ops.backends.triton") and getattr(mod, "num_sms", None) is real_num_sms:
                patch(mod, "num_sms", num_sms)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def count(op: str, layer="4096x4096:r64", tokens: int = 32768, dtype=torch.bfloat16,
          dev: Optional[DeviceFacts] = None) -> Report:
    """The distinct Triton compilations of ``op``'s cold-key shortlist at ``layer``
    (``Layer`` or ``"OxI[:rR]"``) and ``tokens``, planned for ``dev`` (default a
    synthetic H200)."""
    dev = dev or synthetic()
    layer = parse_layer(layer) if isinstance(layer, str) else layer
    pm = MODULE_OF.get(op)
    if pm is None:
        raise ValueError(f"lycoris_ops.backends.triton.compiles: no Triton tuning has op {op!r}")
    with torch.no_grad():
        args = next((a for samples in SAMPLES.values()
                     for o, a in samples(layer, int(tokens), dtype, torch.device("meta"), None) if o == op), None)
    if args is None:
        raise ValueError(f"lycoris_ops.backends.triton.compiles: {op} has no sample at {layer}")
    from lycoris_ops.backends import select

    full = select._full_args(op, args)
    captured: list = []
    report = Report(op)
    with _lock, torch.no_grad():
        tune.clear(tables=False)  # no front-cache hit from an earlier count
        with _planning(pm, dev, captured):
            pm.KWARGS[op](*full)
            if not captured:
                raise RuntimeError(f"lycoris_ops.backends.triton.compiles: {op}'s glue did not reach tune.pick")
            _, plan, run_fused, kw = captured[0]
            cands = list(plan() if callable(plan) else plan)
            resolve = kw.get("resolve") or (lambda c: c)
            seen: Dict[Launch, None] = {}
            for c in cands:
                label = tune.label(c)
                report.candidates.append(label)
                if tune.is_eager(c):
                    continue
                sink: List[Launch] = []
                try:
                    with _intercept(sink):
                        run_fused(resolve(c))
                except Exception as exc:  # a candidate the launcher rejects
                    report.failed[label] = f"{type(exc).__name__}: {exc}"
                mine = list(dict.fromkeys(sink))
                report.per_candidate.append(mine)
                for launch in mine:
                    seen.setdefault(launch, None)
            report.distinct = list(seen)
        tune.clear(tables=False)
    return report


def compile_seconds(launch: Launch, arch: int = 90) -> float:
    """Seconds Triton takes to compile ``launch`` for ``sm_<arch>`` on this host (cold:
    run with an empty ``TRITON_CACHE_DIR``; needs a process without the interpreter and
    Triton's ptxas; no GPU)."""
    import time

    t0 = time.perf_counter()
    build(launch, arch)
    return time.perf_counter() - t0


def build(launch: Launch, arch: int = 90):
    """Triton's compiled kernel of ``launch`` for ``sm_<arch>`` (see ``compile_seconds``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    kernel, raw = launch.raw
    if not hasattr(kernel, "params"):
        raise RuntimeError("lycoris_ops.backends.triton.compiles: compiling needs TRITON_INTERPRET unset")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    spec = dict(launch.spec)
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        if p.name in raw:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = raw[p.name]
        else:
            ty, attr = spec[p.name][0], spec[p.name][1]
            signature[p.name] = ty
            if attr not in ("None", ""):
                attrs[(i,)] = backend.parse_attr(attr)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=dict(launch.options))


def ptxas_usage(compiled, arch: int = 90) -> Dict[str, int]:
    """Registers a thread, spill store / load bytes (``ptxas -v`` on the kernel's PTX, with
    Triton's ptxas) and shared-memory bytes of a ``build`` result."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(arch) if "arch" in inspect.signature(get_ptxas).parameters else get_ptxas()
    path = getattr(tool, "path", None) or tool[0]
    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/k.ptx"
        with open(src, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([path, "-v", f"--gpu-name=sm_{arch}a", src, "-o", f"{tmp}/k.o"],
                             capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr

    def num(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "shared": int(compiled.metadata.shared)}


#: the keys over the 2 s cold-tuning target on the H200 (T=32768, 4096x4096, r=64, bf16)
SLOW_OPS = ("oft_bwd", "boft_bwd", "loha_bypass_bwd", "boft_fwd", "lokr_merge_bwd", "oft_fwd")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lycoris_ops.backends.triton.compiles",
                                description="Count the distinct Triton compilations of cold keys' shortlists (CPU).")
    p.add_argument("--ops", default=",".join(SLOW_OPS), help="comma-separated op names")
    p.add_argument("--shape", default="4096x4096:r64", help="layer OxI[:rR]")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("-v", "--verbose", action="store_true", help="list every candidate's kernels")
    p.add_argument("--compile", action="store_true",
                   help="also compile each distinct kernel for sm_90 here and report the seconds (set an empty "
                        "TRITON_CACHE_DIR; no TRITON_INTERPRET)")
    a = p.parse_args(argv)
    import lycoris_ops  # noqa: F401  (registers the ops)

    for op in [o.strip() for o in a.ops.split(",") if o.strip()]:
        r = count(op, a.shape, a.tokens, getattr(torch, a.dtype))
        print(r.summary())
        if a.compile:
            secs = [compile_seconds(launch) for launch in r.distinct]
            print(f"  compile seconds (sm_90, this host, one after the other): total {sum(secs):.2f}")
            for launch, t in zip(r.distinct, secs):
                print(f"    {t:6.2f}  {launch.short()}")
        if a.verbose:
            fused = [lab for lab in r.candidates if lab != tune.SENTINEL_EAGER]
            for lab, launches in zip(fused, r.per_candidate):
                print(f"  {lab}")
                for launch in launches:
                    print(f"      {launch.short()}")
    return 0


if __name__ == "__main__":
    from lycoris_ops.backends.triton import compiles as _c

    sys.exit(_c.main())
