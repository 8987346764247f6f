"""Bad input and state that used to misbehave (issue #57): a missing gradient in the
diag-OFT / BOFT backward ops, add_scaled's silent reshape, outputs too big for the device
(expanded inputs), corrupt tuning tables, and ``python -m lycoris_ops --why`` on a machine
without CUDA. Each raises or warns clearly on CPU and under the fakes alike."""
from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lycoris_ops  # noqa: F401
from lycoris_ops.reference import checks as _checks
from lycoris_ops.backends import registry as dispatch
from lycoris_ops.tuner import tune

OPS = torch.ops.lycoris


def _fake_call(op, args, device=None):
    """``op`` on fake copies of ``args`` (FakeTensorMode), or on meta tensors (``device="meta"``)."""
    if device == "meta":
        return getattr(OPS, op)(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    with FakeTensorMode() as mode:
        return getattr(OPS, op)(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))


def _run(op, args, mode):
    return getattr(OPS, op)(*args) if mode == "cpu" else _fake_call(op, args, None if mode == "fake" else "meta")


MODES = ["cpu", "fake", "meta"]


# ----------------------------------------------------------------------- grad=None (oft/boft bwd)

GRAD_NONE = {
    "oft_bwd": lambda: (None, torch.randn(2, 3, 3), torch.randn(6, 4), None, 1.0, True, True),
    "boft_bwd": lambda: (None, torch.randn(1, 2, 2, 2), torch.randn(4, 3), 0, 1.0, 1.0),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", sorted(GRAD_NONE))
def test_missing_grad_is_named(op, mode):
    """Used to be AttributeError: 'NoneType' object has no attribute 'shape' ('new_empty' in the fakes)."""
    with pytest.raises(ValueError, match=rf"^lycoris\.{op}: grad must be a Tensor, got NoneType$"):
        _run(op, GRAD_NONE[op](), mode)


def test_grad_is_still_checked_after_a_good_call():
    """A valid call caches its check: a following call with grad=None still raises."""
    args = list(GRAD_NONE["oft_bwd"]())
    args[0] = torch.randn(6, 4)
    outs = OPS.oft_bwd(*args)
    assert outs[0].shape == (6, 4) and outs[1].shape == (2, 3, 3)
    with pytest.raises(ValueError, match="grad must be a Tensor"):
        OPS.oft_bwd(None, *args[1:])


# ----------------------------------------------------------------------- add_scaled shapes

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("delta_shape", [(5, 19), (95,), (19, 1), (1, 5), (5,)])
def test_add_scaled_demands_base_shape(delta_shape, mode):
    """No reshape (used to return base + γ·delta.reshape(base.shape)) and no broadcasting."""
    with pytest.raises(ValueError, match=r"lycoris\.add_scaled: delta must have shape \(19, 5\) \(base's shape\), "
                                         rf"got \({', '.join(map(str, delta_shape))},?\)"):
        _run("add_scaled", (torch.randn(19, 5), torch.randn(delta_shape), 0.5), mode)


def test_add_scaled_strided_delta_of_base_shape():
    base, delta = torch.randn(19, 5), torch.randn(5, 19).t()  # base's shape, transposed strides
    torch.testing.assert_close(OPS.add_scaled(base, delta, -0.75), base - 0.75 * delta)


def test_scaled_add_with_a_tensor_multiplier_checks_shapes_too():
    from lycoris_ops.functional.full import scaled_add

    with pytest.raises(ValueError, match="delta must have shape"):
        scaled_add(torch.randn(19, 5), torch.randn(95), torch.tensor(0.5, requires_grad=True))


# ----------------------------------------------------------------------- output size

B = 10**6


def _expanded(*shape, device="cpu"):
    return torch.zeros([1] * len(shape), device=device).expand(*shape)


BIG = {  # op -> f(device): args whose output(s) need terabytes; every big operand is an expanded view
    "dora_fwd": lambda d: (_expanded(B, B, device=d), torch.ones(B, device=d), 1.0, 0),
    "dora_bwd": lambda d: (_expanded(B, B, device=d), _expanded(B, B, device=d), torch.ones(B, device=d),
                           torch.ones(B, device=d), 1.0, 0),
    "ia3_fwd": lambda d: (_expanded(B, B, device=d), torch.ones(B, device=d), -1, 1.0, 1.0),
    "add_scaled": lambda d: (_expanded(B, B, device=d), _expanded(B, B, device=d), 1.0),
    "oft_fwd": lambda d: (torch.randn(2, 4, 4, device=d), _expanded(8, 10**12, device=d), None, 1.0, True, True),
    "boft_fwd": lambda d: (torch.randn(1, 2, 2, 2, device=d), _expanded(4, 10**12, device=d), 0, 1.0, 1.0, None,
                           False),
    "lora_merge_fwd": lambda d: (_expanded(B, 4, device=d), _expanded(4, B, device=d), None, None, None, 1.0,
                                 "plain"),
    "lora_bypass_fwd": lambda d: (_expanded(10**8, 64, device=d), _expanded(10**5, 4, device=d),
                                  torch.randn(4, 64, device=d), 1.0),
    "lokr_full_merge_fwd": lambda d: (_expanded(10**5, 10**5, device=d), torch.randn(10, 10, device=d), None, 1.0),
}


def _too_big(op, device):
    return rf"^lycoris\.{op}: the outputs? would need [0-9.]+ TiB, more than the [0-9.]+ [GT]iB of memory of {device}: "


@pytest.mark.parametrize("mode", ["cpu", "fake"])
@pytest.mark.parametrize("op", sorted(BIG))
def test_output_too_big_fails_fast(op, mode):
    """dora_fwd on a 10⁶×10⁶ expanded zero computed for about 25 minutes before its
    allocation failed: the check of the output size raises before anything runs."""
    args = BIG[op]("cpu")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=_too_big(op, "cpu")):
        _run(op, args, mode)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(BIG))
