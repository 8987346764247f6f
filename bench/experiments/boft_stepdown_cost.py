"""The BOFT step-down body's cost on the CPU host, for whichever tree is on ``PYTHONPATH``
(compare trees by running it once per tree, e.g. ``git archive <commit> | tar -x -C /tmp/t``
with that tree's ``_C`` built):

    python bench/experiments/boft_stepdown_cost.py copies [cl|conv|weight]   # fwd+bwd at s48/nb64/m7
    python bench/experiments/boft_stepdown_cost.py compile                   # torch.compile, 12 bf16 cases

``copies``: one fwd+bwd step (rescale and diff on) of ``boft_fwd_native`` / ``boft_bwd_native``
on bf16 x at blocks (7, 64, 48, 48): copies per step (token-sized ones counted apart), self CPU
time under the profiler and the best wall time of 5 (timed before profiling: a profiler session
slows later eager calls). A tree without the native bodies runs the exact ones.
``compile``: the first call of ``torch.compile`` of the body on the first 12 bf16 cases of the
op table (set ``TORCHINDUCTOR_CACHE_DIR`` to an empty folder for cold numbers).
"""
import collections
import sys
import time

import torch

import lycoris_ops  # noqa: F401  (the ops and their _C)
from lycoris_ops import testing
from lycoris_ops.reference import boft as B

FWD = getattr(B, "boft_fwd_native", B.boft_fwd)
BWD = getattr(B, "boft_bwd_native", B.boft_bwd)
COPY = ("aten::copy_", "aten::clone", "aten::contiguous")


def copies(layout: str) -> None:
    torch.manual_seed(0)
    m, nb, s = 7, 64, 48
    C = nb * s
    x, ax = {"cl": (torch.randn(8192, C), -1), "conv": (torch.randn(8, C, 32, 32), 1),
             "weight": (torch.randn(C, 3072), 0)}[layout]
    blocks = torch.randn(m, nb, s, s) * 0.05
    x = x.bfloat16()
    g, rs = torch.randn_like(x), torch.randn(C).bfloat16()

    def step():
        FWD(blocks, x, ax, 1.0, 0.9, rs, True)
        BWD(g, blocks, x, ax, 1.0, 0.9)

    step()
    walls = []
    for _ in range(5):
        t = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t)
    reps = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(reps):
            step()
    ev = prof.events()
    cnt = collections.Counter(e.name for e in ev if e.name in COPY)
    big = sum(1 for e in ev if e.name == "aten::copy_" and e.input_shapes and e.input_shapes[0]
              and torch.Size(e.input_shapes[0]).numel() >= x.numel())
    total = sum(e.self_cpu_time_total for e in ev)
    print(f"{B.__file__}: layout {layout}, x {tuple(x.shape)} bf16, blocks {tuple(blocks.shape)}: per fwd+bwd "
          f"copy_ {cnt['aten::copy_'] // reps} (token-sized {big // reps}), clone {cnt['aten::clone'] // reps}, "
          f"contiguous {cnt['aten::contiguous'] // reps}; self CPU {total / reps / 1e3:.0f} ms; "
          f"wall best of 5 {min(walls) * 1e3:.0f} ms")


def compile_time() -> None:
    cf, cb = torch.compile(FWD), torch.compile(BWD)
    total = 0.0
    for case in testing.cases("boft", dtype=torch.bfloat16)[:12]:
        t = time.time()
        (cb if case.op == "boft_bwd" else cf)(*case.args)
        total += time.time() - t
        print(f"  {case.op}/{case.id} {time.time() - t:.1f} s", flush=True)
    print(f"{B.__file__}: {'step-down' if FWD is not B.boft_fwd else 'exact'} body, 12 cases, {total:.0f} s")


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "copies"
    if mode == "compile":
        compile_time()
    else:
        copies(sys.argv[2] if len(sys.argv) > 2 else "cl")
