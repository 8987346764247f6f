"""The registered schemas are exactly the contract: the schema block of docs/ops.md §0."""
import pathlib

import torch

import lycoris_ops
from lycoris_ops import _C

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPS_DOC = ROOT / "docs" / "ops.md"


def _contract():
    """The lines of the first fenced block after the heading of §0."""
    text = OPS_DOC.read_text()
    section = text[text.index("\n## 0."):]
    block = section.split("```", 2)[1]
    return [line.strip() for line in block.splitlines() if "(" in line]


def test_schema_table_equals_contract():
    assert list(_C.schemas()) == _contract()


def test_registered_schemas_equal_contract():
    registered = []
    for name in lycoris_ops.OP_NAMES:
        schema = getattr(torch.ops.lycoris, name).default._schema
        registered.append(str(schema).removeprefix("lycoris::"))
    assert registered == _contract()
    assert len(registered) == 23


def test_ops_are_pt2_compliant():
    for name in lycoris_ops.OP_NAMES:
        assert torch.Tag.pt2_compliant_tag in getattr(torch.ops.lycoris, name).default.tags


def test_every_op_has_cpu_cuda_fake_and_autograd():
    for name in lycoris_ops.OP_NAMES:
        qual = f"lycoris::{name}"
        for key in ("CPU", "CUDA", "Meta", "Autograd"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, key), (name, key)
