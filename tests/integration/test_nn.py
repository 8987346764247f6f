"""lycoris_ops.nn: adapter modules vs their plain-torch formulas (outputs and
gradients, fp32 CPU), merge/unmerge, state dicts, LyCORIS state-dict import,
torch.compile(fullgraph) and torch.export of adapted models."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lycoris_ops  # noqa: F401
from lycoris_ops import nn as lnn
from lycoris_ops.nn.dora import _Rescale


def _perturb(model, seed=0, std=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".base." not in f".{n}" and not n.startswith("base."):
                p.add_(torch.randn(p.shape, generator=g) * std)


def _cayley(b):
    q = b - b.transpose(-1, -2)
    eye = torch.eye(b.shape[-1], dtype=b.dtype)
    return (eye + q) @ torch.linalg.inv(eye - q)


def _boft_matrix(blocks):
    """Dense C×C butterfly matrix: u_{i+1}[π(βs+p)] = Σ_q R_{i,β}[p,q]·u_i[π(βs+q)]."""
    m, nb, s, _ = blocks.shape
    C = nb * s
    M = torch.eye(C, dtype=blocks.dtype)
    for i in range(m):
        k = (s // 2) * 2 ** i
        perm = [(p // (2 * k)) * 2 * k + (p % 2) * k + (p % (2 * k)) // 2 for p in range(C)]
        P = torch.zeros(C, C, dtype=blocks.dtype)
        P[torch.arange(C), torch.tensor(perm)] = 1.0  # (P u)[p] = u[perm[p]]
        D = torch.block_diag(*_cayley(blocks[i]))
        M = P.T @ D @ P @ M
    return M


def _oracle(ad, x):
    """The adapter's output from its parameters, in plain torch (different formulation)."""
    b = ad.base
    W, bias = b.weight, b.bias
    if isinstance(ad, lnn.LoRAConv2d):
        h = F.conv2d(x, ad.lora_down, stride=b.stride, padding=b.padding, dilation=b.dilation)
        return b(x) + ad.gamma * F.conv2d(h, ad.lora_up)
    if isinstance(ad, lnn.LoHaConv2d):
        dw = ((ad.hada_w1_a @ ad.hada_w1_b) * (ad.hada_w2_a @ ad.hada_w2_b)).reshape(W.shape)
        return F.conv2d(x, W + ad.gamma * dw, bias, b.stride, b.padding, b.dilation)
    if isinstance(ad, lnn.DoRALinear):
        M = W + ad.scale * torch.einsum("or,ri->oi", ad.lora_up, ad.lora_down)  # the multiplier only blends
        n = M.norm(dim=1 if ad.wd_on_out else 0, keepdim=True) + torch.finfo(torch.float32).eps
        return F.linear(x, M * (ad.multiplier * (ad.dora_scale / n - 1) + 1), bias)
    if isinstance(ad, lnn.LoRALinear):
        return F.linear(x, W, bias) + ad.gamma * torch.einsum("...i,ri,or->...o", x, ad.lora_down, ad.lora_up)
    if isinstance(ad, lnn.LoHaLinear):
        dw = torch.einsum("or,ri->oi", ad.hada_w1_a, ad.hada_w1_b) * torch.einsum("or,ri->oi", ad.hada_w2_a,
                                                                                    ad.hada_w2_b)
        return F.linear(x, W + ad.gamma * dw, bias)
    if isinstance(ad, lnn.LoKrLinear):
        f = ad.factors()
        w1 = f["w1"] if "w1" in f else f["w1a"] @ f["w1b"]
        w2 = f["w2"] if "w2" in f else f["w2a"] @ f["w2b"]
        return F.linear(x, W + ad.gamma * torch.kron(w1, w2), bias)
    if isinstance(ad, lnn.BOFTLinear):
        y = x @ W.T @ _boft_matrix(ad.oft_blocks).T
        if ad.rescale is not None:
            y = y * ad.rescale.reshape(-1)
        return y + bias
    if isinstance(ad, lnn.OFTLinear):
        R = torch.block_diag(*_cayley(ad.oft_blocks))  # row-vector form: y_k·R_k
        y = (x @ W.T) @ R
        if ad.rescale is not None:
            y = y * ad.rescale.reshape(-1)
        return y + bias
    if isinstance(ad, lnn.IA3Linear):
        s = 1 + ad.multiplier * ad.ia3_weight
        return F.linear(x * s, W, bias) if ad.train_on_input else F.linear(x, W, bias) * s
    if isinstance(ad, lnn.FullLinear):
        return F.linear(x, W + ad.multiplier * ad.diff, bias + ad.multiplier * ad.diff_b)
    raise AssertionError(type(ad))


LINEAR_CASES = [
    ("lora", dict(rank=3, alpha=2.0, multiplier=0.5)),
    ("loha", dict(rank=3, alpha=5.0)),
    ("lokr", dict(rank=2, alpha=3.0)),
    ("lokr", dict(rank=1, decompose_both=True, factor=4)),
    ("lokr", dict(rank=8, full_matrix=True)),
    ("dora", dict(rank=3, alpha=2.0)),
    ("dora", dict(rank=2, wd_on_out=False, multiplier=0.7)),
    ("oft", dict(block_size=4, rescaled=True)),
    ("oft", dict(block_size=8)),
    ("boft", dict(block_size=4, n_butterfly=3, rescaled=True)),
    ("ia3", dict()),
    ("ia3", dict(train_on_input=True, multiplier=0.6)),
    ("full", dict(multiplier=0.8)),
]
_IDS = [f"{k}-{i}" for i, (k, _) in enumerate(LINEAR_CASES)]


