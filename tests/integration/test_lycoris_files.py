"""LyCORIS files in and out: ``load_lycoris_state_dict`` / ``lycoris_state_dict`` against
lycoris-lora itself, and the loader's rules (strictness, DyLoRA, what it refuses).

lycoris-lora runs in subprocesses (tests/lycoris_reference.py; it registers a
``torch.ops.lycoris`` namespace of its own and cannot share a process with lycoris_ops): one
makes a network per case of ``lycoris_reference.CASES`` (every algorithm and option) and saves
its file, its output and gradients; here the file loads onto our ops and must give the same
output and gradients (fp32), and write back to the same tensors; a second process loads what we
write after changing every adapter tensor, and must compute what our adapters compute. The
lycoris-lora tests skip when it is not installed (``pip install -e .[test]`` installs it).
"""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lycoris_ops import nn as lnn
from lycoris_ops.nn.lycoris_io import _lycoris_tensors

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import lycoris_reference as ref  # noqa: E402  (torch only: lycoris-lora is imported in its subprocess)

#: case -> extra arguments of load_lycoris_state_dict (the plain DyLoRA file has no marker)
LOAD_ARGS = {"dylora-plain": dict(algo="dylora", block_size=2)}
#: cases lycoris-lora cannot load back (a DyLoRA module reads no LyCORIS file, not even its own)
NOT_RELOADABLE = {"dylora", "dylora-plain"}
#: the default suite's cases, one per loader fix; the others are the slow sweep
QUICK = ["locon", "loha-dora", "lokr-dora", "diag-oft-constraint", "boft-constraint", "ia3", "glora", "dylora",
         "dylora-plain"]


def _cases(skip=()):
    return [pytest.param(c, marks=() if c in QUICK else pytest.mark.slow) for c in ref.CASES if c not in skip]


def _run_reference(mode, folder, *cases):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "lycoris_reference.py"), mode, str(folder), *cases],
                          capture_output=True, text=True, timeout=600, cwd=str(folder),
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    missing = [line for line in proc.stderr.splitlines() if line.startswith("ModuleNotFoundError")]
    if proc.returncode and missing:
        pytest.skip(f"lycoris-lora is not installed (pip install lycoris-lora==4.1.3): {missing[-1]}")
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lycoris")
    _run_reference("make", folder)
    return folder


def _load(folder, case, **kw):
    saved = torch.load(folder / f"{case}.pt")
    model = ref.Model()
    model.load_state_dict(saved["base"])
    mult = ref.CASES[case].get("multiplier", ref.MULTIPLIER)
    lnn.load_lycoris_state_dict(model, str(folder / f"{case}.safetensors"), multiplier=mult,
                                **LOAD_ARGS.get(case, {}), **kw)
    return model, saved


def _params_by_key(model):
    """Our parameters under their LyCORIS keys."""
    out = {}
    for name, ad in lnn.adapters(model):
        for k, t in _lycoris_tensors(ad).items():
            if isinstance(t, nn.Parameter):
                out[f"lycoris_{name.replace('.', '_')}.{k}"] = t
    return out


def _ours_for(params, key, ref_grad_shape):
    """Our gradient for a lycoris-lora gradient key (DyLoRA's last blocks are slices of ours)."""
    mod, _, leaf = key.partition(".")
    if "_list." in leaf:  # up_list.i / down_list.i: the last block of the rank
        rows = ref_grad_shape[1] if leaf.startswith("up") else ref_grad_shape[0]
        if leaf.startswith("up"):
            g = params[f"{mod}.lora_up.weight"].grad
            return g.reshape(g.shape[0], -1)[:, -rows:]
        g = params[f"{mod}.lora_down.weight"].grad
        return g.reshape(g.shape[0], -1)[-rows:]
    return params[key].grad.reshape(ref_grad_shape)


