"""What compiling in forked children costs and saves, on this machine (no GPU needed).

    python bench/compile_children.py --forks            # fork time against the parent's memory
    python bench/compile_children.py --tilelang         # BOFT's TileLang kernels: one after the other vs children

``--forks``: the seconds 4 forks (and their exits) take with 0, 2 and 8 GiB of
anonymous memory in the parent: the basis of ``tuner/build_pool.py: FORK_S_PER_GIB``.
``--tilelang``: ``tilelang/boft.py: compile_specs(bf16)`` compiled for sm_90a, each
phase in a fresh process with an empty ``TILELANG_CACHE_DIR`` (TileLang also keeps an
in-memory cache, which forked children would inherit): one after the other; then one
forked child per kernel through ``build_pool.compile_forked``, followed by the parent's
own build of the same kernels (a load from the disk cache the children filled).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch


def forks(sizes=(0, 2, 8), n=4):
    from lycoris_ops.tuner import build_pool

    for gib in sizes:
        x = torch.ones(int(gib * 2**30 / 4)) if gib else None
        t0 = time.perf_counter()
        pids = []
        for _ in range(n):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            pids.append(pid)
        fork_s = time.perf_counter() - t0
        for p in pids:
            os.waitpid(p, 0)
        print(f"{gib} GiB added (RssAnon {build_pool.anon_gib():.2f} GiB): {n} forks {fork_s:.3f} s, "
              f"with their exits {time.perf_counter() - t0:.3f} s")
        del x


def tilelang_phase(phase: str):
    from lycoris_ops.tuner import build_pool
    from lycoris_ops.backends.tilelang import common as C
    from lycoris_ops.backends.tilelang.kernels import boft

    pending = [C.Pending(b, "sm_90a", a) for b, a in boft.compile_specs(torch.bfloat16)]
    t0 = time.perf_counter()
    if phase == "sequential":
        for p in pending:
            p.build()
        print(f"{len(pending)} kernels one after the other: {time.perf_counter() - t0:.2f} s", flush=True)
        return
    children, failures = build_pool.compile_forked(pending, len(pending), timeout_s=600)
    t1 = time.perf_counter()
    print(f"{len(pending)} kernels in {children} forked children: {t1 - t0:.2f} s ({failures} failed)", flush=True)
    for p in pending:
        p.build()
    print(f"the parent's build afterwards (disk cache): {time.perf_counter() - t1:.2f} s", flush=True)


def tilelang():
    for phase in ("sequential", "forked"):
        env = dict(os.environ, TILELANG_CACHE_DIR=tempfile.mkdtemp())
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--phase", phase], env=env,
                             capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr[-2000:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forks", action="store_true")
    ap.add_argument("--tilelang", action="store_true")
    ap.add_argument("--phase", choices=["sequential", "forked"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.phase:
        return tilelang_phase(a.phase)
    if a.forks:
        forks()
    if a.tilelang:
        tilelang()


if __name__ == "__main__":
    main()
