"""lycoris_ops.explain / patch_peft's report: per adapted layer, the lycoris op it runs on
(checked against the ops a forward and backward actually call) or why it falls back, for
the layer's current state; one warning per fallback reason."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import lycoris_ops
from lycoris_ops import nn as lnn
from lycoris_ops import report as report_mod
from lycoris_ops.report import LayerRoute, Report, explain


class _OpRecorder(TorchDispatchMode):
    """The lycoris ops (short names) called inside the context, forward and backward, in order."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "lycoris" in str(func):
            self.calls.append(str(func).split(".")[1])
        return func(*args, **(kwargs or {}))


def _ops_of(m, x):
    """The lycoris ops one forward + backward of ``m`` calls."""
    with _OpRecorder() as rec:
        m(x).float().square().sum().backward()
    return set(rec.calls)


def _forward_ops(m, x, names):
    """{name: the lycoris ops the forward of ``m``'s submodule ``name`` calls, in order} over one
    forward of ``m``, and the set of the ops the forward and backward of ``m`` call."""
    per_layer, handles = {}, []
    with _OpRecorder() as rec:
        for name in names:
            layer = m.get_submodule(name)
            handles.append(layer.register_forward_pre_hook(lambda mod, args, n=name: per_layer.__setitem__(
                n, len(rec.calls))))
            handles.append(layer.register_forward_hook(lambda mod, args, out, n=name: per_layer.__setitem__(
                n, rec.calls[per_layer[n]:])))
        try:
            m(x).float().square().sum().backward()
        finally:
            for h in handles:
                h.remove()
    return per_layer, set(rec.calls)


def _perturb(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """``warn_fallback``'s once-per-reason memory, empty for this test."""
    monkeypatch.setattr(report_mod, "_warned", set())


def _fallback_warnings(record):
    return [str(w.message).split(": ", 2)[-1] for w in record
            if issubclass(w.category, RuntimeWarning) and "lycoris_ops" in str(w.message)]


def test_explain_exported_and_report_prints():
    assert lycoris_ops.explain is explain and "explain" in lycoris_ops.__all__
    assert str(explain(nn.Sequential(nn.Linear(3, 4)))) == "no adapted layers"
    r = Report([LayerRoute("a.q", "peft.lora", "lycoris.lora_bypass_fwd"),
                LayerRoute("b", "peft.oft", None, "why")])
    assert str(r).splitlines() == ["a.q  peft.lora  lycoris.lora_bypass_fwd",
                                   "b    peft.oft   fallback: why",
                                   "1 of 2 layers on lycoris ops"]
    assert r.fallbacks() == [r[1]] and isinstance(r.fallbacks(), Report)


# ----------------------------------------------------------------------- lycoris_ops.nn

#: every AdapterModule class lycoris_ops.nn exports: each is checked in its default
#: configuration, so a new class is checked without being listed here
_NN_CLASSES = sorted((c for c in (getattr(lnn, n) for n in lnn.__all__)
                      if isinstance(c, type) and issubclass(c, lnn.AdapterModule) and c is not lnn.AdapterModule),
                     key=lambda c: c.__name__)

#: class name -> the other configurations whose forward runs another op (or none)
_NN_VARIANTS = {
    "LoHaConv2d": [{"use_tucker": True}],
    "LoKrLinear": [{"rank": 1, "decompose_both": True, "factor": 2}],
    "LoKrConv2d": [{"rank": 1}],
    "DoRALinear": [{"wd_on_out": False}],
    "DoRAConv2d": [{"wd_on_out": False}, {"wd_on_out": False, "use_tucker": True}],
    "DoHaLinear": [{"wd_on_out": False}],
    "DoHaConv2d": [{"wd_on_out": False}, {"wd_on_out": False, "use_tucker": True}],
    "DoKrLinear": [{"wd_on_out": False, "rank": 1, "decompose_both": True, "factor": 2}],
    "DoKrConv2d": [{"wd_on_out": False}, {"wd_on_out": False, "rank": 1}],
    "DyLoRAConv2d": [{"rank": 4, "block_size": 2}],
    "OFTLinear": [{"multiplier": 0.5}],
    "OFTConv2d": [{"multiplier": 0.5}],
    "BOFTLinear": [{"block_size": 2, "n_butterfly": 2}],
    "IA3Linear": [{"train_on_input": True}, {"scale_bias": False}],
    "IA3Conv2d": [{"train_on_input": True}],
}
_NN_CASES = [(c, {}) for c in _NN_CLASSES] + [(c, kw) for c in _NN_CLASSES for kw in _NN_VARIANTS.get(c.__name__, [])]


def _nn_model(cls, kw):
    """A small model with ``cls`` (built with ``kw``) on every layer of its first base type."""
    torch.manual_seed(0)
    if issubclass(cls.bases[0], nn.Conv2d):
        m, x = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 8, 1)), torch.randn(2, 4, 5, 5)
    else:
        m, x = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8)), torch.randn(3, 6)
    for name, mod in list(m.named_children()):
        if type(mod) is cls.bases[0]:
            setattr(m, name, cls(mod, **kw))
    return m, x