@pytest.mark.parametrize("case", _cases())
def test_file_loads_to_lycoris_outputs_and_gradients(made, case):
    """Every algorithm and option lycoris-lora saves: the same output (rel. error < 1e-5), input
    gradient and gradients of every saved tensor (fp32), on an adapter of the expected kind."""
    model, saved = _load(made, case)
    kinds = {type(a).__name__ for _, a in lnn.adapters(model)}
    want = {"norms": 5}.get(case, 3)
    assert len(list(lnn.adapters(model))) == want, kinds
    x = ref.inputs().requires_grad_(True)
    y = model(x)
    err = ((y.detach() - saved["y"]).norm() / saved["y"].norm()).item()
    assert err < 1e-5, f"{case}: rel. error {err:.2e} against lycoris-lora ({sorted(kinds)})"
    y.square().sum().backward()
    torch.testing.assert_close(x.grad, saved["gx"], rtol=1e-4, atol=1e-5)
    params = _params_by_key(model)
    assert saved["grads"], "lycoris-lora recorded no gradient"
    for key, g in saved["grads"].items():
        torch.testing.assert_close(_ours_for(params, key, g.shape), g, rtol=1e-4, atol=1e-5, msg=key)


def test_loaded_adapter_kinds(made):
    """The algorithms the old loader got wrong load as their own adapters."""
    expect = {"loha-dora": "DoHa", "lokr-dora": "DoKr", "glora": "GLoRA", "dylora": "DyLoRA",
              "dylora-plain": "DyLoRA", "locon-dora-in": "DoRA"}
    for case, kind in expect.items():
        model, _ = _load(made, case)
        assert all(type(a).__name__.startswith(kind) for _, a in lnn.adapters(model)), case
    model, _ = _load(made, "diag-oft-constraint")
    assert model.fc1.constraint == pytest.approx(0.01 * 32)  # lycoris-lora's constraint × out_features
    model, _ = _load(made, "dylora")  # block size 4 from the file's metadata: 8 ranks, 2 blocks
    assert model.fc1.block_size == 4 and model.fc1.scale == 2 / 2


@pytest.mark.parametrize("case", _cases())
def test_write_back_is_the_file(made, case):
    """lycoris_state_dict of a loaded network is the file: same keys, shapes, dtypes, values."""
    from safetensors.torch import load_file

    model, _ = _load(made, case)
    back = lnn.lycoris_state_dict(model)
    want = load_file(str(made / f"{case}.safetensors"))
    assert sorted(back) == sorted(want)
    for k, v in want.items():
        assert back[k].shape == v.shape and back[k].dtype == v.dtype, (k, back[k].shape, v.shape, back[k].dtype)
        assert torch.equal(back[k], v), k


def _write_and_check(made, cases):
    """Each case loaded here, every adapter tensor moved (a training step's worth), our output,
    and the file ``lycoris_state_dict`` writes; then lycoris-lora loads the files (one process)."""
    from safetensors.torch import save_file

    outs = {}
    for case in cases:
        model, _ = _load(made, case)
        g = torch.Generator().manual_seed(list(ref.CASES).index(case))
        with torch.no_grad():
            for _, ad in lnn.adapters(model):
                for n, p in ad.named_parameters():
                    if not n.startswith("base."):
                        p.add_(torch.randn(p.shape, generator=g) * 0.05)
            outs[case] = model(ref.inputs())
        save_file(lnn.lycoris_state_dict(model), str(made / f"{case}.ours.safetensors"))
    _run_reference("check", made, *cases)
    return outs


@pytest.fixture(scope="module")
def written_quick(made):
    return _write_and_check(made, [c for c in QUICK if c not in NOT_RELOADABLE])


@pytest.fixture(scope="module")
def written_rest(made):
    return _write_and_check(made, [c for c in ref.CASES if c not in QUICK and c not in NOT_RELOADABLE])


