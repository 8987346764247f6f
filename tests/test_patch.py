"""lycoris_ops.patch.patch_peft: PEFT layers on our ops give PEFT's outputs and
gradients (fp32 CPU), keep state dicts, and fall back where unsupported."""
import copy
import importlib

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


def _assert_fast_path_matches(m, x, ref, monkeypatch):
    """The patched model's output, input gradient and parameter gradients equal ``ref``
    (``_run`` before patching), with PEFT's own forward made to raise (no fallback)."""
    layer_types = {type(mod) for mod in m.modules() if getattr(mod, "_lycoris_ops_patched", False)}
    with monkeypatch.context() as mp:
        for t in layer_types:
            mp.setattr(t, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("fallback")))
        got = _run(m, x)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-5)
    assert got[2].keys() == ref[2].keys()
    for k in ref[2]:
        torch.testing.assert_close(got[2][k], ref[2][k], rtol=1e-4, atol=1e-5, msg=k)


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
    _assert_fast_path_matches(m, x, ref, monkeypatch)
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


# ------------------------------------------------------------------ OFT / BOFT

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from lycoris_ops.testing import REL_TOL, rel_err  # noqa: E402


class _FakeFbd:
    """Stand-in for PEFT's CUDA block-diagonal extension (``fbd_cuda``), so that
    PEFT builds BOFT layers with several butterfly stages on CPU."""

    @staticmethod
    def forward(inp):  # (N, D, H, H) -> [(N, D·H, D·H)]
        return [torch.stack([torch.block_diag(*inp[n]) for n in range(inp.shape[0])])]

    @staticmethod
    def backward(grad, inp):
        N, D, H, _ = inp.shape
        g = grad.reshape(N, D, H, D, H).diagonal(dim1=1, dim2=3)  # (N, H, H, D)
        return [g.permute(0, 3, 1, 2).contiguous()]


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "lycoris" in str(func):
            self.ops.add(str(func).split(".")[1])
        return func(*args, **(kwargs or {}))


def _lin(*dims, bias=True):
    torch.manual_seed(0)
    layers = []
    for i in range(len(dims) - 1):
        layers += [nn.Linear(dims[i], dims[i + 1], bias=bias), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def _oft_boft_cases():
    from peft import BOFTConfig, OFTConfig

    def oft(**kw):
        kw.setdefault("r", 0)
        kw.setdefault("oft_block_size", 0)
        return OFTConfig(use_cayley_neumann=False, init_weights=False, **kw)

    def boft(**kw):
        return BOFTConfig(init_weights=False, **kw)

    t2, t3 = ["0", "2"], ["0", "2", "4"]
    tok = lambda c: (lambda big: torch.randn((4, 12, c) if big else (1, 3, c)))  # noqa: E731
    img = lambda c, hw: (lambda big: torch.randn(3 if big else 1, c, hw, hw))  # noqa: E731
    ids = lambda big: torch.randint(0, 11, (4, 12) if big else (1, 3))  # noqa: E731
    lin_oft = lambda bias=True: _lin(15, 21, 9, bias=bias)  # noqa: E731
    lin_boft = lambda bias=True: _lin(24, 16, 40, 8, bias=bias)  # noqa: E731

    def conv_oft():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 6, 3), nn.GELU(), nn.Conv2d(6, 4, 1))

    def conv_boft():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(4, 6, 3, padding=1, stride=2), nn.GELU(), nn.Conv2d(6, 4, 1))

    def emb():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(11, 12), nn.Linear(12, 5))

    # name: (model, config, x maker, patched layer count, fbd extension, lycoris op expected)
    return {
        "oft-r3": (lin_oft, oft(r=3, target_modules=t2), tok(15), 2, None, "oft_fwd"),  # S = 5, 7
        "oft-bs3-nobias": (lambda: lin_oft(False), oft(oft_block_size=3, target_modules=t2), tok(15), 2, None,
                           "oft_fwd"),
        "oft-coft": (lin_oft, oft(r=3, coft=True, eps=0.5, target_modules=t2), tok(15), 2, None, "oft_fwd"),
        "oft-share": (lin_oft, oft(oft_block_size=3, block_share=True, target_modules=t2), tok(15), 2, None,
                      "oft_fwd"),
        "oft-conv": (conv_oft, oft(r=3, target_modules=t2), img(3, 7), 2, None, "oft_fwd"),  # S = 9, 2
        "oft-emb": (emb, oft(r=3, target_modules=["0", "1"]), ids, 2, None, "oft_fwd"),
        "boft-1": (lin_boft, boft(boft_block_size=0, boft_block_num=8, target_modules=t3), tok(24), 3, None,
                   "oft_fwd"),  # one stage, s = 3, 2, 5
        "boft-1-nobias": (lambda: lin_boft(False), boft(boft_block_size=4, target_modules=t3), tok(24), 3, None,
                          "oft_fwd"),
        "boft-2": (lin_boft, boft(boft_block_size=0, boft_block_num=4, boft_n_butterfly_factor=2,
                                  target_modules=t3), tok(24), 3, _FakeFbd, "boft_fwd"),  # s = 6, 4, 10
        "boft-3-nobias": (lambda: lin_boft(False), boft(boft_block_size=2, boft_n_butterfly_factor=3,
                                                        target_modules=t3), tok(24), 3, _FakeFbd, "boft_fwd"),
        "boft-conv-2": (conv_boft, boft(boft_block_size=6, boft_n_butterfly_factor=2, target_modules=["0"]),
                        img(4, 6), 1, _FakeFbd, "boft_fwd"),
        "boft-conv-1": (conv_boft, boft(boft_block_size=0, boft_block_num=4, target_modules=["0"]),
                        img(4, 6), 1, None, "oft_fwd"),  # s = 9
    }


