"""Adapter modules on ``torch.ops.lycoris.*`` for users without LyCORIS or PEFT.

Each module wraps an existing ``nn.Linear`` (or ``nn.Conv2d``) as ``self.base``,
freezes its parameters and adds the adapter's trainable parameters, initialised
the LyCORIS way so that the initial ΔW is 0 (the "up" side is zero):

=================  ==========================================================  ================
module             forward (``s = alpha/rank·multiplier``)                     functional path
=================  ==========================================================  ================
``LoRALinear``     ``base(x) + s·(x·downᵀ)·upᵀ``                               ``locon.bypass``
``LoRAConv2d``     ``base(x) + s·conv1x1(conv(x, down), up)``                  ``locon.bypass`` (eager chain)
``LoHaLinear``     ``base(x) + s·x·((w1a·w1b)⊙(w2a·w2b))ᵀ``                   ``loha.bypass``
``LoHaConv2d``     ``base(x) + conv(x, s·ΔW)`` (ΔW via the merge op)           ``loha.bypass``
``LoKrLinear``     ``base(x) + s·x·kron(w1, w2)ᵀ`` (w2 = w2a·w2b if factored)  ``lokr.lokr_bypass``
``LoKrConv2d``     ``base(x) + conv(x, s·kron(w1, w2))`` (ΔW: narrow w2 only)  ``lokr.lokr_bypass_conv``
``DoRALinear``     ``F.linear(x, wd(W + α/r·up·down), b)`` (m only in wd)       ``locon.bypass`` +
                                                                               ``dora.lowrank_norm_terms``
``DoRAConv2d``     ``conv(x, wd(W + α/r·ΔW), b)`` (W' built each call)       ``dora.weight_decompose``
``DoHa*, DoKr*``   LoHa / LoKr with ``dora_wd``: ``op(x, wd(W + α/r·ΔW), b)``   merge op + ``dora.weight_decompose``
``GLoRALinear``    ``base(x + s·(x·a2ᵀ)·a1ᵀ) + s·(x·b2ᵀ)·b1ᵀ``                  ``locon.bypass`` twice
                   (ΔW = s·(W·a1·a2 + b1·b2); ``GLoRAConv2d``: 1×1 conv chains)
``DyLoRALinear``   ``LoRALinear`` with s = alpha/(rank/block_size)·multiplier  ``locon.bypass``
``OFTLinear``      ``diag(ρ)·Rᵀ·(x·Wᵀ) + b`` (diag-OFT on the output channels)  ``diag_oft.bypass``
``BOFTLinear``     ``B·(x·Wᵀ) + b`` (butterfly of Cayley rotations)            ``boft.bypass``
``IA3Linear``      ``base(x)⊙(1 + m·w)`` (or ``base(x⊙(1 + m·w))`` on input)    ``ia3.ia3_scale``
                   (LyCORIS's, ``scale_bias=False``: ``(x·Wᵀ)⊙(1 + m·w) + b``)
``FullLinear``     ``F.linear(x, W + m·diff, b + m·diff_b)``                   ``full.scaled_add``
``*Conv2d``        OFT / BOFT / IA3 / Full on a conv: the conv with the merged  the merge ops
                   (O, I, kh, kw) weight, built each call
``NormAdapter``    ``layer_norm / group_norm`` with ``W + m·w_norm``,           ``full.norms_merge``
                   ``b + m·b_norm`` (wraps ``nn.LayerNorm`` / ``nn.GroupNorm``)
=================  ==========================================================  ================

(OFT/BOFT rotate the bias-free output and add the bias after, so that the bypass
and the merged weight ``R·W`` agree; IA3 on the output scales the bias too, and
its merge scales the bias the same way.)

``merge()`` folds the adapter into ``base.weight`` (and bias) with the merge ops
(``lora_merge_fwd``, ``lokr_*merge_fwd``, ``dora_fwd``, ``oft_fwd``, ``boft_fwd``,
``ia3_fwd``, ``add_scaled``) so the model runs as a plain layer (the inference
path before export); ``unmerge()`` takes it back out: additive adapters
(LoRA/LoHa/LoKr/DyLoRA/Full/Norm) re-run the merge op with −γ, the others (DoRA and
``dora_wd``, GLoRA, OFT, BOFT, IA3, whose merge is not invertible from the merged weight
alone) restore a copy
of the original weight kept at merge time (not in the state dict). While merged,
``forward`` is ``base(x)``. A state dict saved while merged holds the merged
weight; ``merged`` is not saved. Each module's ``route()`` names the op its forward
runs now, or why it runs none (``lycoris_ops.explain(model)`` lists them).

Helpers: :func:`add_adapters` (replace matching submodules in place),
:func:`merge_adapters`, :func:`unmerge_adapters`, :func:`adapters`,
:func:`mark_only_adapters_trainable`, :func:`remove_adapters`,
:func:`load_lycoris_state_dict` (build the adapters of a LyCORIS network from its state
dict or file: every algorithm and option lycoris-lora saves, or a clear error) and
:func:`lycoris_state_dict` (save them back in LyCORIS's format).

Parameter names follow LyCORIS (``lora_up``/``lora_down``/``alpha``,
``hada_w1_a`` ..., ``lokr_w1`` ..., ``oft_blocks``/``rescale``, ``dora_scale``, ``w_norm``/``b_norm``)
but are plain ``nn.Parameter``s (``lora_down`` instead of ``lora_down.weight``).
The base layer's parameters appear as ``<name>.base.weight`` / ``.base.bias``.
``alpha`` is a buffer; loading a state dict updates the Python scale from it
(the forward never reads a tensor to get its scale: no host sync, CUDA-graph safe).
No dropout / rank dropout (use LyCORIS itself for those).

The modules by role: ``base`` (AdapterModule, the shared parts), ``lora`` (LoRA/LoCon,
DyLoRA, GLoRA), ``loha``, ``lokr``, ``dora`` (DoRA, DoHa, DoKr), ``oft`` (diag-OFT, BOFT),
``ia3``, ``full`` (Full, Norms), ``model`` (the whole-model helpers), ``lycoris_io``
(LyCORIS state dicts and files).
"""
from lycoris_ops.nn.base import AdapterModule, factorization
from lycoris_ops.nn.dora import DoHaConv2d, DoHaLinear, DoKrConv2d, DoKrLinear, DoRAConv2d, DoRALinear
from lycoris_ops.nn.full import FullConv2d, FullLinear, NormAdapter
from lycoris_ops.nn.ia3 import IA3Conv2d, IA3Linear
from lycoris_ops.nn.loha import LoHaConv2d, LoHaLinear
from lycoris_ops.nn.lokr import LoKrConv2d, LoKrLinear
from lycoris_ops.nn.lora import DyLoRAConv2d, DyLoRALinear, GLoRAConv2d, GLoRALinear, LoRAConv2d, LoRALinear
from lycoris_ops.nn.lycoris_io import LycorisLoadResult, load_lycoris_state_dict, lycoris_state_dict
from lycoris_ops.nn.model import (ADAPTERS, adapters, add_adapters, mark_only_adapters_trainable, merge_adapters,
                                  remove_adapters, unmerge_adapters)
from lycoris_ops.nn.oft import BOFTConv2d, BOFTLinear, OFTConv2d, OFTLinear

__all__ = [
    "AdapterModule", "LoRALinear", "LoRAConv2d", "LoHaLinear", "LoHaConv2d", "LoKrLinear", "LoKrConv2d",
    "DoRALinear", "DoRAConv2d", "DoHaLinear", "DoHaConv2d", "DoKrLinear", "DoKrConv2d",
    "GLoRALinear", "GLoRAConv2d", "DyLoRALinear", "DyLoRAConv2d",
    "OFTLinear", "BOFTLinear", "IA3Linear", "FullLinear", "OFTConv2d", "BOFTConv2d", "IA3Conv2d", "FullConv2d",
    "NormAdapter", "ADAPTERS", "add_adapters", "adapters",
    "merge_adapters", "unmerge_adapters", "remove_adapters", "mark_only_adapters_trainable",
    "factorization", "load_lycoris_state_dict", "lycoris_state_dict", "LycorisLoadResult",
]