def _make(kind, kw, I=20, O=32, seed=0):
    torch.manual_seed(seed)
    kw = dict(kw)
    rank = kw.pop("rank", 4)
    ad = lnn.ADAPTERS[kind][nn.Linear](nn.Linear(I, O), **({"rank": rank} if lnn.ADAPTERS[kind][nn.Linear].uses_rank
                                                            else {}), **kw)
    _perturb(ad, seed)
    return ad


def _check_vs_oracle(ad, x, rtol=1e-4, atol=1e-5):
    params = [p for p in ad.parameters() if p.requires_grad]
    x1 = x.clone().requires_grad_(True)
    y = ad(x1)
    gy = torch.randn_like(y)
    g = torch.autograd.grad(y, [x1] + params, gy)
    x2 = x.clone().requires_grad_(True)
    y2 = _oracle(ad, x2)
    g2 = torch.autograd.grad(y2, [x2] + params, gy)
    torch.testing.assert_close(y, y2, rtol=rtol, atol=atol)
    for a, b in zip(g, g2):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    assert not any(p.requires_grad for p in ad.base.parameters())


@pytest.mark.parametrize("kind,kw", LINEAR_CASES, ids=_IDS)
def test_linear_vs_formula(kind, kw):
    ad = _make(kind, kw)
    _check_vs_oracle(ad, torch.randn(2, 5, 20))


@pytest.mark.parametrize("kind", ["lora", "loha"])
def test_conv_vs_formula(kind):
    torch.manual_seed(1)
    ad = lnn.ADAPTERS[kind][nn.Conv2d](nn.Conv2d(3, 6, 3, stride=2, padding=1), rank=2, alpha=1.0)
    _perturb(ad, 1)
    _check_vs_oracle(ad, torch.randn(2, 3, 7, 9))


