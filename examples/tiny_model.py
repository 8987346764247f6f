"""A tiny model whose adapters run on torch.ops.lycoris.*: LoRA bypass, LoHa
merge (base folded), LoKr bypass, DoRA and diag-OFT (activation bypass).

Used by the demonstration (examples/demo.py) and by the compile/export tests.
"""
import torch
from torch import nn
import torch.nn.functional as F

import lycoris_ops  # noqa: F401  registers torch.ops.lycoris.*

lycoris = torch.ops.lycoris


class TinyAdapted(nn.Module):
    """Three adapted linear layers of width D = a*c = b*d = K*S."""

    def __init__(self, dim: int = 24, rank: int = 4, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def p(*shape, scale=0.2):
            return nn.Parameter(torch.randn(*shape, generator=g) * scale)

        self.w1, self.w2, self.w3 = p(dim, dim), p(dim, dim), p(dim, dim)
        for w in (self.w1, self.w2, self.w3):
            w.requires_grad_(False)  # frozen base weights
        self.lora_up, self.lora_down = p(dim, rank), p(rank, dim)              # LoRA on w1 (bypass)
        # LoHa on w2 (four named factors: torch 2.11's Dynamo cannot unpack a ParameterList)
        self.hada_a1, self.hada_b1, self.hada_a2, self.hada_b2 = p(dim, rank), p(rank, dim), p(dim, rank), p(rank, dim)
        self.kron_w1, self.kron_w2 = p(4, 4), p(dim // 4, dim // 4)          # LoKr on the w2 output
        self.dora_scale = nn.Parameter(self.w3.norm(dim=1).detach().clone())  # DoRA on w3
        self.oft_blocks = p(4, dim // 4, dim // 4, scale=0.05)                # diag-OFT on the output

    def forward(self, x):
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        # LoRA: y = x·W1ᵀ + 0.5·(x·downᵀ)·upᵀ, base folded into the op's epilogue
        h = lycoris.lora_bypass_fwd(xf, self.lora_up, self.lora_down, 0.5, F.linear(xf, self.w1))
        # LoHa: W2 + 0.3·(a1·b1)⊙(a2·b2), merged with the base folded
        w2 = lycoris.lora_merge_fwd(self.hada_a1, self.hada_b1, self.hada_a2, self.hada_b2, self.w2, 0.3, "hada")
        h = F.linear(torch.tanh(h), w2)
        # LoKr: + 0.7·x·kron(w1, w2)ᵀ without building the Kronecker product
        h = lycoris.lokr_bypass_fwd(h, self.kron_w1, self.kron_w2, 0.7, h)
        # DoRA: rescale the rows of W3 to the learned magnitude
        w3, _norms = lycoris.dora_fwd(self.w3, self.dora_scale, 1.0, 0)
        h = F.linear(h, w3)
        # diag-OFT on activations: + (Rᵀ − I)·h per channel block
        h = h + lycoris.oft_fwd(self.oft_blocks, h, None, 1.0, True, False)
        return h.reshape(shape)
