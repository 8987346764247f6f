"""Where one TileLang kernel build's seconds go, without a GPU (nvcc on PATH):

    python bench/tilelang_build_profile.py lokr 23 [--arch sm_90a]
    python bench/tilelang_build_profile.py lora --kernel bypass_fwd_kernel \
        --args '[4096, 4096, 64, "bfloat16", null, "bfloat16", 64, 128, 64, 2, 128, true, 0]'

builds entry N of ``lycoris_ops.backends.tilelang.kernels.<family>.compile_specs(bf16)`` (or the family's builder
``--kernel`` at ``--args``, a JSON list: a bench shape's kernel) once, in a fresh
TileLang cache (a new temporary folder, also where ``TILELANG_CACHE_DIR`` is set: a warm
cache would time a load; ``--cache DIR`` to use one: run twice, the second run times the
load from the disk cache), and prints the
total, the subprocesses (nvcc, the host compiler of the disk-cache export), the top-level
TVM passes and the seconds in TileLang's Python macro parser (``eager.ast.mutate``), each
timed by wrapping ``subprocess.Popen``, ``tvm.ir.transform.Pass.__call__`` and
``tilelang.language.eager.builder.mutate`` (whatever is installed there: with
``common``'s macro memo, the memo's hits and misses, also counted;
``LYCORIS_TILELANG_MACRO_MEMO=0`` times TileLang's own). A cold first call lasts about as
long as its slowest kernel's build plus the timing.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import subprocess
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("family", help="a lycoris_ops.backends.tilelang module: lora, loha, lokr, ...")
    ap.add_argument("index", type=int, nargs="?", default=0, help="the entry of its compile_specs(bf16)")
    ap.add_argument("--kernel", default=None, help="a builder of the family (with --args) instead of an entry")
    ap.add_argument("--args", default=None, help="the builder's arguments, a JSON list")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--cache", default=None, help="TileLang's cache folder (default: a new temporary one)")
    args = ap.parse_args()
    os.environ["TILELANG_CACHE_DIR"] = args.cache or tempfile.mkdtemp(prefix="tl-build-profile-")
    import torch
    from lycoris_ops.backends.tilelang import common as _common
    _common.tl()  # TileLang's import, outside the timed build
    from tilelang.language.eager import builder
    from tvm.ir import transform

    procs, passes, macro = [], collections.Counter(), [0.0]

    class Timed(subprocess.Popen):
        def __init__(self, *a, **k):
            self._t0, self._cmd = time.perf_counter(), (a[0] if a else k.get("args"))
            super().__init__(*a, **k)

        def wait(self, *a, **k):
            rc = super().wait(*a, **k)
            procs.append((time.perf_counter() - self._t0, os.path.basename(str(list(self._cmd)[0]))))
            return rc

    subprocess.Popen = Timed
    run_pass, depth = transform.Pass.__call__, [0]

    def timed_pass(self, mod):
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return run_pass(self, mod)
        finally:
            depth[0] -= 1
            if depth[0] == 0:  # top-level passes only (a Sequential's members are inside it)
                passes[self.info.name] += time.perf_counter() - t0

    transform.Pass.__call__ = timed_pass
    mutate = builder.mutate

    def timed_mutate(func):
        t0 = time.perf_counter()
        try:
            return mutate(func)
        finally:
            macro[0] += time.perf_counter() - t0

    builder.mutate = timed_mutate
    module = importlib.import_module(f"lycoris_ops.backends.tilelang.kernels.{args.family}")
    if args.kernel:
        fn, spec = getattr(module, args.kernel), tuple(json.loads(args.args or "[]"))
    else:
        fn, spec = module.compile_specs(torch.bfloat16)[args.index]
    t0 = time.perf_counter()
    _common.compile_only(fn, args.arch, *spec)
    total = time.perf_counter() - t0
    print(f"{fn.__name__}{spec} for {args.arch}: {total:.2f} s")
    for s, name in procs:
        print(f"  subprocess {name:<12} {s:6.2f} s")
    memo = _common.macro_memo_stats()
    memo = f" (memo: {memo['hits']} hits, {memo['misses']} misses)" if memo["installed"] else " (no memo)"
    print(f"  passes (top level)      {sum(passes.values()):6.2f} s; macro parsing {macro[0]:.2f} s{memo}")
    for name, s in passes.most_common(8):
        print(f"    {name:<28} {s:6.2f} s")


if __name__ == "__main__":
    main()