@pytest.mark.parametrize("case", _cases(NOT_RELOADABLE))
def test_written_file_loads_in_lycoris(made, request, case):
    """lycoris-lora loads what lycoris_state_dict writes (no missing or unexpected key) and
    computes what our adapters compute."""
    written = request.getfixturevalue("written_quick" if case in QUICK else "written_rest")
    checked = torch.load(made / f"{case}.check.pt")
    assert not checked["load"], checked["load"]
    err = ((checked["y"] - written[case]).norm() / written[case].norm()).item()
    assert err < 1e-5, f"{case}: rel. error {err:.2e}"


# ---------------------------------------------------------------- the loader's rules (no lycoris-lora)


def _locon_sd(prefix="lycoris_fc1", O=32, I=16, r=4, alpha=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"{prefix}.lora_down.weight": torch.randn(r, I, generator=g) * 0.3,
            f"{prefix}.lora_up.weight": torch.randn(O, r, generator=g) * 0.3,
            f"{prefix}.alpha": torch.tensor(alpha)}


def _plain_model():
    torch.manual_seed(1)
    return ref.Model()


def test_strict_lists_unmatched_keys_and_unused_tensors_and_changes_nothing():
    sd = dict(_locon_sd(), **_locon_sd("lycoris_fc9", seed=1))
    sd["lycoris_fc1.scalar"] = torch.tensor(1.0)
    model = _plain_model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError) as e:
        lnn.load_lycoris_state_dict(model, sd)
    msg = str(e.value)
    assert "3 key(s) name no layer" in msg and "lycoris_fc9.lora_up.weight" in msg
    assert "1 tensor(s) no adapter reads" in msg and "lycoris_fc1.scalar" in msg
    assert not list(lnn.adapters(model)) and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # a module whose tensors name no algorithm is unused as a whole
    with pytest.raises(ValueError, match=r"no adapter reads: \['lycoris_fc1.foo'\]"):
        lnn.load_lycoris_state_dict(model, {"lycoris_fc1.foo": torch.zeros(3)})


def test_non_strict_loads_the_rest_and_returns_the_keys():
    sd = dict(_locon_sd(), **_locon_sd("lycoris_fc9", seed=1))
    sd["lycoris_fc1.scalar"] = torch.tensor(1.0)
    model = _plain_model()
    res = lnn.load_lycoris_state_dict(model, sd, strict=False)
    assert isinstance(res, lnn.LycorisLoadResult) and res.model is model and res.adapters == 1
    assert res.unmatched_keys == sorted(k for k in sd if "fc9" in k)
    assert res.unused_keys == ["lycoris_fc1.scalar"]
    assert isinstance(model.fc1, lnn.LoRALinear)
    res = lnn.load_lycoris_state_dict(_plain_model(), {"x.y": torch.zeros(1), "fc1": torch.zeros(1)}, strict=False)
    assert res.adapters == 0 and res.unmatched_keys == ["x.y"] and res.unused_keys == ["fc1"]
    # the default (strict) keeps returning the model itself
    assert lnn.load_lycoris_state_dict(_plain_model(), _locon_sd()).fc1.rank == 4