@pytest.mark.parametrize("kind,kw", LINEAR_CASES, ids=_IDS)
def test_initial_delta_is_zero(kind, kw):
    torch.manual_seed(0)
    kw = dict(kw)
    rank = kw.pop("rank", 4)
    base = nn.Linear(20, 32)
    cls = lnn.ADAPTERS[kind][nn.Linear]
    ad = cls(copy.deepcopy(base), **({"rank": rank} if cls.uses_rank else {}), **kw)
    x = torch.randn(4, 20)
    torch.testing.assert_close(ad(x), base(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind,kw", LINEAR_CASES, ids=_IDS)
def test_merge_unmerge_round_trip(kind, kw):
    ad = _make(kind, kw)
    w0, b0 = ad.base.weight.detach().clone(), ad.base.bias.detach().clone()
    x = torch.randn(3, 20)
    with torch.no_grad():
        y = ad(x)
        ad.merge()
        assert ad.merged
        torch.testing.assert_close(ad(x), y, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ad(x), F.linear(x, ad.base.weight, ad.base.bias))
        ad.unmerge()
        assert not ad.merged
    torch.testing.assert_close(ad.base.weight, w0, rtol=0, atol=1e-6)
    torch.testing.assert_close(ad.base.bias, b0, rtol=0, atol=1e-6)
    torch.testing.assert_close(ad(x), y, rtol=1e-5, atol=1e-6)


def _stack(kind="lora", **kw):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
    return lnn.add_adapters(m, kind, **kw)


def test_add_merge_unmerge_model_and_remove():
    m = _stack("lora", rank=4)
    assert [n for n, _ in lnn.adapters(m)] == ["0", "2"]
    _perturb(m)
    x = torch.randn(2, 3, 24)
    with torch.no_grad():
        y = m(x)
        lnn.merge_adapters(m)
        torch.testing.assert_close(m(x), y, rtol=1e-4, atol=1e-5)
        lnn.unmerge_adapters(m)
        torch.testing.assert_close(m(x), y, rtol=1e-5, atol=1e-6)
        plain = lnn.remove_adapters(copy.deepcopy(m))
        assert all(type(mod) is not lnn.LoRALinear for mod in plain.modules())
        torch.testing.assert_close(plain(x), y, rtol=1e-4, atol=1e-5)
    lnn.mark_only_adapters_trainable(m)
    names = {n for n, p in m.named_parameters() if p.requires_grad}
    assert names == {"0.lora_down", "0.lora_up", "2.lora_down", "2.lora_up"}


def test_add_adapters_filters_and_errors():
    m = _stack("lokr", rank=2, include=["2"])
    assert [n for n, _ in lnn.adapters(m)] == ["2"]
    m = _stack("ia3", exclude="0")
    assert [n for n, _ in lnn.adapters(m)] == ["2"]
    assert isinstance(lnn.add_adapters(nn.Linear(4, 4), "lora", rank=2), lnn.LoRALinear)
    with pytest.raises(ValueError, match="kind"):
        lnn.add_adapters(nn.Linear(4, 4), "nope")
    with pytest.raises(ValueError, match="Conv2d"):
        lnn.add_adapters(nn.Conv2d(3, 4, 3), "norm", target=(nn.Conv2d,))
    assert isinstance(lnn.add_adapters(nn.Conv2d(3, 4, 3), "lokr", target=(nn.Conv2d,)), lnn.LoKrConv2d)
    with pytest.raises(ValueError, match="block_size"):
        lnn.OFTLinear(nn.Linear(4, 6), block_size=4)
    with pytest.raises(TypeError, match="already"):
        lnn.LoRALinear(lnn.LoRALinear(nn.Linear(4, 4)))


@pytest.mark.parametrize("kind,kw", [("lora", dict(rank=3, alpha=1.5)), ("lokr", dict(rank=2)),
                                     ("dora", dict(rank=2)), ("boft", dict(block_size=4, n_butterfly=2))])
def test_state_dict_round_trip(kind, kw):
    a = _stack(kind, **kw)
    _perturb(a, seed=3)
    sd = a.state_dict()
    assert "0.base.weight" in sd
    b = _stack(kind, **dict(kw, **({"alpha": 7.0} if "alpha" in kw else {})))
    b.load_state_dict(sd)
    x = torch.randn(2, 24)
    torch.testing.assert_close(b(x), a(x))
    if "alpha" in kw:
        assert b[0].scale == a[0].scale


# ---------------------------------------------------------------- LyCORIS state dicts


def _synthetic_lycoris_sd(g):
    r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
    return {
        "lycoris_0.lora_down.weight": r(3, 24), "lycoris_0.lora_up.weight": r(32, 3), "lycoris_0.alpha": torch.tensor(2.0),
        "lycoris_2.hada_w1_a": r(16, 2), "lycoris_2.hada_w1_b": r(2, 32), "lycoris_2.hada_w2_a": r(16, 2),
        "lycoris_2.hada_w2_b": r(2, 32), "lycoris_2.alpha": torch.tensor(1.0),
        "lycoris_4.lokr_w1": r(4, 4), "lycoris_4.lokr_w2_a": r(2, 1), "lycoris_4.lokr_w2_b": r(1, 4),
        "lycoris_4.alpha": torch.tensor(0.5),
    }


def test_load_lycoris_state_dict():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 8))
    ref = copy.deepcopy(m)
    sd = _synthetic_lycoris_sd(torch.Generator().manual_seed(5))
    lnn.load_lycoris_state_dict(m, sd)
    assert isinstance(m[0], lnn.LoRALinear) and isinstance(m[2], lnn.LoHaLinear) and isinstance(m[4], lnn.LoKrLinear)
    W0 = ref[0].weight + 2.0 / 3 * sd["lycoris_0.lora_up.weight"] @ sd["lycoris_0.lora_down.weight"]
    W2 = ref[2].weight + 1.0 / 2 * (sd["lycoris_2.hada_w1_a"] @ sd["lycoris_2.hada_w1_b"]) * (
        sd["lycoris_2.hada_w2_a"] @ sd["lycoris_2.hada_w2_b"])
    W4 = ref[4].weight + 0.5 / 1 * torch.kron(sd["lycoris_4.lokr_w1"],
                                              sd["lycoris_4.lokr_w2_a"] @ sd["lycoris_4.lokr_w2_b"])
    with torch.no_grad():
        ref[0].weight.copy_(W0)
        ref[2].weight.copy_(W2)
        ref[4].weight.copy_(W4)
    x = torch.randn(3, 24)
    torch.testing.assert_close(m(x), ref(x), rtol=1e-4, atol=1e-5)


def _conv_sd_cases():
    """(name, LyCORIS tensors for a Conv2d(6 -> 8, 3x3), the ΔW they stand for) per conv format."""
    g = torch.Generator().manual_seed(7)
    r = lambda *sh: torch.randn(*sh, generator=g) * 0.3  # noqa: E731
    a, c, b, d, R = 2, 4, 2, 3, 2
    out = []
    up, down = r(8, R, 1, 1), r(R, 6, 3, 3)
    out.append(("locon", {"lora_up.weight": up, "lora_down.weight": down, "alpha": torch.tensor(1.0)},
                0.5 * (up.reshape(8, R) @ down.reshape(R, -1)).reshape(8, 6, 3, 3)))
    up, mid, down = r(8, R, 1, 1), r(R, R, 3, 3), r(R, 6, 1, 1)
    out.append(("locon-tucker", {"lora_up.weight": up, "lora_mid.weight": mid, "lora_down.weight": down,
                                 "alpha": torch.tensor(3.0)},
                1.5 * torch.einsum("op,pqhw,qi->oihw", up.reshape(8, R), mid, down.reshape(R, 6))))
    w1a, w1b, w2a, w2b = r(8, R), r(R, 54), r(8, R), r(R, 54)
    out.append(("loha", {"hada_w1_a": w1a, "hada_w1_b": w1b, "hada_w2_a": w2a, "hada_w2_b": w2b,
                         "alpha": torch.tensor(2.0)}, ((w1a @ w1b) * (w2a @ w2b)).reshape(8, 6, 3, 3)))
    t1, t2, w1a, w1b, w2a, w2b = r(R, R, 3, 3), r(R, R, 3, 3), r(R, 8), r(R, 6), r(R, 8), r(R, 6)
    chain = lambda t, wa, wb: torch.einsum("pqhw,po,qi->oihw", t, wa, wb)  # noqa: E731
    out.append(("loha-tucker", {"hada_t1": t1, "hada_t2": t2, "hada_w1_a": w1a, "hada_w1_b": w1b,
                                "hada_w2_a": w2a, "hada_w2_b": w2b, "alpha": torch.tensor(1.0)},
                0.5 * chain(t1, w1a, w1b) * chain(t2, w2a, w2b)))
    kron = lambda w1, w2: torch.einsum("uv,ijhw->uivjhw", w1, w2).reshape(a * c, b * d, 3, 3)  # noqa: E731
    w1, w2 = r(a, b), r(c, d, 3, 3)
    out.append(("lokr-whole", {"lokr_w1": w1, "lokr_w2": w2, "alpha": torch.tensor(4.0)}, kron(w1, w2)))
    w1, w2a, w2b = r(a, b), r(c, 1), r(1, d, 3, 3)
    out.append(("lokr-factored", {"lokr_w1": w1, "lokr_w2_a": w2a, "lokr_w2_b": w2b, "alpha": torch.tensor(0.5)},
                0.5 * kron(w1, torch.einsum("cr,rdhw->cdhw", w2a, w2b))))
    w1, t2, w2a, w2b = r(a, b), r(R, R, 3, 3), r(R, c), r(R, d)
    out.append(("lokr-tucker", {"lokr_w1": w1, "lokr_t2": t2, "lokr_w2_a": w2a, "lokr_w2_b": w2b,
                                "alpha": torch.tensor(1.0)},
                0.5 * kron(w1, torch.einsum("ijhw,ip,jq->pqhw", t2, w2a, w2b))))
    return out