def test_every_nn_adapter_class_is_checked():
    """The enumeration sees the classes (a broken one would make the check below vacuous)."""
    names = {c.__name__ for c in _NN_CLASSES}
    assert {"LoRALinear", "DoHaConv2d", "DoKrLinear", "GLoRAConv2d", "DyLoRALinear", "NormAdapter"} <= names
    assert set(_NN_VARIANTS) <= names


@pytest.mark.parametrize("cls,kw", _NN_CASES,
                         ids=[f"{c.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}"
                              for c, kw in _NN_CASES])
def test_explain_nn_adapters(cls, kw):
    """Each nn adapter's row names the op its forward calls last (the one making its output, or
    its weight); a fallback row's layer calls no lycoris op, forward or backward; a merged
    adapter is reported as merged."""
    m, x = _nn_model(cls, kw)
    _perturb(m)
    rows = explain(m)
    assert [r.name for r in rows] == [n for n, _ in lnn.adapters(m)] and rows
    for row in rows:
        assert row.adapter == "lycoris_ops." + cls.__name__
        assert row.fused or not row.reason.startswith("no route"), row
    per_layer, ops = _forward_ops(m, x, [r.name for r in rows])
    for row in rows:
        if row.fused:
            assert per_layer[row.name][-1:] == [row.op.split(".")[1]], (row, per_layer[row.name])
        else:
            assert not ops, (row, ops)
    lnn.merge_adapters(m)
    assert {r.reason for r in explain(m)} == {"merged into the base weight"}


def test_explain_lokr_conv_structured_route():
    """A LoKr conv whose w2 is at least STRUCTURED_CONV_MIN_C wide runs the structured conv chain,
    which calls no lycoris op: its row is the fallback with the reason (a narrow one, above,
    names the merge op)."""
    torch.manual_seed(0)
    m = nn.Sequential(lnn.LoKrConv2d(nn.Conv2d(256, 256, 3, padding=1), factor=4))  # w2 64x64
    (row,) = explain(m)
    assert not row.fused and row.reason.startswith("LoKr conv: eager grouped conv chain"), row
    _perturb(m)
    _, ops = _forward_ops(m, torch.randn(1, 256, 4, 4), [row.name])
    assert not ops, ops


def test_explain_nn_dora_trainable_base():
    """DoRALinear with a trainable base weight takes the merged path (dora_fwd)."""
    m, x = _nn_model(lnn.DoRALinear, {"rank": 2})
    _perturb(m)
    for _, a in lnn.adapters(m):
        a.base.weight.requires_grad_(True)
    rows = explain(m)
    assert {r.op for r in rows} == {"lycoris.dora_fwd"}
    per_layer, _ = _forward_ops(m, x, [r.name for r in rows])
    assert all(per_layer[r.name][-1] == "dora_fwd" for r in rows), per_layer


# --------------------------------------------------------------------------------- PEFT

peft = pytest.importorskip("peft")
from lycoris_ops.integrations.peft import patch_peft, unpatch_peft  # noqa: E402


def _lin3():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 8))


def _peft(cfg, model=None):
    m = peft.get_peft_model(model if model is not None else _lin3(), cfg)
    _perturb(m)
    return m


def _names(m):
    return [n for n, mod in m.named_modules() if isinstance(mod, peft.tuners.tuners_utils.BaseTunerLayer)]


def _peft_cases():
    from peft import BOFTConfig, IA3Config, LoHaConfig, LoKrConfig, LoraConfig, OFTConfig
    t = ["0", "2", "4"]
    return {  # name: (config, adapter, op)
        "lora": (LoraConfig(r=2, target_modules=t), "peft.lora", "lycoris.lora_bypass_fwd"),
        "dora": (LoraConfig(r=2, target_modules=t, use_dora=True), "peft.lora", "lycoris.lora_bypass_fwd"),
        "loha": (LoHaConfig(r=2, target_modules=t), "peft.loha", "lycoris.loha_bypass_fwd"),
        "lokr": (LoKrConfig(r=2, target_modules=t), "peft.lokr", "lycoris.lokr_bypass_fwd"),
        "ia3": (IA3Config(target_modules=t, feedforward_modules=["2"]), "peft.ia3", "lycoris.ia3_fwd"),
        "oft": (OFTConfig(r=2, oft_block_size=0, use_cayley_neumann=False, target_modules=t), "peft.oft",
                "lycoris.oft_fwd"),
        "boft": (BOFTConfig(boft_block_size=4, target_modules=t), "peft.boft", "lycoris.oft_fwd"),
    }