def test_dylora_by_metadata_or_hint_else_locon():
    """A DyLoRA file is LoCon tensors: LoCon by default (alpha/rank), DyLoRA (alpha per block
    count) by its metadata marker or algo='dylora'; conflicts and bad sizes raise."""
    sd = _locon_sd(r=8, alpha=2.0)
    meta = ref.network_metadata("dylora")  # {"algo": "dylora", "block_size": "4"}
    m = lnn.load_lycoris_state_dict(_plain_model(), sd)
    assert type(m.fc1) is lnn.LoRALinear and m.fc1.scale == 2.0 / 8
    m = lnn.load_lycoris_state_dict(_plain_model(), sd, metadata=meta)
    assert type(m.fc1) is lnn.DyLoRALinear and m.fc1.scale == 2.0 / 2
    m = lnn.load_lycoris_state_dict(_plain_model(), sd, algo="dylora")  # lycoris-lora's default block size 4
    assert m.fc1.scale == 2.0 / 2
    m = lnn.load_lycoris_state_dict(_plain_model(), sd, algo="dylora", block_size=2)
    assert m.fc1.scale == 2.0 / 4
    x = torch.randn(2, 16)
    with torch.no_grad():
        dw = sd["lycoris_fc1.lora_up.weight"] @ sd["lycoris_fc1.lora_down.weight"]
        want = F.linear(x, m.fc1.base.weight + 0.5 * dw, m.fc1.base.bias)
        torch.testing.assert_close(m.fc1(x), want)
    with pytest.raises(ValueError, match="metadata says a DyLoRA network"):
        lnn.load_lycoris_state_dict(_plain_model(), sd, metadata=meta, algo="locon")
    with pytest.raises(ValueError, match="block_size applies to DyLoRA files only"):
        lnn.load_lycoris_state_dict(_plain_model(), sd, block_size=2)
    with pytest.raises(ValueError, match="block_size 3 must divide the rank 8"):
        lnn.load_lycoris_state_dict(_plain_model(), sd, algo="dylora", block_size=3)
    dora = dict(sd, **{"lycoris_fc1.dora_scale": torch.ones(32, 1)})
    with pytest.raises(ValueError, match="DyLoRA module has neither dora_scale"):
        lnn.load_lycoris_state_dict(_plain_model(), dora, algo="dylora")


def test_algo_hint_must_match_the_tensors():
    sd = _locon_sd()
    assert isinstance(lnn.load_lycoris_state_dict(_plain_model(), sd, algo="lora").fc1, lnn.LoRALinear)
    with pytest.raises(ValueError, match="algo='loha', but fc1's tensors are LyCORIS' 'locon'"):
        lnn.load_lycoris_state_dict(_plain_model(), sd, algo="loha")
    with pytest.raises(ValueError, match="algo must be one of"):
        lnn.load_lycoris_state_dict(_plain_model(), sd, algo="tlora")
    norms = dict(sd, **{"lycoris_ln.w_norm": torch.zeros(32)})  # norms go with any algorithm
    assert isinstance(lnn.load_lycoris_state_dict(_plain_model(), norms, algo="locon").ln, lnn.NormAdapter)


def test_unsupported_raises_naming_the_layer():
    cases = [
        ({"lycoris_fc1.lambda_layer": torch.zeros(1, 4), "lycoris_fc1.q_layer.weight": torch.zeros(4, 16)},
         "fc1 .*T-LoRA is not supported"),
        ({"lycoris_fc1.a1.weight": torch.zeros(16, 4), "lycoris_fc1.a2.weight": torch.zeros(4, 16),
          "lycoris_fc1.b1.weight": torch.zeros(32, 4), "lycoris_fc1.b2.weight": torch.zeros(4, 16),
          "lycoris_fc1.bm.weight": torch.zeros(4, 4), "lycoris_fc1.alpha": torch.tensor(1.0)},
         "fc1 .*GLoRA with a tucker core"),
        (dict(_locon_sd(), **{"lycoris_fc1.hada_w1_a": torch.zeros(32, 4)}), "fc1: tensors of several"),
        ({"lycoris_fc2.diff": torch.zeros(16, 32), "lycoris_fc2.diff_b": torch.zeros(16)},
         "fc2 .*diff_b for a layer without a bias"),
        ({"lycoris_fc1.oft_blocks": torch.zeros(2, 8, 2, 2, 2)}, "oft_blocks must be 3-D"),
        ({"lycoris_fc1.lora_up.weight": torch.zeros(32, 4), "lycoris_fc1.lora_down.weight": torch.zeros(4, 16),
          "lycoris_fc1.dora_scale": torch.zeros(5)}, "dora_scale must be"),
    ]
    for sd, pattern in cases:
        for strict in (True, False):
            with pytest.raises(ValueError, match=pattern):
                lnn.load_lycoris_state_dict(_plain_model(), sd, strict=strict)
    conv1d = nn.Sequential(nn.Conv1d(4, 8, 3))
    with pytest.raises(ValueError, match=r"0 \(Conv1d\) has LyCORIS' 'locon' tensors.*adapts only"):
        lnn.load_lycoris_state_dict(conv1d, {"lycoris_0.lora_up.weight": torch.zeros(8, 2, 1),
                                             "lycoris_0.lora_down.weight": torch.zeros(2, 4, 3)})
    grouped = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2))
    with pytest.raises(ValueError, match="groups=1"):
        lnn.load_lycoris_state_dict(grouped, {"lycoris_0.lora_up.weight": torch.zeros(8, 2, 1, 1),
                                              "lycoris_0.lora_down.weight": torch.zeros(2, 2, 3, 3)})
    with pytest.raises(ValueError, match="fc1 has tensors under two module keys: 'lycoris_fc1' and 'lora_unet_fc1'"):
        lnn.load_lycoris_state_dict(_plain_model(), dict(_locon_sd(), **_locon_sd("lora_unet_fc1")))
    adapted = lnn.load_lycoris_state_dict(_plain_model(), _locon_sd())
    with pytest.raises(ValueError, match="already has an adapter"):
        lnn.load_lycoris_state_dict(adapted, _locon_sd())


