"""lycoris-lora 4.1's kernel layer (``lycoris.kernels``), served by lycoris_ops.

With ``lycoris_ops`` imported first, ``import lycoris`` loads these files under
lycoris-lora's module names (``lycoris.kernels``, ``lycoris.kernels.select``,
``lycoris.kernels.dispatch``, ``lycoris.kernels.autograd.<family>``), in place of
lycoris-lora's own kernel package: its functional and module layers then run on
``torch.ops.lycoris.*`` as registered by lycoris_ops (see
``lycoris_ops/integrations/lycoris_lora.py`` for the import hook and the report).

The public names and signatures are lycoris-lora 4.1's; the implementations are
lycoris_ops' functional layer. Backend names: ``lycoris_ops`` (our ops, which pick
Triton / TileLang / compile / torch per call inside the op; ``LYCORIS_KERNEL_BACKEND``
and ``lycoris_ops.set_backend`` steer that), ``compile`` and ``torch`` (lycoris-lora's
own eager bodies, compiled or not).
"""
from lycoris_ops.tuner.tune import set_tuning, tuning_enabled

from lycoris_ops.integrations.lycoris_kernels.dispatch import available_backends, fused_backends, resolve_backend

__all__ = [
    "available_backends",
    "fused_backends",
    "resolve_backend",
    "set_tuning",
    "tuning_enabled",
]
