"""The main demonstration: a small model whose adapters run on torch.ops.lycoris.*,
checked against plain eager formulas, then compiled (fullgraph) and exported."""
import pathlib
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import lycoris_ops  # noqa: E402
from tiny_model import TinyAdapted  # noqa: E402


def eager_formula(m, x):
    """The same model written with plain torch (no lycoris ops)."""
    xf = x.reshape(-1, x.shape[-1])
    h = F.linear(xf, m.w1) + 0.5 * F.linear(F.linear(xf, m.lora_down), m.lora_up)
    a1, b1, a2, b2 = m.hada_a1, m.hada_b1, m.hada_a2, m.hada_b2
    h = F.linear(torch.tanh(h), m.w2 + 0.3 * (a1 @ b1) * (a2 @ b2))
    h = h + 0.7 * F.linear(h, torch.kron(m.kron_w1, m.kron_w2))
    n = m.w3.norm(dim=1, keepdim=True) + torch.finfo(m.dora_scale.dtype).eps
    h = F.linear(h, m.w3 * (m.dora_scale[:, None] / n))
    q = m.oft_blocks - m.oft_blocks.transpose(1, 2)
    eye = torch.eye(q.shape[-1])
    r = torch.linalg.solve((eye - q).transpose(1, 2), (eye + q).transpose(1, 2)).transpose(1, 2)  # (I+Q)(I-Q)^-1
    hb = h.reshape(h.shape[0], q.shape[0], q.shape[1])
    h = h + torch.einsum("tkj,kji->tki", hb, r - eye).reshape(h.shape)  # y_k·(R_k − I)
    return h.reshape(x.shape)


def main():
    torch.manual_seed(0)
    print(f"lycoris_ops {lycoris_ops.__version__}, torch {torch.__version__}, {len(lycoris_ops.OP_NAMES)} ops")
    model = TinyAdapted()
    x = torch.randn(4, 7, 24, requires_grad=True)

    y = model(x)
    y.square().sum().backward()
    ref = eager_formula(model, x)
    print(f"eager ops vs plain torch formula: max |diff| = {(y - ref).abs().max().item():.2e}")
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-5)

    t0 = time.perf_counter()
    compiled = torch.compile(model, fullgraph=True)
    yc = compiled(x)
    print(f"torch.compile(fullgraph=True): max |diff| = {(yc - y).abs().max().item():.2e} "
          f"(first call {time.perf_counter() - t0:.1f} s)")
    assert torch.allclose(yc, y, rtol=1e-4, atol=1e-5)

    batch = torch.export.Dim("batch")
    ep = torch.export.export(model, (x.detach(),), dynamic_shapes={"x": {0: batch}})
    ops = sorted({str(n.target) for n in ep.graph.nodes if "lycoris" in str(n.target)})
    print("torch.export graph holds:", ", ".join(ops))
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/tiny.pt2"
        torch.export.save(ep, path)
        x2 = torch.randn(9, 7, 24)
        assert torch.allclose(torch.export.load(path).module()(x2), model(x2), rtol=1e-4, atol=1e-5)
    print("export -> save -> load -> run with another batch size: ok")


if __name__ == "__main__":
    main()