def test_ia3_round_trip_keeps_the_bias_rule():
    """#57: LyCORIS's IA3 leaves the bias unscaled (scale_bias=False): such adapters round-trip
    exactly; an adapter scaling a bias has no LyCORIS form and says so."""
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    for kw in (dict(scale_bias=False), dict(train_on_input=True)):
        m = nn.Sequential(lnn.IA3Linear(nn.Linear(16, 8), multiplier=0.7, **kw))
        with torch.no_grad():
            m[0].ia3_weight.normal_()
            y = m(x)
        sd = lnn.lycoris_state_dict(m)
        assert sd["lycoris_0.on_input"].dtype == torch.int64
        back = lnn.load_lycoris_state_dict(nn.Sequential(copy.deepcopy(m[0].base)), sd, multiplier=0.7)
        assert torch.equal(back(x), y)
    biased = nn.Sequential(lnn.IA3Linear(nn.Linear(16, 8)))
    with pytest.raises(ValueError, match="scale_bias=True on a layer with a bias has no LyCORIS form"):
        lnn.lycoris_state_dict(biased)
    unbiased = nn.Sequential(lnn.IA3Linear(nn.Linear(16, 8, bias=False)))  # nothing to scale: fine
    assert sorted(lnn.lycoris_state_dict(unbiased)) == ["lycoris_0.on_input", "lycoris_0.weight"]


def _native_models():
    """(name, model with one adapter built here, not loaded) for every adapter and option."""
    L, C = (lambda: nn.Linear(16, 32)), (lambda: nn.Conv2d(8, 16, 3, stride=2, padding=1))  # noqa: E731
    return [
        ("lora", lnn.LoRALinear(L(), 4, 2.0)), ("locon-tucker", lnn.LoRAConv2d(C(), 2, 1.0, use_tucker=True)),
        ("dora-in", lnn.DoRALinear(L(), 4, wd_on_out=False)), ("dora-conv", lnn.DoRAConv2d(C(), 2)),
        ("loha", lnn.LoHaLinear(L(), 3)), ("loha-tucker", lnn.LoHaConv2d(C(), 2, use_tucker=True)),
        ("doha", lnn.DoHaLinear(L(), 3, wd_on_out=False)), ("doha-conv", lnn.DoHaConv2d(C(), 2, use_tucker=True)),
        ("lokr", lnn.LoKrLinear(L(), 2)), ("lokr-conv", lnn.LoKrConv2d(C(), 1)),
        ("lokr-full", lnn.LoKrLinear(L(), 8, 3.0, full_matrix=True)), ("dokr", lnn.DoKrLinear(L(), 2)),
        ("dokr-conv", lnn.DoKrConv2d(C(), 1, wd_on_out=False)),
        ("oft", lnn.OFTLinear(L(), 4, constraint=0.3, rescaled=True)),
        ("oft-conv", lnn.OFTConv2d(C(), 4, rescaled=True)),
        ("boft", lnn.BOFTLinear(L(), 4, 2, constraint=0.2)), ("boft-conv", lnn.BOFTConv2d(C(), 4, 2, rescaled=True)),
        ("ia3", lnn.IA3Linear(L(), scale_bias=False)), ("ia3-conv", lnn.IA3Conv2d(C(), train_on_input=True)),
        ("full", lnn.FullLinear(L())), ("full-conv", lnn.FullConv2d(C())),
        ("glora", lnn.GLoRALinear(L(), 3)), ("glora-conv", lnn.GLoRAConv2d(C(), 2)),
        ("dylora", lnn.DyLoRALinear(L(), 4, block_size=2)), ("dylora-conv", lnn.DyLoRAConv2d(C(), 4, block_size=4)),
        ("norm", lnn.NormAdapter(nn.GroupNorm(4, 16))),
    ]