@pytest.mark.parametrize("name", list(_peft_cases()))
def test_patch_peft_report(name):
    """patch_peft's report: every PEFT layer, on the op its forward calls; explain agrees."""
    cfg, adapter, op = _peft_cases()[name]
    m = _peft(copy.deepcopy(cfg))
    rows = patch_peft(m)
    assert [r.name for r in rows] == _names(m)
    assert {(r.adapter, r.op, r.reason) for r in rows} == {(adapter, op, None)}
    assert explain(m) == rows
    assert op.split(".")[1] in _ops_of(m, torch.randn(3, 12))


def test_explain_follows_the_layer_state(fresh_warnings):
    """Rows follow disable_adapter / merge / the active adapter / the training flag."""
    from peft import LoraConfig, OFTConfig
    m = _peft(LoraConfig(r=2, target_modules=["0", "2"]))
    patch_peft(m)
    fused = explain(m)
    assert all(r.fused for r in fused)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with m.disable_adapter():
            assert {r.reason for r in explain(m)} == {"adapters disabled (disable_adapter)"}
            m(torch.randn(2, 12))
        m.merge_adapter()
        assert {r.reason for r in explain(m)} == {"adapter merged into the base weight"}
        m(torch.randn(2, 12))
        m.unmerge_adapter()
    assert explain(m) == fused
    assert not _fallback_warnings(record)  # the base layer alone runs: nothing to warn about

    drop = OFTConfig(r=2, oft_block_size=0, use_cayley_neumann=False, module_dropout=0.5, target_modules=["0"])
    m = _peft(drop)
    patch_peft(m)  # in training: OFT's random block masks stay on PEFT's forward
    assert [r.reason for r in explain(m)] == ["OFT module dropout in training"]
    m.eval()
    assert [r.op for r in explain(m)] == ["lycoris.oft_fwd"]


def test_explain_unpatched_and_added_layers():
    """Layers patch_peft has not seen (not called yet, or created by an adapter added after
    it) are rows with the advice to call it (again)."""
    from peft import LoraConfig
    m = _peft(LoraConfig(r=2, target_modules=["0", "2"]))
    hint = "not patched: call patch_peft(model) (again, for layers added after it)"
    assert [r.reason for r in explain(m)] == [hint, hint]
    patch_peft(m)
    m.add_adapter("late", LoraConfig(r=2, target_modules=["4"]))
    rows = {r.name.rsplit(".", 1)[-1]: r for r in explain(m)}
    assert rows["0"].fused and rows["2"].fused and rows["4"].reason == hint
    m.base_model.set_adapter(["default", "late"])
    rows = {r.name.rsplit(".", 1)[-1]: r for r in patch_peft(m)}
    assert all(r.fused for r in rows.values()), rows
    unpatch_peft(m)
    assert {r.reason for r in explain(m)} == {hint}


def test_unsupported_peft_layer_type_is_a_row():
    from peft import LoraConfig
    torch.manual_seed(0)
    base = nn.Sequential(nn.Embedding(10, 12), nn.Linear(12, 4))
    m = _peft(LoraConfig(r=2, target_modules=["0", "1"]), base)
    with pytest.warns(RuntimeWarning, match="not supported by patch_peft: Embedding"):
        rows = patch_peft(m)
    assert [(r.op, r.reason) for r in rows] == [(None, "not supported by patch_peft: Embedding"),
                                                ("lycoris.lora_bypass_fwd", None)]


def test_patch_warns_once_per_reason(fresh_warnings):
    """Two layers, one reason (PEFT's default Cayley-Neumann OFT): one warning at patch time,
    none at call time; the rows say why."""
    from peft import OFTConfig
    m = _peft(OFTConfig(r=2, oft_block_size=0, target_modules=["0", "2", "4"]))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rows = patch_peft(m)
        m(torch.randn(2, 12))
        patch_peft(m)
    reason = "OFT with the Cayley-Neumann series (use_cayley_neumann=True, PEFT's default)"
    assert [r.reason for r in rows] == [reason] * 3
    assert _fallback_warnings(record) == [reason]


def test_mixed_adapter_batch_falls_back_and_warns_once(fresh_warnings):
    """``adapter_names=`` (a call-time condition): PEFT's own forward, PEFT's numbers, one warning."""
    from peft import LoraConfig
    m = _peft(LoraConfig(r=2, target_modules=["0", "2"]))
    m.add_adapter("other", LoraConfig(r=2, target_modules=["0", "2"]))
    _perturb(m, seed=2)
    m.eval()
    x = torch.randn(4, 12)
    names = ["default", "other", "__base__", "default"]
    with torch.no_grad():
        want = m(x, adapter_names=names)
        patch_peft(m)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = [m(x, adapter_names=names) for _ in range(2)]
            plain = m(x)
    torch.testing.assert_close(got[0], want)
    torch.testing.assert_close(got[1], want)
    assert _fallback_warnings(record) == ["mixed-adapter batch (adapter_names=)"]
    assert not torch.allclose(plain, want)
    assert all(r.fused for r in explain(m))
