"""What the TileLang test files share: the compile matrix and the op-set-vs-eager check."""
import os
import re

import pytest
import torch

from lycoris_ops.testing import REL_TOL, rel_err

#: (arch, dtype) pairs compiled by default; LYCORIS_TILELANG_FULL_COMPILE=1 adds the other two
MATRIX = [("sm_90a", torch.bfloat16), ("sm_80", torch.float16)]
if os.environ.get("LYCORIS_TILELANG_FULL_COMPILE", "") not in ("", "0"):
    MATRIX += [("sm_90a", torch.float16), ("sm_80", torch.bfloat16)]
IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
GPU = torch.cuda.is_available()
#: test_kernels_compile's cases (arch, dtype, part of compile_specs): the quick suite builds each
#: builder's default config for MATRIX's first pair; ``-m slow`` the other specs and pairs
COMPILE_CASES = [
    pytest.param(*MATRIX[0], "defaults", id=f"{MATRIX[0][0]}-{IDS[MATRIX[0][1]]}-defaults"),
    pytest.param(*MATRIX[0], "others", id=f"{MATRIX[0][0]}-{IDS[MATRIX[0][1]]}-others", marks=pytest.mark.slow),
    *(pytest.param(a, d, "all", id=f"{a}-{IDS[d]}", marks=pytest.mark.slow) for a, d in MATRIX[1:]),
]


def compile_part(specs, part):
    """A family's ``compile_specs`` cut to ``part``: "defaults" has each builder's spec with
    the fewest arguments (the most left at their defaults; the first of those), "others" the
    rest, "all" every spec."""
    if part == "all":
        return list(specs)
    fewest = {}
    for i, (builder, args) in enumerate(specs):
        if builder not in fewest or len(args) < len(specs[fewest[builder]][1]):
            fewest[builder] = i
    defaults = set(fewest.values())
    return [s for i, s in enumerate(specs) if (i in defaults) == (part == "defaults")]


#: test_twin_case_table_fp32's parts of a case table: each op's first case (quick), the others (slow)
CASE_PARTS = [pytest.param("first", id="first"), pytest.param("others", id="others", marks=pytest.mark.slow)]


def case_part(cases, part):
    """The cases of a case table (``lycoris_ops.testing``) in ``part``: "first" has each op's
    first case, "others" the rest."""
    seen, picked = set(), []
    for case in cases:
        if (case.op not in seen) == (part == "first"):
            picked.append(case)
        seen.add(case.op)
    return picked


def outs(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def compare(opset, reference, op, args, dtype, tol=None):
    """The op-set function against the eager body: same dtypes/shapes, fresh contiguous, close."""
    got = outs(getattr(opset, op)(*args))
    want = outs(getattr(reference, op)(*args))
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (op, k, g.dtype, w.dtype, g.shape, w.shape)
        assert g.is_contiguous(), (op, k)
        assert all(g.data_ptr() != a.data_ptr() for a in args if isinstance(a, torch.Tensor) and a.numel())
        err = rel_err(g, w)
        assert err <= (tol or REL_TOL[dtype]), f"{op} output {k}: rel err {err:.3e}"


#: the dynamic shared memory one block may ask for, by arch (the opt-in maxima)
SMEM_LIMIT = {"sm_90a": 227 * 1024, "sm_90": 227 * 1024, "sm_80": 163 * 1024}


def dynamic_smem(kernel) -> int:
    """The dynamic shared memory (bytes) a compiled TileLang kernel launches with: the last
    launch argument its host code passes (grid, block, then the shared-memory size); 0 where
    the host code does not show one."""
    src = kernel.get_host_source()
    best = 0
    for m in re.finditer(r"TVMFFIFunctionCall\(\w+, \(TVMFFIAny\*\) stack_ffi_any, (\d+),", src):
        n = int(m.group(1))
        slots = re.findall(r"stack_ffi_any\)\[%d\]\.v_int64\) = \(\(int64_t\)(\d+)\)" % (n - 1), src[:m.start()])
        if slots:
            best = max(best, int(slots[-1]))
    return best


def compile_failures(pending):
    """Compile each captured kernel (``_common.capturing``) for its arch; one line per kernel
    that fails (builder, its last arguments, the error) or asks for more shared memory than
    its arch's block has, so a test reports them all at once."""
    from lycoris_ops.backends.tilelang import common as _common

    failed = []
    for p in pending:
        try:
            k = _common.compile_only(p.builder, p.arch, *p.args)
        except Exception as exc:  # collected, not raised: every failing config in one report
            failed.append((p.builder.__name__, p.args[-6:], str(exc).splitlines()[0][:120]))
            continue
        smem, limit = dynamic_smem(k) if p.arch in SMEM_LIMIT else 0, SMEM_LIMIT.get(p.arch, 0)
        if smem > limit:
            failed.append((p.builder.__name__, p.args[-6:], f"{smem // 1024} KiB of shared memory > {limit // 1024}"))
    return failed


def corners(cfgs, key=lambda c: c["BT"]):
    """The configs of ``cfgs`` at the smallest and the largest value of ``key`` (default: the
    positions per tile, BT)."""
    ends = (min(map(key, cfgs)), max(map(key, cfgs)))
    return [c for c in cfgs if key(c) in ends]


def compile_calls(calls):
    """Run each (op function, args, cfg) under ``_common.capturing`` (kernels built, nothing
    launched) and compile every captured kernel: (kernels captured, ``compile_failures``)."""
    from lycoris_ops.backends.tilelang import runner as tl_pick
    from lycoris_ops.backends.tilelang import common as _common

    with _common.capturing() as pending:
        for fn, args, cfg in calls:
            tl_pick._call(fn, args, cfg)
    return len(pending), compile_failures(pending)
