"""lycoris_ops.patch.patch_peft: PEFT layers on our ops give PEFT's outputs and
gradients (fp32 CPU), keep state dicts, and fall back where unsupported."""
import copy

import pytest
import torch
import torch.nn as nn

import lycoris_ops  # noqa: F401
from lycoris_ops.patch import patch_peft, unpatch_peft

peft = pytest.importorskip("peft")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 12))


def _configs():
    from peft import IA3Config, LoHaConfig, LoKrConfig, LoraConfig
    t = ["0", "2", "4"]
    return {
        "lora": LoraConfig(r=4, lora_alpha=8, target_modules=t),
        "lora-dropout": LoraConfig(r=4, lora_alpha=8, target_modules=t, lora_dropout=0.25),
        "dora": LoraConfig(r=4, lora_alpha=8, target_modules=t, use_dora=True),
        "loha": LoHaConfig(r=4, alpha=8, target_modules=t),
        "lokr": LoKrConfig(r=2, alpha=4, target_modules=t),
        "lokr-both": LoKrConfig(r=1, alpha=4, target_modules=t, decompose_both=True, decompose_factor=4),
        "ia3": IA3Config(target_modules=t, feedforward_modules=["2"]),
    }


def _perturb(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _run(m, x):
    x = x.clone().requires_grad_(True)
    torch.manual_seed(123)  # same dropout masks for PEFT and the patched forward
    y = m(x)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("name", list(_configs()))
def test_patched_matches_peft(name, monkeypatch):
    from peft import get_peft_model
    m = get_peft_model(_model(), _configs()[name])
    _perturb(m)
    x = torch.randn(3, 5, 20)
    ref = _run(m, x)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    n = patch_peft(m)
    assert n == 3
    assert patch_peft(m) == 0  # idempotent
    layer_types = {type(mod) for mod in m.modules() if getattr(mod, "_lycoris_ops_patched", False)}
    with monkeypatch.context() as mp:  # the fast path must not fall back to PEFT's forward
        for t in layer_types:
            mp.setattr(t, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("fallback")))
        got = _run(m, x)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-5)
    assert got[2].keys() == ref[2].keys()
    for k in ref[2]:
        torch.testing.assert_close(got[2][k], ref[2][k], rtol=1e-4, atol=1e-5, msg=k)
    assert m.state_dict().keys() == sd.keys()
    # merged / disabled paths still work (PEFT's own forward)
    m.eval()
    with torch.no_grad():
        y_eval = m(x)
        m.merge_adapter()
        torch.testing.assert_close(m(x), y_eval, rtol=1e-4, atol=1e-5)
        m.unmerge_adapter()
        with m.disable_adapter():
            torch.testing.assert_close(m(x), _model()(x))
    assert unpatch_peft(m) == 3


def test_patched_uses_lycoris_ops():
    from peft import get_peft_model
    m = get_peft_model(_model(), _configs()["lora"])
    patch_peft(m)
    ep = torch.export.export(m.base_model.model, (torch.randn(2, 20),))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("lora_bypass_fwd" in t for t in targets), targets


def test_patched_compile_fullgraph():
    from peft import get_peft_model
    from torch._dynamo.backends.debugging import aot_eager
    torch._dynamo.reset()
    m = get_peft_model(_model(), _configs()["lora"])
    _perturb(m)
    patch_peft(m)
    x = torch.randn(2, 20)
    ref = m(x)
    inner = m.base_model.model
    compiled = torch.compile(inner, fullgraph=True, backend=aot_eager)
    torch.testing.assert_close(compiled(x), ref)
