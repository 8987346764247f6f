"""lycoris_ops.integrations.peft.patch_peft: PEFT layers on our ops give PEFT's outputs and
gradients (fp32 CPU), keep state dicts, and fall back where unsupported."""
import collections
import copy
import importlib

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import lycoris_ops  # noqa: F401
from lycoris_ops.integrations.peft import patch_peft, peft_available, unpatch_peft
from lycoris_ops.integrations.peft.oft import _peft_conv_weight_path
from lycoris_ops.testing import REL_TOL, rel_err

peft = pytest.importorskip("peft")


class _OpRecorder(TorchDispatchMode):
    """The lycoris ops (short names) called inside the context, forward and backward."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    @property
    def ops(self):
        return set(self.calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "lycoris" in str(func):
            self.calls[str(func).split(".")[1]] += 1
        return func(*args, **(kwargs or {}))


def test_peft_available():
    """PEFT imports here (the module is skipped without it), and peft_available says so."""
    assert peft_available() is True


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
        "lora-bias": LoraConfig(r=4, lora_alpha=8, target_modules=t, lora_bias=True),
        "loha-dropout": LoHaConfig(r=4, alpha=8, target_modules=t, rank_dropout=0.3, module_dropout=0.3),
        "lokr-dropout": LoKrConfig(r=2, alpha=4, target_modules=t, rank_dropout=0.3, module_dropout=0.3,
                                   rank_dropout_scale=True),
        "lokr-rank-dropout": LoKrConfig(r=2, alpha=4, target_modules=t, rank_dropout=0.5),
    }


#: adapter family (a config name's first part) -> the forward op its patched layers call
_OPS = {"lora": "lora_bypass_fwd", "dora": "lora_bypass_fwd", "loha": "loha_bypass_fwd",
        "lokr": "lokr_bypass_fwd", "ia3": "ia3_fwd"}


def _perturb(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


def _patch_fused(m, n):
    """patch_peft reports n PEFT layers, all on a lycoris op; a second call (idempotent)
    reports the same and leaves the patched forwards as they are."""
    report = patch_peft(m)
    assert len(report) == n and all(r.fused for r in report), report
    forwards = [mod.__dict__["forward"] for mod in m.modules() if "forward" in mod.__dict__]
    assert len(forwards) == n
    assert patch_peft(m) == report
    assert [mod.__dict__["forward"] for mod in m.modules() if "forward" in mod.__dict__] == forwards
    return report


def _run(m, x):
    x = x.clone().requires_grad_(True)
    torch.manual_seed(123)  # same dropout masks for PEFT and the patched forward
    y = m(x)
    y.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def _assert_fast_path_matches(m, x, ref, monkeypatch, dtype=torch.float32):
    """The patched model's output, input gradient and parameter gradients equal ``ref``
    (``_run`` before patching) within ``dtype``'s tolerance, with PEFT's own forward made
    to raise (no fallback). Returns the lycoris ops the step called."""
    with monkeypatch.context() as mp:
        _no_fallback(mp, m)
        with _OpRecorder() as rec:
            got = _run(m, x)
    assert got[0].dtype == ref[0].dtype
    _compare(got, ref, REL_TOL[dtype])
    return rec.ops


@pytest.mark.parametrize("name", list(_configs()))
def test_patched_matches_peft(name, monkeypatch):
    from peft import get_peft_model
    m = get_peft_model(_model(), _configs()[name])
    _perturb(m)
    x = torch.randn(3, 5, 20)
    ref = _run(m, x)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    _patch_fused(m, 3)
    ops = _assert_fast_path_matches(m, x, ref, monkeypatch)
    assert _OPS[name.split("-")[0]] in ops, ops
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


@pytest.mark.parametrize("name,adapter_dtype", [
    ("lora", torch.float32), ("lora-bias", torch.float32), ("dora", torch.float32), ("loha", torch.float32),
    ("lokr", torch.float32), ("lora-dropout", torch.bfloat16), ("loha-dropout", torch.bfloat16),
    ("lokr-dropout", torch.bfloat16)])
def test_patched_bf16(name, adapter_dtype, monkeypatch):
    """A bf16 base (PEFT keeps the adapter in fp32 by default; the dropout cases keep it in
    bf16, so that PEFT's dropout masks, drawn on its adapter-dtype input, are ours)."""
    from peft import get_peft_model
    m = get_peft_model(_model().to(torch.bfloat16), _configs()[name],
                       autocast_adapter_dtype=adapter_dtype == torch.float32)
    assert m.base_model.model[0].lora_A["default"].weight.dtype == adapter_dtype if "lora" in name else True
    _perturb(m)
    x = torch.randn(3, 5, 20, dtype=torch.bfloat16)
    ref = _run(m, x)
    _patch_fused(m, 3)
    ops = _assert_fast_path_matches(m, x, ref, monkeypatch, torch.bfloat16)
    assert _OPS[name.split("-")[0]] in ops, ops


def test_lyco_dropouts_drop_and_keep(monkeypatch):
    """LoHa/LoKr module dropout in training: over a few steps, adapters are both dropped and
    kept (PEFT's draws), and each step equals PEFT's."""
    from peft import get_peft_model
    m = get_peft_model(_model(), _configs()["lokr-dropout"])
    _perturb(m)
    x = torch.randn(3, 5, 20)
    refs = []
    for seed in range(4):
        torch.manual_seed(seed)
        refs.append(m(x).detach())
    patch_peft(m)
    with monkeypatch.context() as mp:
        _no_fallback(mp, m)
        with _OpRecorder() as rec:
            for seed, ref in enumerate(refs):
                torch.manual_seed(seed)
                assert rel_err(m(x), ref) < REL_TOL[torch.float32]
    assert 0 < rec.calls["lokr_bypass_fwd"] < 12, rec.calls  # 4 steps × 3 layers: some dropped, some run


class _GPT2Block(nn.Module):
    """GPT-2's layout: transformers' ``Conv1D`` (weight (in, out)), which PEFT adapts with
    ``fan_in_fan_out=True``."""

    def __init__(self):
        from transformers.pytorch_utils import Conv1D
        super().__init__()
        torch.manual_seed(0)
        self.c_attn = Conv1D(36, 20)  # nf (out), nx (in)
        self.c_proj = Conv1D(12, 36)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.3)

    def forward(self, x):
        return self.c_proj(nn.functional.gelu(self.c_attn(x)))


