"""lycoris-lora's own results, produced in a process without lycoris_ops (both packages
register the ``lycoris`` operator namespace; with lycoris_ops loaded first, lycoris-lora
runs on our ops instead: the bridge). Two tables, one script:

    python tests/peer_networks.py nets OUT.pt           # CONFIGS: for test_lycoris_peer
    python tests/peer_networks.py bridge OUT.pt [--device cuda] [CASE ...]  # CASES: for test_lycoris_bridge

``nets``: per algorithm, a small model's base weights, a LyCORIS network's state dict with
random adapter tensors, an input and the network's output and gradients (fp32), which
test_lycoris_peer loads into lycoris_ops' own ``nn`` adapters.

``bridge``: per case of ``CASES`` and per dtype (fp32, bf16), the base weights, the
network's parameters (random), an input, the output, the input's gradient and every
parameter's gradient (or the error lycoris-lora raised), plus, for ``TRAIN_CASES``, the
loss curve of a short Adam run. lycoris-lora runs with its torch backend
(``LYCORIS_KERNEL_BACKEND=torch``; on CPU it has no other). test_lycoris_bridge rebuilds
each network from the same tensors in a process where lycoris_ops was imported first and
compares. ``build_network`` and ``run_case`` are shared by both sides, so the two runs
differ only in the kernel layer underneath.
"""
import os
import random
import sys

import torch
import torch.nn as nn

#: name -> create_lycoris keyword arguments (the ``nets`` table)
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


def nets_main(path):
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


# --------------------------------------------------------------------------- bridge


class BridgeModel(nn.Module):
    """A 3×3 conv and a GroupNorm on images, then two linears and a LayerNorm on the
    pixels as tokens (3-D activations): every layer type lycoris-lora adapts."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)
        self.fc1 = nn.Linear(16, 64)
        self.ln = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x):
        h = self.norm(self.conv(x)).flatten(2).transpose(1, 2)  # (N, H·W, 16)
        return self.fc2(self.ln(self.fc1(h)))


_LOKR = dict(algo="lokr", factor=4, linear_dim=2, conv_dim=1)  # a factored w2 on every layer

#: name -> create_lycoris keywords, plus ``multiplier`` (default 0.8) and ``train`` (forward in
#: training mode). Every case sets train_norm (Norms on the GroupNorm and the LayerNorm).
CASES = {
    "locon": dict(algo="locon"),
    "locon-tucker": dict(algo="locon", use_tucker=True),
    "locon-scalar": dict(algo="locon", use_scalar=True),
    "locon-rank-dropout": dict(algo="locon", rank_dropout=0.5, train=True),
    "locon-bypass": dict(algo="locon", bypass_mode=True),
    "locon-bypass-rank-dropout": dict(algo="locon", bypass_mode=True, rank_dropout=0.5, train=True),
    "loha": dict(algo="loha"),
    "loha-tucker": dict(algo="loha", use_tucker=True),
    "loha-bypass": dict(algo="loha", bypass_mode=True),
    "lokr": dict(_LOKR),
    "lokr-whole": dict(_LOKR, full_matrix=True),
    "lokr-decompose-both": dict(_LOKR, factor=8, decompose_both=True),
    "lokr-unbalanced": dict(_LOKR, unbalanced_factorization=True),
    "lokr-tucker": dict(_LOKR, use_tucker=True),
    "lokr-bypass": dict(_LOKR, bypass_mode=True),
    "dora-lora": dict(algo="locon", dora_wd=True),
    "dora-lora-in": dict(algo="locon", dora_wd=True, wd_on_output=False),
    "dora-loha": dict(algo="loha", dora_wd=True),
    "dora-loha-in": dict(algo="loha", dora_wd=True, wd_on_output=False),
    "dora-lokr": dict(_LOKR, dora_wd=True),
    "dora-lokr-in": dict(_LOKR, dora_wd=True, wd_on_output=False),
    "full": dict(algo="full"),
    "diag-oft": dict(algo="diag-oft", multiplier=1.0),
    "diag-oft-rescaled": dict(algo="diag-oft", rescaled=True, multiplier=1.0),
    "diag-oft-constraint": dict(algo="diag-oft", constraint=1e-3, multiplier=1.0),
    "diag-oft-multiplier": dict(algo="diag-oft"),
    "diag-oft-bypass": dict(algo="diag-oft", bypass_mode=True, multiplier=1.0),
    "boft": dict(algo="boft"),
    "boft-rescaled": dict(algo="boft", rescaled=True),
    "boft-constraint": dict(algo="boft", constraint=1e-3),
    "boft-bypass": dict(algo="boft", bypass_mode=True),
    "ia3": dict(algo="ia3"),
    "ia3-bypass": dict(algo="ia3", bypass_mode=True),
    "glora": dict(algo="glora"),
    "glora-bypass": dict(algo="glora", bypass_mode=True),
    "dylora": dict(algo="dylora", block_size=2),
    "dylora-bypass": dict(algo="dylora", block_size=2, bypass_mode=True),
}
#: the cases whose short training run (fp32, Adam) is compared step by step
TRAIN_CASES = ("locon", "loha", "lokr", "dora-lora", "diag-oft", "boft", "ia3", "glora")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRAIN_STEPS = 20


def make_input(dtype=torch.float32):
    return torch.randn(2, 8, 5, 4, generator=torch.Generator().manual_seed(0)).to(dtype)


def base_weights():
    torch.manual_seed(1)
    return BridgeModel().state_dict()


def build_network(name, base=None, params=None):
    """(model, network) for case ``name``. The peer (no arguments) draws the model and
    random network tensors from fixed seeds; the other side passes the peer's tensors."""
    from lycoris import create_lycoris

    case = dict(CASES[name])
    multiplier = case.pop("multiplier", 0.8)
    case.pop("train", None)
    linear_dim, conv_dim = case.pop("linear_dim", 4), case.pop("conv_dim", 4)
    model = BridgeModel()
    model.load_state_dict(base_weights() if base is None else base)
    net = create_lycoris(model, multiplier, linear_dim=linear_dim, linear_alpha=2, conv_dim=conv_dim,
                         conv_alpha=2, train_norm=True, warn_on_unmatched=False, **case)
    net.apply_to()
    with torch.no_grad():
        if params is None:
            g = torch.Generator().manual_seed(2)
            for p in net.parameters():  # every tensor moves off its init (zeros, ones) by ~0.1
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        else:
            for n, p in net.named_parameters():
                p.copy_(params[n])
    return model, net