def test_output_too_big_fails_fast_on_cuda(op):
    """The same check before the CUDA key's choice of tier (fused op sets included)."""
    args = BIG[op]("cuda")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=_too_big(op, r"cuda:\d")):
        getattr(OPS, op)(*args)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(GRAD_NONE))
def test_missing_grad_is_named_on_cuda(op):
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in GRAD_NONE[op]())
    with pytest.raises(ValueError, match=rf"^lycoris\.{op}: grad must be a Tensor, got NoneType$"):
        getattr(OPS, op)(*args)


@pytest.mark.gpu
def test_add_scaled_demands_base_shape_on_cuda():
    with pytest.raises(ValueError, match=r"delta must have shape \(19, 5\)"):
        OPS.add_scaled(torch.randn(19, 5, device="cuda"), torch.randn(5, 19, device="cuda"), 0.5)


def test_output_size_names_the_argument():
    with pytest.raises(ValueError, match=r"\(1000000, 1000000\) float32, the shape of w \(w: an expanded view, "
                                         r"stride 0\)"):
        OPS.dora_fwd(*BIG["dora_fwd"]("cpu"))
    with pytest.raises(ValueError, match=r"from a1 \(1000000, 4\), b1 \(4, 1000000\)"):
        OPS.lora_merge_fwd(*BIG["lora_merge_fwd"]("cpu"))


def test_output_beyond_int64_on_meta():
    """meta tensors have no memory to compare with: past int64 bytes is still an error."""
    a1, b1 = torch.empty(2**40, 1, device="meta"), torch.empty(1, 2**40, device="meta")
    with pytest.raises(ValueError, match="more than int64 can index"):
        OPS.lora_merge_fwd(a1, b1, None, None, None, 1.0, "plain")
    small = OPS.lora_merge_fwd(torch.empty(2**20, 1, device="meta"), torch.empty(1, 2**20, device="meta"),
                               None, None, None, 1.0, "plain")
    assert small.shape == (2**20, 2**20)  # 4 TiB on meta: fine, nothing is allocated


def test_device_memory_bound():
    assert _checks.device_memory("cpu") > 2**20
    assert _checks.device_memory("meta") is None