@pytest.mark.parametrize("name,ad", _native_models(), ids=[n for n, _ in _native_models()])
def test_native_adapters_round_trip(name, ad):
    """Every adapter and option built here: lycoris_state_dict then load_lycoris_state_dict
    rebuilds the same adapter (same outputs, lycoris-lora's tensor shapes), and writes back
    the same tensors."""
    torch.manual_seed(0)
    ad.multiplier = 0.7
    with torch.no_grad():
        for n, p in ad.named_parameters():
            if not n.startswith("base."):
                p.add_(torch.randn(p.shape) * 0.2)
    model = nn.Sequential(ad)
    sd = lnn.lycoris_state_dict(model)
    if isinstance(ad, lnn.LoKrConv2d) and "lycoris_0.lokr_w2_b" in sd:
        assert sd["lycoris_0.lokr_w2_b"].dim() == 2  # lycoris-lora's (r, d·kh·kw)
    if isinstance(ad, (lnn.OFTConv2d, lnn.BOFTConv2d)):
        assert sd["lycoris_0.rescale"].shape == (16, 1, 1, 1) and "lycoris_0.alpha" in sd
    if isinstance(ad, lnn.IA3Conv2d):
        assert sd["lycoris_0.weight"].shape == (1, 8, 1, 1)
    hints = dict(algo="dylora", block_size=ad.block_size) if name.startswith("dylora") else {}
    back = lnn.load_lycoris_state_dict(nn.Sequential(copy.deepcopy(ad.base)), sd, multiplier=0.7, **hints)
    assert type(back[0]) is type(ad)
    x = torch.randn(2, 8, 7, 6) if isinstance(ad.base, nn.Conv2d) else torch.randn(3, 16)
    if isinstance(ad, lnn.NormAdapter):
        x = torch.randn(2, 16, 3, 3)
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x), rtol=1e-6, atol=1e-6)
    again = lnn.lycoris_state_dict(back)
    assert sorted(again) == sorted(sd)
    for k, v in sd.items():
        assert again[k].shape == v.shape and again[k].dtype == v.dtype, k
        torch.testing.assert_close(again[k], v, rtol=1e-6, atol=0, msg=k)


# ---------------------------------------------------------------- new adapters vs their formulas


def _decomposed(W, delta, dora_scale, mult, on_out):
    M = W + delta
    dims = [d for d in range(M.dim()) if d != (0 if on_out else 1)]
    n = torch.linalg.vector_norm(M, dim=dims, keepdim=True) + torch.finfo(torch.float32).eps
    return M * (mult * (dora_scale / n - 1) + 1)