@pytest.fixture
def fbd(monkeypatch):
    """``fbd(ext)``: what PEFT's BOFT sees as its CUDA extension (None: not built)."""
    import peft.tuners.boft.layer as boft_layer

    def set_ext(ext):
        monkeypatch.setattr(boft_layer, "get_fbd_cuda", lambda: ext)
    set_ext(None)
    return set_ext


def _run2(m, x):
    """Output, grad of x (None for ids) and grads of every trainable parameter."""
    if x.is_floating_point():
        x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(123)
    y = m(x)
    y.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return y.detach(), (x.grad if x.requires_grad else None), grads


def _build(name, fbd, dtype=torch.float32):
    from peft import get_peft_model
    model, cfg, mk, n, ext, op = _oft_boft_cases()[name]
    fbd(ext)
    m = get_peft_model(model().to(dtype), copy.deepcopy(cfg))
    _perturb(m)
    return m, mk, n, op


def _compare(got, ref, tol, what=""):
    errs = {"y": rel_err(got[0], ref[0])}
    if ref[1] is not None:
        errs["x.grad"] = rel_err(got[1], ref[1])
    assert got[2].keys() == ref[2].keys()
    for k in ref[2]:
        errs[k] = rel_err(got[2][k], ref[2][k])
    bad = {k: e for k, e in errs.items() if not e <= tol}
    assert not bad, (what, bad)
    return max(errs.values())


def _no_fallback(mp, m):
    for t in {type(mod) for mod in m.modules() if getattr(mod, "_lycoris_ops_patched", False)}:
        mp.setattr(t, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("fallback")))


@pytest.mark.parametrize("big", [False, True], ids=["few-tokens", "many-tokens"])
@pytest.mark.parametrize("name", list(_oft_boft_cases()))
def test_oft_boft_patched_matches_peft(name, big, fbd, monkeypatch):
    """fp32: same outputs and gradients (x and every trainable parameter) as PEFT,
    through the lycoris op (few tokens: activations rotated; many: the weight),
    same state-dict keys; merge / disable still work."""
    m, mk, n, op = _build(name, fbd)
    x = mk(big)
    ref = _run2(m, x)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    assert patch_peft(m) == n
    assert patch_peft(m) == 0
    with monkeypatch.context() as mp:
        _no_fallback(mp, m)
        with _OpRecorder() as rec:
            got = _run2(m, x)
    assert op in rec.ops and op.replace("fwd", "bwd") in rec.ops, rec.ops
    _compare(got, ref, REL_TOL[torch.float32], name)
    assert m.state_dict().keys() == sd.keys()
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, sd[k], rtol=1e-5, atol=1e-6, msg=k)
    m.eval()
    with torch.no_grad():
        y_eval = m(x)
        m.merge_adapter()
        if name != "oft-conv":  # PEFT's OFT conv forward (unfold/rotate/fold) is not its merged weight
            assert rel_err(m(x), y_eval) < 1e-4
        m.unmerge_adapter()
        with m.disable_adapter():
            assert rel_err(m(x), _oft_boft_cases()[name][0]()(x)) < 1e-5
    assert unpatch_peft(m) == n