@pytest.mark.parametrize("case", _conv_sd_cases(), ids=lambda c: c[0])
def test_load_lycoris_conv_formats(case):
    """LyCORIS conv adapters (LoCon, LoHa, LoKr; plain, factored and tucker) from a state dict:
    forward against F.conv2d with W + ΔW built here from the stored tensors, gradients reach
    every factor, merge/unmerge."""
    name, tensors, dw = case
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(6, 8, 3, stride=2, padding=1))
    ref = copy.deepcopy(m[0])
    lnn.load_lycoris_state_dict(m, {f"lycoris_0.{k}": v for k, v in tensors.items()}, multiplier=0.8)
    ad = m[0]
    assert isinstance(ad, lnn.AdapterModule), type(ad)
    x = torch.randn(2, 6, 9, 7)
    want = F.conv2d(x, ref.weight + 0.8 * dw, ref.bias, stride=2, padding=1)
    y = ad(x)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    y.square().sum().backward()
    trained = [n for n, p in ad.named_parameters() if p.requires_grad]
    assert trained and all(ad.get_parameter(n).grad is not None for n in trained), trained
    with torch.no_grad():
        ad.merge()
        torch.testing.assert_close(ad.base.weight, ref.weight + 0.8 * dw, rtol=1e-4, atol=1e-5)
        ad.unmerge()
        torch.testing.assert_close(ad.base.weight, ref.weight, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("on_out", [True, False], ids=["per-out", "per-in"])
@pytest.mark.parametrize("tucker", [False, True], ids=["plain", "tucker"])
def test_load_lycoris_conv_dora(on_out, tucker):
    """DoRA on a conv from a LyCORIS state dict: conv(x, M·(m·(dora_scale/‖M‖ − 1) + 1)) with
    M = W + m·γ·ΔW, norms per output channel or per input channel; gradients; merge/unmerge."""
    g = torch.Generator().manual_seed(11)
    r = lambda *sh: torch.randn(*sh, generator=g) * 0.3  # noqa: E731
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(6, 8, 3, padding=1))
    ref = copy.deepcopy(m[0])
    R, mult = 2, 0.8
    up = r(8, R, 1, 1)
    sd = {"lora_up.weight": up, "alpha": torch.tensor(1.0)}
    if tucker:
        sd.update({"lora_mid.weight": r(R, R, 3, 3), "lora_down.weight": r(R, 6, 1, 1)})
        dw = torch.einsum("op,pqhw,qi->oihw", up.reshape(8, R), sd["lora_mid.weight"],
                          sd["lora_down.weight"].reshape(R, 6))
    else:
        sd["lora_down.weight"] = r(R, 6, 3, 3)
        dw = (up.reshape(8, R) @ sd["lora_down.weight"].reshape(R, -1)).reshape(8, 6, 3, 3)
    dims = (1, 2, 3) if on_out else (0, 2, 3)
    sd["dora_scale"] = torch.rand(8 if on_out else 6, generator=g).reshape((8, 1, 1, 1) if on_out else (1, 6, 1, 1)) + 0.5
    lnn.load_lycoris_state_dict(m, {f"lycoris_0.{k}": v for k, v in sd.items()}, multiplier=mult)
    ad = m[0]
    assert isinstance(ad, lnn.DoRAConv2d) and ad.wd_on_out == on_out and (ad.lora_mid is not None) == tucker
    M = ref.weight + 0.5 * dw  # LyCORIS: the multiplier only blends the rescale
    n = torch.linalg.vector_norm(M, dim=dims, keepdim=True) + torch.finfo(torch.float32).eps
    Wp = M * (mult * (sd["dora_scale"] / n - 1) + 1)
    x = torch.randn(2, 6, 7, 5)
    y = ad(x)
    torch.testing.assert_close(y, F.conv2d(x, Wp, ref.bias, padding=1), rtol=1e-4, atol=1e-5)
    y.square().sum().backward()
    assert all(p.grad is not None for p in ad.parameters() if p.requires_grad)
    with torch.no_grad():
        ad.merge()
        torch.testing.assert_close(ad.base.weight, Wp, rtol=1e-4, atol=1e-5)
        ad.unmerge()
        torch.testing.assert_close(ad.base.weight, ref.weight)