def _formula(ad, x):
    """The adapter's output from its parameters, in plain torch."""
    b = ad.base
    W, conv = b.weight, isinstance(b, nn.Conv2d)
    op = (lambda x, w, bias: F.conv2d(x, w, bias, b.stride, b.padding, b.dilation)) if conv else F.linear  # noqa: E731
    if isinstance(ad, lnn.GLoRALinear):
        A = ad.a1.reshape(ad.a1.shape[0], -1) @ ad.a2.reshape(ad.a2.shape[0], -1)
        dw = torch.einsum("oi...,ij->oj...", W, A) + (ad.b1.reshape(ad.b1.shape[0], -1)
                                                      @ ad.b2.reshape(ad.b2.shape[0], -1)).reshape(W.shape)
        return op(x, W + ad.gamma * dw, b.bias)
    if isinstance(ad, lnn.LoHaLinear):
        if ad._tucker():
            c = lambda t, wa, wb: torch.einsum("pqhw,po,qi->oihw", t, wa, wb)  # noqa: E731
            dw = c(ad.hada_t1, ad.hada_w1_a, ad.hada_w1_b) * c(ad.hada_t2, ad.hada_w2_a, ad.hada_w2_b)
        else:
            dw = ((ad.hada_w1_a @ ad.hada_w1_b) * (ad.hada_w2_a @ ad.hada_w2_b)).reshape(W.shape)
    else:  # LoKr
        f = ad.factors()
        w1 = f["w1"] if "w1" in f else f["w1a"] @ f["w1b"]
        w2 = f["w2"] if "w2" in f else torch.einsum("cr,r...->c...", f["w2a"], f["w2b"])
        dw = torch.einsum("uv,ij...->uivj...", w1, w2).reshape(W.shape)
    return op(x, _decomposed(W, ad.scale * dw, ad.dora_scale, ad.multiplier, ad.wd_on_out), b.bias)


FORMULA_CASES = [
    ("doha", lambda: lnn.DoHaLinear(nn.Linear(19, 24), 3, 2.0, 0.7)),
    ("doha-in", lambda: lnn.DoHaLinear(nn.Linear(19, 24), 3, wd_on_out=False)),
    ("doha-conv-tucker", lambda: lnn.DoHaConv2d(nn.Conv2d(6, 10, 3, padding=1), 2, 1.0, 0.8, use_tucker=True)),
    ("dokr", lambda: lnn.DoKrLinear(nn.Linear(20, 24), 2, 3.0, 0.6)),
    ("dokr-conv-in", lambda: lnn.DoKrConv2d(nn.Conv2d(6, 8, 3, stride=2), 1, wd_on_out=False)),
    ("glora", lambda: lnn.GLoRALinear(nn.Linear(19, 24), 3, 2.0, 0.7)),
    ("glora-conv", lambda: lnn.GLoRAConv2d(nn.Conv2d(6, 10, 3, stride=2, padding=1), 2, 1.0, 0.8)),
]


@pytest.mark.parametrize("make", [c[1] for c in FORMULA_CASES], ids=[c[0] for c in FORMULA_CASES])
def test_new_adapters_vs_formula(make):
    """DoHa / DoKr / GLoRA (linear and conv): outputs and every gradient against plain torch,
    the initial adapter is the base layer, merge/unmerge."""
    torch.manual_seed(0)
    ad = make()
    conv = isinstance(ad.base, nn.Conv2d)
    x = torch.randn(2, ad.base.in_channels, 9, 7) if conv else torch.randn(3, 5, ad.base.in_features)
    with torch.no_grad():
        torch.testing.assert_close(ad(x), ad.base(x), rtol=1e-5, atol=1e-5)
        for n, p in ad.named_parameters():
            if not n.startswith("base."):
                p.add_(torch.randn(p.shape) * 0.2)
    params = [p for p in ad.parameters() if p.requires_grad]
    outs = []
    for fn in (ad, lambda x: _formula(ad, x)):
        x1 = x.clone().requires_grad_(True)
        y = fn(x1)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        outs.append((y,) + torch.autograd.grad(y, [x1] + params, gy))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    W = ad.base.weight.detach().clone()
    with torch.no_grad():
        y = ad(x)
        ad.merge()
        torch.testing.assert_close(ad(x), y, rtol=1e-4, atol=1e-5)
        ad.unmerge()
    assert torch.equal(ad.base.weight, W)