@pytest.mark.parametrize("name", ["oft-r3", "boft-1", "boft-2"])
def test_oft_boft_patched_bf16(name, fbd, monkeypatch):
    """bf16 base layers (PEFT keeps the adapter in fp32): within bf16 tolerance of PEFT."""
    m, mk, n, op = _build(name, fbd, torch.bfloat16)
    x = mk(False).to(torch.bfloat16)  # (1, 3, C): few tokens
    xb = mk(True).to(torch.bfloat16)  # many tokens
    refs = [_run2(m, x), _run2(m, xb)]
    patch_peft(m)
    with monkeypatch.context() as mp:
        _no_fallback(mp, m)
        gots = [_run2(m, x), _run2(m, xb)]
    assert gots[0][0].dtype == torch.bfloat16
    for got, ref in zip(gots, refs):
        _compare(got, ref, REL_TOL[torch.bfloat16], name)


@pytest.mark.parametrize("name", ["oft-r3", "boft-2"])
def test_oft_boft_two_adapters(name, fbd, monkeypatch):
    """Two active adapters compose in PEFT's order."""
    m, mk, n, op = _build(name, fbd)
    m.add_adapter("second", copy.deepcopy(_oft_boft_cases()[name][1]))
    m.base_model.set_adapter(["default", "second"])
    _perturb(m, seed=2)
    for big in (False, True):
        x = mk(big)
        ref = _run2(m, x)
        patch_peft(m)
        with monkeypatch.context() as mp:
            _no_fallback(mp, m)
            got = _run2(m, x)
        unpatch_peft(m)
        assert any("second" in k for k in got[2])
        _compare(got, ref, REL_TOL[torch.float32], name)


def _fallback_case(name, fbd, mutate, train=True):
    m, mk, n, op = _build(name, fbd)
    mutate(m)
    m.train(train)
    x = mk(True)
    ref = _run2(m, x)
    assert patch_peft(m) == n
    with _OpRecorder() as rec:
        got = _run2(m, x)
    assert not rec.ops, rec.ops  # PEFT's own forward ran
    _compare(got, ref, 0.0, name)


def test_oft_cayley_neumann_falls_back(fbd):
    """PEFT's default OFT (Cayley–Neumann series) is not our exact Cayley: falls back."""
    def neumann(m):
        for mod in m.modules():
            if type(mod).__name__ == "OFTRotationModule":
                mod.use_cayley_neumann = True
    _fallback_case("oft-r3", fbd, neumann)


@pytest.mark.parametrize("family,case", [("oft", "oft-r3"), ("boft", "boft-2")])
def test_dropout_in_training_falls_back(family, case, fbd):
    """OFT's module dropout / BOFT's dropout (random block masks) in training: PEFT's forward."""
    layer = importlib.import_module(f"peft.tuners.{family}.layer")

    def drop(m):
        for mod in m.modules():
            if hasattr(mod, f"{family}_dropout"):
                getattr(mod, f"{family}_dropout")["default"] = layer.MultiplicativeDropoutLayer(p=0.5)
    _fallback_case(case, fbd, drop)


def test_boft_stage_partition_mismatch_falls_back(fbd):
    """A stage permutation that ``boft_fwd``'s butterfly cannot express: falls back."""
    def scramble(m):
        g = torch.Generator().manual_seed(5)
        for mod in m.modules():
            if hasattr(mod, "boft_P"):
                C = mod.boft_P.shape[-1]
                mod.boft_P[1] = torch.eye(C)[torch.randperm(C, generator=g)]
    _fallback_case("boft-2", fbd, scramble)


@pytest.mark.skipif(torch.__version__ < "2.13", reason="torch 2.11's Dynamo raises Unsupported inside the patched "
                                                       "PEFT OFT/BOFT forward with fullgraph=True (H200 run, "
                                                       "2026-11-30 05:28); passes on torch 2.13")