CONV_WEIGHT_CASES = [
    ("oft", dict(block_size=4, rescaled=True)),
    ("boft", dict(block_size=4, n_butterfly=2, rescaled=True)),
    ("ia3", dict(multiplier=0.6)),
    ("ia3", dict(train_on_input=True, multiplier=0.6)),
    ("full", dict(multiplier=0.8)),
]


@pytest.mark.parametrize("kind,kw", CONV_WEIGHT_CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CONV_WEIGHT_CASES)])
def test_conv_weight_adapters_vs_formula(kind, kw):
    """OFT / BOFT / IA3 / Full on a Conv2d: the conv with the adapted (O, I, kh, kw) weight
    built here from the parameters (rotations of the output channels, channel scales, a
    difference); gradients reach the adapter; merge/unmerge."""
    torch.manual_seed(0)
    ad = lnn.add_adapters(nn.Conv2d(6, 8, 3, stride=2, padding=1), kind, target=(nn.Conv2d,), **kw)
    _perturb(ad, seed=2)
    W, b = ad.base.weight.detach().clone(), ad.base.bias.detach().clone()
    if kind in ("oft", "boft"):
        R = _boft_matrix(ad.oft_blocks) if kind == "boft" else torch.block_diag(*_cayley(ad.oft_blocks)).T
        Wp = (R @ W.reshape(8, -1)).reshape(W.shape) * ad.rescale.reshape(8, 1, 1, 1)
        bp = b
    elif kind == "ia3":
        s = 1 + ad.multiplier * ad.ia3_weight
        if ad.train_on_input:
            Wp, bp = W * s.reshape(1, 6, 1, 1), b
        else:
            Wp, bp = W * s.reshape(8, 1, 1, 1), b * s
    else:
        Wp, bp = W + ad.multiplier * ad.diff, b + ad.multiplier * ad.diff_b
    x = torch.randn(2, 6, 9, 7)
    y = ad(x)
    torch.testing.assert_close(y, F.conv2d(x, Wp, bp, stride=2, padding=1), rtol=1e-4, atol=1e-5)
    y.square().sum().backward()
    trained = [p for p in ad.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in trained)
    with torch.no_grad():
        ad.merge()
        torch.testing.assert_close(ad.base.weight, Wp, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ad(x), F.conv2d(x, Wp, bp, stride=2, padding=1), rtol=1e-4, atol=1e-5)
        ad.unmerge()
        torch.testing.assert_close(ad.base.weight, W, rtol=1e-4, atol=1e-5)


def test_load_lycoris_conv_oft_ia3_full():
    g = torch.Generator().manual_seed(4)
    m = nn.Sequential(nn.Conv2d(6, 8, 3), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3), nn.Conv2d(8, 4, 1))
    sd = {"lycoris_0.oft_blocks": torch.randn(2, 4, 4, generator=g) * 0.1,
          "lycoris_0.rescale": torch.rand(8, 1, 1, 1, generator=g) + 0.5,
          "lycoris_1.oft_blocks": torch.randn(2, 4, 2, 2, generator=g) * 0.1,
          "lycoris_2.weight": torch.randn(8, generator=g) * 0.1, "lycoris_2.on_input": torch.tensor(True),
          "lycoris_3.diff": torch.randn(4, 8, 1, 1, generator=g) * 0.1, "lycoris_3.diff_b": torch.randn(4, generator=g)}
    lnn.load_lycoris_state_dict(m, sd)
    assert [type(a).__name__ for a in m] == ["OFTConv2d", "BOFTConv2d", "IA3Conv2d", "FullConv2d"]
    assert m[2].train_on_input and m[0].rescale is not None
    x = torch.randn(2, 6, 7, 7)
    want = x
    for a in m:
        w, b = a.merged_weight()
        want = F.conv2d(want, w, a.base.bias if b is None else b)
    torch.testing.assert_close(m(x), want)
    torch.testing.assert_close(m[3].diff_b, sd["lycoris_3.diff_b"])


