"""The op table is the one list of ops: everything that needs one reads it, and agrees."""
import inspect

import pytest
import torch

import lycoris_ops
from lycoris_ops import _C, reference, testing
from lycoris_ops._library import optable
from lycoris_ops.backends import scope


def test_table_matches_the_schemas_in_order():
    assert lycoris_ops.OP_NAMES == tuple(op.name for op in optable.OPS)
    optable.check_against(_C.schemas())
    with pytest.raises(RuntimeError, match="does not match"):
        optable.check_against(list(_C.schemas())[::-1])


@pytest.mark.parametrize("op", optable.OPS, ids=lambda op: op.name)
def test_each_row_has_its_check_eager_body_and_cases(op):
    params = [a.name for a in getattr(torch.ops.lycoris, op.name).default._schema.arguments]
    assert [p for p in inspect.signature(reference.check(op.name).__wrapped__).parameters] == params
    assert callable(reference.eager(op.name)) and callable(reference.step_down(op.name))
    assert any(c.op == op.name for c in testing.cases(op.family)), f"no test cases for {op.name}"


def test_autograd_pairs_forward_ops_with_first_order_backward_ops():
    bwd = {op.name for op in optable.OPS if op.autograd is None}
    assert bwd == {op.name for op in optable.OPS if op.name.endswith("_bwd")}
    called = {b for op in optable.OPS if op.autograd for b in op.autograd.calls}
    assert called == bwd  # every *_bwd op is some forward's backward
    for op in optable.OPS:
        if op.autograd and op.autograd.direct:
            args = [a.name for a in getattr(torch.ops.lycoris, op.name).default._schema.arguments]
            assert set(op.autograd.direct.args) - {"grad"} <= set(args), op.name


def test_scope_and_op_sets_name_only_table_ops():
    assert set(scope.SCOPE) <= set(optable.BY_NAME)
    triton_ops = pytest.importorskip("lycoris_ops.backends.triton.ops")
    from lycoris_ops.backends.triton.tuning import MODULE_OF
    assert triton_ops.__all__ == list(lycoris_ops.OP_NAMES)
    for op in optable.OPS:  # the Triton tuning module of each op is its kernel family's
        assert MODULE_OF[op.name].__name__.rsplit(".", 1)[1] == op.kernels, op.name