def test_oft_boft_compile_fullgraph(fbd):
    from peft import get_peft_model
    from torch._dynamo.backends.debugging import aot_eager
    for name in ("oft-coft", "boft-2"):
        model, cfg, mk, n, ext, op = _oft_boft_cases()[name]
        fbd(ext)
        m = get_peft_model(model(), copy.deepcopy(cfg))
        _perturb(m)
        patch_peft(m)
        torch._dynamo.reset()
        compiled = torch.compile(m.base_model.model, fullgraph=True, backend=aot_eager)
        for big in (False, True):
            x = mk(big)
            ref = m(x)
            torch.testing.assert_close(compiled(x), ref, rtol=1e-5, atol=1e-6)


def _conv_configs():
    from peft import IA3Config, LoHaConfig, LoKrConfig, LoraConfig
    t = ["0", "2"]
    return {
        "ia3-conv": IA3Config(target_modules=t, feedforward_modules=["2"]),
        "lora-conv": LoraConfig(r=4, lora_alpha=8, target_modules=t),
        "lora-conv-dropout": LoraConfig(r=4, lora_alpha=8, target_modules=t, lora_dropout=0.25),
        "loha-conv": LoHaConfig(r=3, alpha=6, target_modules=t),
        "lokr-conv": LoKrConfig(r=2, alpha=4, target_modules=t),
        "lokr-conv-whole": LoKrConfig(r=8, alpha=4, target_modules=t),
        "lokr-conv-both": LoKrConfig(r=1, alpha=4, target_modules=t, decompose_both=True, decompose_factor=4),
        "lokr-conv-tucker": LoKrConfig(r=2, alpha=4, target_modules=t, use_effective_conv2d=True),
    }


@pytest.mark.parametrize("name", list(_conv_configs()))
def test_patched_conv_matches_peft(name, monkeypatch):
    """PEFT's LoRA / LoHa / LoKr / IA3 Conv2d layers on our ops: PEFT's outputs and gradients
    (strided and padded convs, dilated for LoHa/LoKr; LoKr whole, factored and tucker), no fallback."""
    from peft import get_peft_model
    torch.manual_seed(0)
    dil = 1 if name.startswith("lora") else 2  # PEFT's LoRA conv ignores the base's dilation (its own forward fails)
    base = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.GELU(),
                         nn.Conv2d(16, 16, 3, padding=dil, dilation=dil))
    m = get_peft_model(base, _conv_configs()[name])
    _perturb(m)
    m.train()
    x = torch.randn(2, 8, 9, 11)
    ref = _run(m, x)
    assert patch_peft(m) == 2
    _assert_fast_path_matches(m, x, ref, monkeypatch)
    assert unpatch_peft(m) == 2


def test_patched_conv_falls_back_where_unsupported():
    """Grouped convs and LoHa's tucker layout (use_effective_conv2d) keep PEFT's forward."""
    from peft import LoHaConfig, LoraConfig, get_peft_model
    for base, cfg in ((nn.Sequential(nn.Conv2d(8, 16, 3, groups=2)), LoraConfig(r=2, target_modules=["0"])),
                      (nn.Sequential(nn.Conv2d(8, 16, 3)),
                       LoHaConfig(r=2, alpha=4, target_modules=["0"], use_effective_conv2d=True))):
        torch.manual_seed(0)
        m = get_peft_model(base, cfg)
        _perturb(m)
        x = torch.randn(2, 8, 7, 7)
        with torch.no_grad():
            want = m(x)
            patch_peft(m)
            torch.testing.assert_close(m(x), want)


@pytest.mark.parametrize("name", ["lora-conv", "lokr-conv"])
def test_patched_conv_compile_fullgraph(name):
    from peft import get_peft_model
    from torch._dynamo.backends.debugging import aot_eager
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = get_peft_model(nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.GELU(), nn.Conv2d(16, 16, 3)),
                       _conv_configs()[name])
    _perturb(m)
    m.eval()
    patch_peft(m)
    x = torch.randn(2, 8, 7, 7)
    ref = m(x)
    compiled = torch.compile(m.base_model.model, fullgraph=True, backend=aot_eager)
    torch.testing.assert_close(compiled(x), ref)