def _round_trip_cases():
    """(name, model factory, LyCORIS state dict) covering every algorithm the loader reads."""
    g = torch.Generator().manual_seed(9)
    r = lambda *sh: torch.randn(*sh, generator=g) * 0.3  # noqa: E731
    lin = lambda: nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 8))  # noqa: E731
    conv = lambda: nn.Sequential(nn.Conv2d(6, 8, 3, stride=2, padding=1))  # noqa: E731
    cases = [("linear-lora-loha-lokr", lin, _synthetic_lycoris_sd(g))]
    cases += [(f"conv-{n}", conv, {f"lycoris_0.{k}": v for k, v in t.items()}) for n, t, _ in _conv_sd_cases()]
    cases.append(("conv-dora", conv, {"lycoris_0.lora_up.weight": r(8, 2, 1, 1), "lycoris_0.lora_down.weight":
                                      r(2, 6, 3, 3), "lycoris_0.alpha": torch.tensor(1.0),
                                      "lycoris_0.dora_scale": r(8, 1, 1, 1).abs() + 0.5}))
    cases.append(("linear-dora-oft-ia3-full", lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8),
                                                                    nn.Linear(8, 4)), {
        "lycoris_0.lora_up.weight": r(8, 2), "lycoris_0.lora_down.weight": r(2, 8), "lycoris_0.alpha": torch.tensor(2.0),
        "lycoris_0.dora_scale": r(1, 8).abs() + 0.5,
        "lycoris_1.oft_blocks": r(2, 4, 4), "lycoris_1.rescale": r(8, 1), "lycoris_1.alpha": torch.tensor(0.1),
        "lycoris_2.weight": r(8), "lycoris_2.on_input": torch.tensor(False),
        "lycoris_3.diff": r(4, 8), "lycoris_3.diff_b": r(4)}))
    cases.append(("conv-boft-norms", lambda: nn.Sequential(nn.Conv2d(8, 8, 1), nn.GroupNorm(2, 8), nn.LayerNorm(8)), {
        "lycoris_0.oft_blocks": r(2, 4, 2, 2), "lycoris_0.rescale": r(8, 1, 1, 1),
        "lycoris_1.w_norm": r(8), "lycoris_1.b_norm": r(8), "lycoris_2.w_norm": r(8), "lycoris_2.b_norm": r(8)}))
    return cases


@pytest.mark.parametrize("case", _round_trip_cases(), ids=lambda c: c[0])
def test_lycoris_state_dict_round_trip(case):
    """load_lycoris_state_dict then lycoris_state_dict gives the same keys, shapes and values;
    a trained parameter shows in the next export."""
    _, make, sd = case
    m = lnn.load_lycoris_state_dict(make(), sd)
    out = lnn.lycoris_state_dict(m)
    assert sorted(out) == sorted(sd)
    for k, v in sd.items():
        assert out[k].shape == v.shape, k
        torch.testing.assert_close(out[k].to(v.dtype), v, msg=k)
    name, ad = next(iter(lnn.adapters(m)))
    p = next(p for p in ad.parameters() if p.requires_grad)
    with torch.no_grad():
        p.add_(1.0)
    changed = [k for k, v in lnn.lycoris_state_dict(m).items() if not torch.equal(v.to(sd[k].dtype), sd[k])]
    assert changed and all(k.startswith(f"lycoris_{name.replace('.', '_')}.") for k in changed)


def test_load_lycoris_state_dict_wrong_model_names_the_layer():
    sd = {"lycoris_0.lora_down.weight": torch.zeros(2, 24), "lycoris_0.lora_up.weight": torch.zeros(32, 2)}
    with pytest.raises(ValueError, match=r"0 \(Linear with weight \(8, 16\)\).*lora_down.weight"):
        lnn.load_lycoris_state_dict(nn.Sequential(nn.Linear(16, 8)), sd)
    with pytest.raises(ValueError, match="hada_w2_a"):  # an incomplete LoHa
        lnn.load_lycoris_state_dict(nn.Sequential(nn.Linear(16, 8)), {
            "lycoris_0.hada_w1_a": torch.zeros(8, 2), "lycoris_0.hada_w1_b": torch.zeros(2, 16)})


def test_conv_adapters_start_at_zero_and_tucker_on_linear_raises():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 6, 6)
    for ad in (lnn.LoRAConv2d(nn.Conv2d(8, 12, 3, padding=1), 2, use_tucker=True),
               lnn.LoHaConv2d(nn.Conv2d(8, 12, 3, padding=1), 2, use_tucker=True),
               lnn.LoKrConv2d(nn.Conv2d(8, 12, 3, padding=1), 1), lnn.LoKrConv2d(nn.Conv2d(8, 12, 3), 8),
               lnn.DoRAConv2d(nn.Conv2d(8, 12, 3), 2), lnn.DoRAConv2d(nn.Conv2d(8, 12, 3), 2, wd_on_out=False)):
        torch.testing.assert_close(ad(x), ad.base(x))
    assert lnn.LoRAConv2d(nn.Conv2d(8, 12, 3), 2, use_tucker=True).lora_mid is not None
    assert lnn.LoRAConv2d(nn.Conv2d(8, 12, 1), 2, use_tucker=True).lora_mid is None  # 1x1: nothing to factor
    with pytest.raises(ValueError, match="tucker factors on a Linear"):
        lnn.load_lycoris_state_dict(nn.Sequential(nn.Linear(4, 4)), {
            "lycoris_0.lora_up.weight": torch.zeros(4, 2), "lycoris_0.lora_mid.weight": torch.zeros(2, 2),
            "lycoris_0.lora_down.weight": torch.zeros(2, 4)})


NORM_CASES = [
    ("layernorm", lambda: nn.LayerNorm(12), (3, 5, 12)),
    ("layernorm-2d-nobias", lambda: nn.LayerNorm((4, 6), bias=False), (3, 4, 6)),
    ("groupnorm", lambda: nn.GroupNorm(3, 6), (2, 6, 5, 4)),
]


