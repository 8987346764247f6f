"""Run in a subprocess with lycoris-lora importable (never next to lycoris_ops: both
register the ``lycoris`` operator namespace). Builds a small model, wraps it in a
LyCORIS network per algorithm, gives every adapter tensor random values, and saves the
base weights, the network's state dict, an input and the network's output:

    python tests/peer_networks.py OUT.pt

Used by tests/test_lycoris_peer.py (skipped when lycoris-lora is not available).
"""
import sys

import torch
import torch.nn as nn

#: name -> create_lycoris keyword arguments
CONFIGS = {
    "locon": dict(algo="locon"),
    "locon-tucker": dict(algo="locon", use_tucker=True),
    "dora": dict(algo="locon", dora_wd=True),
    "loha": dict(algo="loha"),
    "loha-tucker": dict(algo="loha", use_tucker=True),
    "lokr": dict(algo="lokr", factor=4),
    "lokr-full": dict(algo="lokr", factor=4, full_matrix=True),
    "diag-oft": dict(algo="diag-oft", linear_dim=4, conv_dim=4),
    "boft": dict(algo="boft", linear_dim=4, conv_dim=4),
    "ia3": dict(algo="ia3"),
    "full": dict(algo="full"),
}


class Model(nn.Module):
    """A conv, two norms and two linears: every layer type the loader adapts."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)
        self.fc1 = nn.Linear(16, 32)
        self.ln = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        h = self.norm(self.conv(x)).mean((2, 3))
        return self.fc2(self.ln(self.fc1(h)))


def main(path):
    from lycoris import LycorisNetwork, create_lycoris  # the peer: only in this subprocess

    torch.manual_seed(0)
    x = torch.randn(3, 8, 6, 5)
    out = {"x": x, "nets": {}}
    for name, kw in CONFIGS.items():
        torch.manual_seed(1)
        model = Model()
        base = {k: v.clone() for k, v in model.state_dict().items()}
        LycorisNetwork.apply_preset({"target_module": ["Linear", "Conv2d", "LayerNorm", "GroupNorm"]})
        kw = dict(kw)
        linear_dim = kw.pop("linear_dim", 4)
        net = create_lycoris(model, 0.8, linear_dim=linear_dim, linear_alpha=2, conv_dim=kw.pop("conv_dim", 4),
                             conv_alpha=2, train_norm=True, **kw)
        net.apply_to()
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.shape and p.numel() == 1 else 0.0))
        xg = x.clone().requires_grad_(True)
        y = model(xg)
        y.square().sum().backward()  # gradients of the network's tensors and of the input
        sd = net.state_dict(keep_vars=True)
        # the parameters saved under their own name (Full saves a derived ``diff`` instead)
        grads = {n: p.grad.clone() for n, p in net.named_parameters() if n in sd and p.grad is not None}
        out["nets"][name] = {"base": base, "sd": {k: v.detach().clone() for k, v in sd.items()}, "y": y.detach(),
                             "grads": grads, "gx": xg.grad.clone(), "multiplier": 0.8}
    torch.save(out, path)


if __name__ == "__main__":
    main(sys.argv[1])