def test_symbolic_sizes_are_not_guarded():
    """Dynamic token dims (make_fx symbolic) pass the size check without specializing."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda a, b: OPS.add_scaled(a, b, 0.5), tracing_mode="symbolic")(torch.randn(7, 5),
                                                                                 torch.randn(7, 5))
    assert gm(torch.randn(9, 3), torch.randn(9, 3)).shape == (9, 3)


# ----------------------------------------------------------------------- corrupt tuning tables

A = {"block": 64, "num_warps": 4}
EAGER = tune.SENTINEL_EAGER


def _select():
    """A tuned pick on CPU with a fake timer (what a fused op does on a cold key)."""
    times = {"block=64,num_warps=4": 1e-6, EAGER: 2e-6}

    def timer(fn, cand):
        fn()
        return times[tune.label(cand)]

    return tune.select_config("add_scaled", "triton", (("dtype", "float32"), ("T", 64)), [A, EAGER],
                              lambda c: torch.ones(3), device="cpu", version=1, timer=timer)


def _nested(depth):
    return ('{"version": 1, "rows": ' + '{"a": ' * depth + "1" + "}" * depth + "}").encode()


CORRUPT = {
    "not_utf8": b'{"version": 1, "rows": {"k\xff\xfe": {}}}',
    "deep_nesting": _nested(200_000),
    "deep_list": b"[" * 200_000,
    "top_level_string": b'"rows"',
    "top_level_null": b"null",
    "rows_a_list": b'{"version": 1, "rows": [1, 2]}',
    "version_an_object": b'{"version": {"v": 1}, "rows": {}}',
    "truncated": b'{"version": 1, "rows": {"cpu|triton|add_scaled|v1|dtype=float32,T=64": {"con',
    "empty": b"",
}


@pytest.mark.parametrize("kind", sorted(CORRUPT) + ["directory", "unreadable"])
def test_corrupt_table_one_warning_and_the_op_answers(kind, tmp_path, fresh_tuner):
    """Used to raise UnicodeDecodeError / RecursionError; every unreadable table now gives
    one warning naming it, is ignored, and the selection still answers."""
    path = tmp_path / "cache" / "tuning.json"
    os.makedirs(path.parent)
    if kind == "directory":
        os.makedirs(path)
    elif kind == "unreadable":
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            pytest.skip("root reads any file")
        path.write_text("{}")
        path.chmod(0)
    else:
        path.write_bytes(CORRUPT[kind])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _select() == A
        assert _select() == A
    ours = [str(w.message) for w in caught if str(path) in str(w.message)]
    assert len(ours) == 1, ours
    assert ("ignoring the tuning table" in ours[0] or "another program's table" in ours[0]), ours[0]
    assert all(w.category is RuntimeWarning for w in caught if str(path) in str(w.message))


def test_read_json_table_never_raises(tmp_path):
    from lycoris_ops.tuner.store import read_json_table

    for name, data in CORRUPT.items():
        p = tmp_path / name
        p.write_bytes(data)
        rows, problem, _ = read_json_table(str(p), 1, "rows")
        assert rows == {} and problem is not None, name
    rows, problem, _ = read_json_table(str(tmp_path), 1, "rows")
    assert rows == {} and problem == "directory"


# ----------------------------------------------------------------------- python -m lycoris_ops --why

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only explanation")
def test_why_on_a_machine_without_cuda(capsys, monkeypatch):
    """Used to print the same as without --why: each fused tier now says why it takes no calls here."""
    from lycoris_ops.__main__ import main

    assert main(["--why"]) == 0
    out = capsys.readouterr().out
    assert "    triton: no CUDA device" in out and "runs only under its interpreter (TRITON_INTERPRET=1" in out
    assert "    tilelang: no CUDA device" in out
    assert "    compile: takes CUDA calls only" in out
    lines = out.splitlines()
    for op in lycoris_ops.OP_NAMES:
        row = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [op])
        assert "cpu: skipped triton (no CUDA device), tilelang (no CUDA device), compile (takes CUDA calls only)" \
            in lines[row + 1], op
    # TileLang absent: the reason says so
    monkeypatch.setitem(dispatch._PROBE, "tilelang", "no_such_module_for_lycoris_tests")
    dispatch.refresh()
    try:
        assert main(["--why", "--no-samples"]) == 0
        out = capsys.readouterr().out
        assert "    tilelang: not installed (import no_such_module_for_lycoris_tests failed: ModuleNotFoundError" in out
    finally:
        monkeypatch.undo()
        dispatch.refresh()


def test_without_why_no_reasons(capsys):
    from lycoris_ops.__main__ import main

    assert main(["--no-samples"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device (" not in out and "LYCORIS_KERNEL_TUNE_BUDGET" in out