def run_case(model, net, name, dtype, device="cpu"):
    """Forward and backward at ``dtype`` on ``device``: (output, input grad, {param: grad}),
    on the CPU, or raises."""
    model.to(device, dtype)
    net.to(device, dtype)
    train = CASES[name].get("train", False)
    model.train(train)
    net.train(train)
    x = make_input(dtype).to(device).requires_grad_(True)
    torch.manual_seed(3)  # rank dropout masks, DyLoRA's rank: the same draws on both sides
    random.seed(3)
    y = model(x)
    # a fixed random functional of y: a generic gradient (‖y‖², say, is blind to a rotation's blocks)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).to(device)
    (y.float() * probe).mean().backward()
    grads = {n: p.grad.detach().cpu() for n, p in net.named_parameters() if p.grad is not None}
    return y.detach().cpu(), x.grad.detach().cpu(), grads


def train_curve(model, net, name, steps=TRAIN_STEPS):
    """Loss per step of ``steps`` Adam steps on the network's parameters (fp32)."""
    x = make_input()
    target = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(4))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    torch.manual_seed(5)
    random.seed(5)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def bridge_main(path, names, device="cpu"):
    os.environ.setdefault("LYCORIS_KERNEL_BACKEND", "torch")
    sys.modules.setdefault("peft", None)  # optional for lycoris-lora, and seconds to import
    import lycoris  # noqa: F401  (the peer: only in this subprocess)

    out = {"cases": {}, "train": {}}
    for name in names:
        model, net = build_network(name)
        rec = {"base": base_weights(), "params": {n: p.detach().clone() for n, p in net.named_parameters()}}
        for dt, dtype in DTYPES.items():
            model, net = build_network(name, rec["base"], rec["params"])
            try:
                y, gx, grads = run_case(model, net, name, dtype, device)
                rec[dt] = {"y": y, "gx": gx, "grads": grads}
            except Exception as exc:  # the bridge must then raise the same
                rec[dt] = {"error": f"{type(exc).__name__}: {exc}"}
        out["cases"][name] = rec
        if name in TRAIN_CASES and device == "cpu":
            out["train"][name] = train_curve(*build_network(name, rec["base"], rec["params"]), name)
    torch.save(out, path)


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "nets":
        nets_main(path)
    elif mode == "bridge":
        args = sys.argv[3:]
        device = "cpu"
        if args[:1] == ["--device"]:
            device, args = args[1], args[2:]
        bridge_main(path, args or list(CASES), device)
    else:
        sys.exit(f"usage: {sys.argv[0]} nets OUT.pt | bridge OUT.pt [--device DEV] [CASE ...]")