@pytest.mark.parametrize("make,shape", [c[1:] for c in NORM_CASES], ids=[c[0] for c in NORM_CASES])
def test_norm_adapter_vs_formula(make, shape):
    """LyCORIS' Norms algorithm: the norm with W + m·w_norm and b + m·b_norm; outputs and
    gradients against F.layer_norm / F.group_norm with the moved weights; merge/unmerge;
    a state-dict round trip."""
    torch.manual_seed(0)
    base = make()
    with torch.no_grad():
        base.weight.normal_()
        if base.bias is not None:
            base.bias.normal_()
    ref_w = base.weight.detach().clone()
    ref_b = None if base.bias is None else base.bias.detach().clone()
    ad = lnn.add_adapters(nn.Sequential(base), "norm", target=(type(base),), multiplier=0.7)[0]
    assert isinstance(ad, lnn.NormAdapter) and (ad.b_norm is None) == (ref_b is None)
    x = torch.randn(*shape)
    torch.testing.assert_close(ad(x), base(x))  # zero deltas: the plain norm
    _perturb(ad, seed=1)
    params = [p for p in ad.parameters() if p.requires_grad]
    assert {id(p) for p in params} == {id(p) for p in (ad.w_norm, ad.b_norm) if p is not None}

    def oracle(x):
        w = ref_w + 0.7 * ad.w_norm
        b = None if ref_b is None else ref_b + 0.7 * ad.b_norm
        if isinstance(base, nn.GroupNorm):
            return F.group_norm(x, base.num_groups, w, b, base.eps)
        return F.layer_norm(x, base.normalized_shape, w, b, base.eps)

    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y2 = ad(x1), oracle(x2)
    gy = torch.randn_like(y)
    torch.testing.assert_close(y, y2)
    for a, b in zip(torch.autograd.grad(y, [x1] + params, gy), torch.autograd.grad(y2, [x2] + params, gy)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        want = oracle(x)
        ad.merge()
        torch.testing.assert_close(ad(x), want)
        ad.unmerge()
        torch.testing.assert_close(ad.base.weight, ref_w)
        torch.testing.assert_close(ad(x), want)
    other = lnn.NormAdapter(make(), multiplier=0.7)
    other.load_state_dict(ad.state_dict())
    torch.testing.assert_close(other(x), ad(x))


def test_norm_adapter_errors_and_lycoris_import():
    with pytest.raises(ValueError, match="no affine weight"):
        lnn.NormAdapter(nn.LayerNorm(8, elementwise_affine=False))
    with pytest.raises(TypeError, match="wraps"):
        lnn.NormAdapter(nn.Linear(4, 4))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GroupNorm(2, 8))
    ref = copy.deepcopy(m)
    g = torch.Generator().manual_seed(2)
    sd = {"lycoris_1.w_norm": torch.randn(8, generator=g), "lycoris_1.b_norm": torch.randn(8, generator=g),
          "lycoris_2.w_norm": torch.randn(8, generator=g)}
    lnn.load_lycoris_state_dict(m, sd, multiplier=0.5)
    assert isinstance(m[0], nn.Linear) and isinstance(m[1], lnn.NormAdapter) and isinstance(m[2], lnn.NormAdapter)
    assert m[2].b_norm is not None and not m[2].b_norm.any()  # absent from the dict: stays zero
    with torch.no_grad():
        ref[1].weight.add_(0.5 * sd["lycoris_1.w_norm"])
        ref[1].bias.add_(0.5 * sd["lycoris_1.b_norm"])
        ref[2].weight.add_(0.5 * sd["lycoris_2.w_norm"])
    x = torch.randn(4, 8)
    torch.testing.assert_close(m(x), ref(x))
    with pytest.raises(ValueError, match="'norm' algorithm"):  # norm tensors on a Linear
        lnn.load_lycoris_state_dict(nn.Sequential(nn.Linear(8, 8)), {"lycoris_0.w_norm": torch.zeros(8)})


# ---------------------------------------------------------------- compile / export


def _lycoris_targets(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "lycoris" in str(n.target)}


def test_compile_fullgraph_keeps_ops():
    from torch._dynamo.backends.debugging import aot_eager

    torch._dynamo.reset()
    m = nn.Sequential(lnn.LoRALinear(nn.Linear(24, 32), rank=4), nn.GELU(),
                      lnn.LoKrLinear(nn.Linear(32, 16), rank=2), nn.GELU(),
                      lnn.IA3Linear(nn.Linear(16, 8)))
    _perturb(m)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(m, fullgraph=True, backend=backend)
    x = torch.randn(2, 3, 24)
    y_ref = m(x)
    y_ref.square().sum().backward()
    g_ref = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    m.zero_grad()
    y = compiled(x)
    y.square().sum().backward()
    g = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(graphs) == 1
    targets = " ".join(_lycoris_targets(graphs[0]))
    for op in ("lora_bypass_fwd", "lokr_bypass_fwd", "ia3_fwd"):
        assert op in targets, targets


def test_export_round_trip(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(lnn.LoRALinear(nn.Linear(24, 32), rank=4), nn.GELU(),
                      lnn.LoHaLinear(nn.Linear(32, 16), rank=2))
    _perturb(m)
    x = torch.randn(3, 24)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(m, (x,), dynamic_shapes={"input": {0: batch}})
    targets = " ".join(_lycoris_targets(ep.graph_module))
    assert "lora_bypass_fwd" in targets and "loha_bypass_fwd" in targets, targets
    path = tmp_path / "adapted.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path)
    x2 = torch.randn(5, 24)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module()(x2), m(x2))
    # merged model exports as plain linears
    lnn.merge_adapters(m)
    ep2 = torch.export.export(m, (x,))
    assert not _lycoris_targets(ep2.graph_module)
    with torch.no_grad():
        torch.testing.assert_close(ep2.module()(x), m(x))