def _gpt2_configs():
    from peft import IA3Config, LoraConfig
    t = ["c_attn", "c_proj"]
    return {
        "lora": LoraConfig(r=4, lora_alpha=8, target_modules=t, fan_in_fan_out=True),
        "lora-dropout": LoraConfig(r=4, lora_alpha=8, target_modules=t, fan_in_fan_out=True, lora_dropout=0.25),
        "lora-bias": LoraConfig(r=4, lora_alpha=8, target_modules=t, fan_in_fan_out=True, lora_bias=True),
        "ia3": IA3Config(target_modules=t, feedforward_modules=["c_proj"], fan_in_fan_out=True),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(_gpt2_configs()))
def test_patched_gpt2_conv1d(name, dtype, monkeypatch):
    """PEFT adapters on GPT-2 ``Conv1D`` bases: the base runs its own forward, the adapter our
    op (bf16: base and adapters bf16, so that dropout masks match PEFT's)."""
    from peft import get_peft_model
    m = get_peft_model(_GPT2Block().to(dtype), _gpt2_configs()[name], autocast_adapter_dtype=False)
    assert type(m.base_model.model.c_attn.get_base_layer()).__name__ == "Conv1D"
    _perturb(m)
    x = torch.randn(3, 5, 20, dtype=dtype)
    ref = _run(m, x)
    _patch_fused(m, 2)
    ops = _assert_fast_path_matches(m, x, ref, monkeypatch, dtype)
    assert _OPS[name.split("-")[0]] in ops, ops
    m.eval()
    with torch.no_grad():
        y = m(x)
        m.merge_adapter()  # PEFT's merge transposes for fan_in_fan_out; our forward agrees with it
        assert rel_err(m(x), y) < REL_TOL[dtype]


def _bnb_linear(lin, kind, dtype):
    """``lin`` quantized by bitsandbytes (on this CPU): nf4 ``Linear4bit`` or int8 ``Linear8bitLt``."""
    import bitsandbytes as bnb
    if kind == "4bit":
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, compute_dtype=dtype, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4")
        q.bias = nn.Parameter(lin.bias.data.to(dtype), requires_grad=False)
    else:
        q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, has_fp16_weights=False)
        q.load_state_dict(lin.state_dict())
    return q.to("cpu")  # quantizes the weight