def test_conv_adapters_export_round_trip(tmp_path):
    """A conv stack with LoKr, DoRA (tucker), OFT, IA3 and Norm adapters exports with the ops
    in the graph, saves, loads and runs at another batch size; merged, it exports plain."""
    torch.manual_seed(0)
    m = nn.Sequential(lnn.LoKrConv2d(nn.Conv2d(8, 16, 3, padding=1), rank=2), nn.GELU(),
                      lnn.DoRAConv2d(nn.Conv2d(16, 16, 3, padding=1), rank=2, use_tucker=True),
                      lnn.NormAdapter(nn.GroupNorm(4, 16)),
                      lnn.OFTConv2d(nn.Conv2d(16, 16, 1), block_size=4),
                      lnn.IA3Conv2d(nn.Conv2d(16, 8, 3)))
    _perturb(m)
    x = torch.randn(2, 8, 7, 7)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(m, (x,), dynamic_shapes={"input": {0: batch}})
    targets = " ".join(_lycoris_targets(ep.graph_module))
    for op in ("lora_tucker_fwd", "dora_fwd", "add_scaled", "oft_fwd", "ia3_fwd"):
        assert op in targets, (op, targets)
    path = tmp_path / "conv.pt2"
    torch.export.save(ep, path)
    x2 = torch.randn(5, 8, 7, 7)
    with torch.no_grad():
        torch.testing.assert_close(torch.export.load(path).module()(x2), m(x2), rtol=1e-4, atol=1e-5)
        want = m(x2)
        lnn.merge_adapters(m)
        torch.testing.assert_close(m(x2), want, rtol=1e-4, atol=1e-5)
    assert not _lycoris_targets(torch.export.export(m, (x,)).graph_module)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("wd_on_out", [True, False], ids=["rows", "cols"])
def test_dora_bypass_equals_merged_weight(dtype, wd_on_out):
    """DoRALinear's forward (rescale vector around the base layer + LoRA bypass, norm
    gradients through _Rescale) equals F.linear with the merged weight W' built by
    the merge and dora ops, outputs and every gradient, at odd sizes."""
    torch.manual_seed(3)
    ad = lnn.DoRALinear(nn.Linear(37, 45).to(dtype), rank=5, multiplier=0.8, wd_on_out=wd_on_out)
    _perturb(ad, 3, std=0.3)
    x = torch.randn(3, 7, 37, dtype=dtype)
    params = [ad.lora_up, ad.lora_down, ad.dora_scale]
    outs = []
    for merged in (False, True):
        x1 = x.clone().requires_grad_(True)
        y = F.linear(x1, ad._weight(), ad.base.bias) if merged else ad(x1)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        outs.append((y,) + torch.autograd.grad(y, [x1] + params, gy))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(*outs):
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
        assert err < tol, err


@pytest.mark.parametrize("multiplier", [1.0, 0.6])
@pytest.mark.parametrize("row_axis", [0, 1])
def test_rescale_gradcheck(row_axis, multiplier):
    """The rescale m·d/(‖W + γ·up·down‖ + ε) + 1 − m from the norms' expansion (no merged
    weight) and its gradients in up, down and d, against torch's norm of the built matrix, in
    float64 (gradcheck)."""
    torch.manual_seed(row_axis)
    W = torch.randn(7, 9, dtype=torch.float64)
    up = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    down = torch.randn(3, 9, dtype=torch.float64, requires_grad=True)
    d = (torch.rand(9 if row_axis else 7, dtype=torch.float64) + 0.5).requires_grad_()
    s = _Rescale.apply(W, d, up, down, 0.7, row_axis, multiplier, torch.float64)
    eps = torch.finfo(torch.float64).eps
    want = multiplier * d / ((W + 0.7 * up @ down).norm(dim=1 - row_axis) + eps) + 1 - multiplier
    torch.testing.assert_close(s, want)
    assert torch.autograd.gradcheck(lambda u, dn, dd: _Rescale.apply(W, dd, u, dn, 0.7, row_axis, multiplier,
                                                                     torch.float64), (up, down, d))


def test_dora_bypass_compile_and_export():
    """The DoRA bypass (the LoRA bypass op around the base layer, norms by _Rescale)
    compiles with fullgraph and exports; the exported graph holds the LoRA bypass and
    never builds the O×I merged weight (no merge op)."""
    from torch._dynamo.backends.debugging import aot_eager

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = nn.Sequential(lnn.DoRALinear(nn.Linear(24, 32), rank=4), nn.GELU(),
                      lnn.DoRALinear(nn.Linear(32, 16), rank=2, wd_on_out=False))
    _perturb(m)
    x = torch.randn(2, 3, 24)
    m(x).square().sum().backward()
    g_ref = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    m.zero_grad()
    compiled = torch.compile(m, fullgraph=True, backend=aot_eager)
    compiled(x).square().sum().backward()
    g = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    assert len(g) == len(g_ref) == 6
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ep = torch.export.export(m, (x,))
    targets = " ".join(_lycoris_targets(ep.graph_module))
    assert "lora_bypass_fwd" in targets and "lora_merge_fwd" not in targets, targets
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), m(x))