@pytest.mark.parametrize("dtype,dropout", [(torch.float32, 0.25), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("kind", ["4bit", "8bit"])
def test_patched_bitsandbytes(kind, dtype, dropout, monkeypatch):
    """QLoRA: PEFT's LoRA on bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` bases (its CPU
    backend): the quantized base runs its own forward, the adapter ``lora_bypass_fwd`` with
    that output as ``base``; PEFT's outputs and gradients (bf16: fp32 adapters)."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    m = nn.Sequential(_bnb_linear(nn.Linear(20, 32), kind, dtype), nn.GELU(),
                      _bnb_linear(nn.Linear(32, 12), kind, dtype))
    setattr(m, f"is_loaded_in_{kind}", True)
    m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], lora_dropout=dropout))
    assert type(m.base_model.model[0]).__module__ == "peft.tuners.lora.bnb"
    _perturb(m)
    x = torch.randn(3, 5, 20, dtype=dtype)
    ref = _run(m, x)
    _patch_fused(m, 2)
    ops = _assert_fast_path_matches(m, x, ref, monkeypatch, dtype)
    assert {"lora_bypass_fwd", "lora_bypass_bwd"} <= ops, ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_torchao(dtype, monkeypatch):
    """PEFT's LoRA on torchao int8-weight bases (``TorchaoLoraLinear``), dropout in training:
    the quantized base runs its own forward, the adapter ``lora_bypass_fwd``."""
    pytest.importorskip("torchao")
    from peft import LoraConfig, get_peft_model
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    base = _model().to(dtype)
    quantize_(base, Int8WeightOnlyConfig())
    m = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2", "4"], lora_dropout=0.25))
    assert type(m.base_model.model[0]).__name__ == "TorchaoLoraLinear"
    _perturb(m)
    x = torch.randn(3, 5, 20, dtype=dtype)
    ref = _run(m, x)
    _patch_fused(m, 3)
    ops = _assert_fast_path_matches(m, x, ref, monkeypatch, dtype)
    assert {"lora_bypass_fwd", "lora_bypass_bwd"} <= ops, ops


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

    def conv_geom():  # non-square kernels, dilation, string and asymmetric padding, stride
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(4, 6, (3, 2), padding="same", dilation=(2, 1)), nn.GELU(),
                             nn.Conv2d(6, 4, (2, 3), padding=(1, 0), stride=(2, 1)))

    # name: (model, config, x maker, patched layer count, fbd extension, lycoris op expected)
    cases = {
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
    if _peft_conv_weight_path():  # PEFT before 0.22 builds these layers for square kernels only
        cases.update({
            "oft-conv-geom": (conv_geom, oft(r=4, target_modules=t2), img(4, 7), 2, None, "oft_fwd"),  # S = 6, 9
            "boft-conv-geom": (conv_geom, boft(boft_block_size=6, boft_n_butterfly_factor=2, target_modules=["0"]),
                               img(4, 7), 1, _FakeFbd, "boft_fwd"),
        })
    return cases


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
    _patch_fused(m, n)
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
        if _peft_conv_weight_path() or name != "oft-conv":  # PEFT < 0.22: OFT conv unfold/rotate/fold
            assert rel_err(m(x), y_eval) < 1e-4
        m.unmerge_adapter()
        with m.disable_adapter():
            assert rel_err(m(x), _oft_boft_cases()[name][0]()(x)) < 1e-5
    assert unpatch_peft(m) == n


@pytest.mark.parametrize("name", ["oft-r3", "boft-1", "boft-2", "oft-conv", "boft-conv-2"])
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


@pytest.mark.parametrize("name", ["oft-r3", "boft-2", "oft-conv"])
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
    assert len(patch_peft(m)) == n
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


@pytest.mark.slow
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


def _conv_base(dil=1):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.GELU(),
                         nn.Conv2d(16, 16, 3, padding=dil, dilation=dil))


def _conv_base_1x1():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 1, stride=2), nn.GELU(), nn.Conv2d(16, 12, 1))


def _conv_base_odd():  # LoKr factors 20 = 4·5, 6 = 2·3: side 2 is (5, 3, kh, kw), not square
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 6, 3, padding=1, stride=2), nn.GELU(), nn.Conv2d(6, 20, (3, 2), padding=(1, 0)))


def _conv_configs():
    """name: (base maker, config). PEFT's LoRA conv ignores the base's dilation (its own forward
    fails there): LoRA cases have none, LoHa/LoKr ones are dilated."""
    from peft import IA3Config, LoHaConfig, LoKrConfig, LoraConfig
    t = ["0", "2"]
    dilated = lambda: _conv_base(2)  # noqa: E731
    return {
        "ia3-conv": (dilated, IA3Config(target_modules=t, feedforward_modules=["2"])),
        "lora-conv": (_conv_base, LoraConfig(r=4, lora_alpha=8, target_modules=t)),
        "lora-conv-dropout": (_conv_base, LoraConfig(r=4, lora_alpha=8, target_modules=t, lora_dropout=0.25)),
        "lora-conv-bias": (_conv_base, LoraConfig(r=4, lora_alpha=8, target_modules=t, lora_bias=True)),
        "lora-conv-1x1": (_conv_base_1x1, LoraConfig(r=4, lora_alpha=8, target_modules=t, lora_dropout=0.25)),
        "lora-conv-odd": (_conv_base_odd, LoraConfig(r=3, lora_alpha=8, target_modules=t)),
        "loha-conv": (dilated, LoHaConfig(r=3, alpha=6, target_modules=t)),
        "loha-conv-dropout": (dilated, LoHaConfig(r=3, alpha=6, target_modules=t, rank_dropout=0.4,
                                                  module_dropout=0.2)),
        "lokr-conv": (dilated, LoKrConfig(r=2, alpha=4, target_modules=t)),
        "lokr-conv-whole": (dilated, LoKrConfig(r=8, alpha=4, target_modules=t)),
        "lokr-conv-both": (dilated, LoKrConfig(r=1, alpha=4, target_modules=t, decompose_both=True,
                                               decompose_factor=4)),
        "lokr-conv-tucker": (dilated, LoKrConfig(r=2, alpha=4, target_modules=t, use_effective_conv2d=True)),
        "lokr-conv-odd-tucker": (_conv_base_odd, LoKrConfig(r=2, alpha=4, target_modules=t,
                                                            use_effective_conv2d=True)),
        "lokr-conv-odd": (_conv_base_odd, LoKrConfig(r=2, alpha=4, target_modules=t)),
        "lokr-conv-1x1-dropout": (_conv_base_1x1, LoKrConfig(r=2, alpha=4, target_modules=t, rank_dropout=0.4,
                                                             module_dropout=0.2, rank_dropout_scale=True)),
    }


#: conv adapter family -> the op its patched Conv2d calls forward (and, but for IA3's, backward)
_CONV_OPS = {"lora": ("lora_bypass_fwd", "lora_bypass_bwd"), "lokr": ("lokr_bypass_fwd", "lokr_bypass_bwd"),
             "loha": ("lora_merge_fwd", "loha_merge_bwd"), "ia3": ("ia3_fwd", "ia3_bwd")}


def _conv_case(name, dtype=torch.float32, adapter_fp32=True):
    from peft import get_peft_model
    make, cfg = _conv_configs()[name]
    m = get_peft_model(make().to(dtype), copy.deepcopy(cfg), autocast_adapter_dtype=adapter_fp32)
    _perturb(m)
    m.train()
    x = torch.randn(2, m.base_model.model[0].get_base_layer().in_channels, 9, 11, dtype=dtype)
    return m, x


@pytest.mark.parametrize("name", list(_conv_configs()))
def test_patched_conv_matches_peft(name, monkeypatch):
    """PEFT's LoRA / LoHa / LoKr / IA3 Conv2d layers on our ops (a lycoris op is called, forward
    and backward): PEFT's outputs and gradients (strided, padded, 1×1 and non-square kernels,
    dilated for LoHa/LoKr; LoKr whole, factored and tucker; dropouts in training), no fallback."""
    m, x = _conv_case(name)
    ref = _run(m, x)
    _patch_fused(m, 2)
    ops = _assert_fast_path_matches(m, x, ref, monkeypatch)
    assert set(_CONV_OPS[name.split("-")[0]]) <= ops, ops
    assert unpatch_peft(m) == 2


@pytest.mark.parametrize("name", ["lora-conv", "lora-conv-1x1", "lokr-conv", "lokr-conv-tucker", "loha-conv"])
def test_patched_conv_bf16(name, monkeypatch):
    """bf16 base convs, fp32 adapters (PEFT's default): within bf16 tolerance of PEFT."""
    m, x = _conv_case(name, torch.bfloat16)
    ref = _run(m, x)
    _patch_fused(m, 2)
    ops = _assert_fast_path_matches(m, x, ref, monkeypatch, torch.bfloat16)
    assert _CONV_OPS[name.split("-")[0]][0] in ops, ops


@pytest.mark.parametrize("name", ["lora-conv-dropout", "lokr-conv-1x1-dropout"])
def test_patched_conv_dropout_bf16(name, monkeypatch):
    """bf16 base and adapters (the same dropout masks as PEFT's), dropout in training."""
    m, x = _conv_case(name, torch.bfloat16, adapter_fp32=False)
    ref = _run(m, x)
    _patch_fused(m, 2)
    _assert_fast_path_matches(m, x, ref, monkeypatch, torch.bfloat16)


@pytest.mark.parametrize("name", ["lora-conv", "lokr-conv", "loha-conv", "ia3-conv"])
def test_patched_conv_unbatched(name, monkeypatch):
    """An unbatched (C, H, W) input gives PEFT's (O, H', W')."""
    m, x = _conv_case(name)
    ref = _run(m, x[0])
    patch_peft(m)
    _assert_fast_path_matches(m, x[0], ref, monkeypatch)


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
                       _conv_configs()[name][1])
    _perturb(m)
    m.eval()
    patch_peft(m)
    x = torch.randn(2, 8, 7, 7)
    ref = m(x)
    compiled = torch.compile(m.base_model.model, fullgraph=True, backend=aot_eager)
    torch.testing.assert_close(compiled(x), ref)
