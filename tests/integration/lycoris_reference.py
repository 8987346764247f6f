"""lycoris-lora's side of tests/test_lycoris_files.py. Runs in its own process with only
lycoris-lora imported (it registers a ``torch.ops.lycoris`` namespace of its own, so it
never shares a process with lycoris_ops):

    python tests/lycoris_reference.py make DIR             # one LyCORIS network per case
    python tests/lycoris_reference.py check DIR CASE ...   # load DIR/<case>.ours.safetensors back

``make`` builds each case's network on a small model with ``lycoris.create_lycoris``, gives
every adapter tensor random values, runs it forward and backward, and saves per case the
network file (``<case>.safetensors``, written by the network's ``save_weights``) and
``<case>.pt``: the base weights, the output, the input's gradient and the saved tensors'
gradients (see ``_saved_grads``). ``check`` rebuilds each named case's network, loads
``<case>.ours.safetensors`` (written by lycoris_ops' ``lycoris_state_dict``) with
``load_weights`` and saves its output to ``<case>.check.pt``.

Importing this module imports torch only (the test reads CASES and Model from it).
"""
import json
import os
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

#: case -> create_lycoris arguments (dims default to 4, alphas to 2, multiplier to 0.8);
#: "map" is the preset's module_algo_map (options create_lycoris does not forward)
CASES = {
    "locon": dict(algo="locon"),
    "locon-m1": dict(algo="locon", multiplier=1.0),
    "locon-tucker": dict(algo="locon", use_tucker=True),
    "locon-scalar": dict(algo="locon", use_scalar=True),
    "locon-rs-lora": dict(algo="locon", map={"Linear": {"rs_lora": True}, "Conv2d": {"rs_lora": True}}),
    "locon-dora": dict(algo="locon", dora_wd=True),
    "locon-dora-in": dict(algo="locon", dora_wd=True, wd_on_output=False),
    "locon-dora-tucker": dict(algo="locon", dora_wd=True, use_tucker=True),
    "loha": dict(algo="loha"),
    "loha-tucker": dict(algo="loha", use_tucker=True),
    "loha-dora": dict(algo="loha", dora_wd=True),
    "loha-dora-in": dict(algo="loha", dora_wd=True, wd_on_output=False),
    "loha-dora-tucker": dict(algo="loha", dora_wd=True, use_tucker=True, multiplier=1.0),
    "lokr": dict(algo="lokr", factor=4),
    "lokr-factored": dict(algo="lokr", linear_dim=2, conv_dim=1),
    "lokr-full-matrix": dict(algo="lokr", full_matrix=True),
    "lokr-decompose-both": dict(algo="lokr", decompose_both=True, linear_dim=1, conv_dim=1),
    "lokr-unbalanced": dict(algo="lokr", unbalanced_factorization=True, linear_dim=2, conv_dim=1),
    "lokr-factor2": dict(algo="lokr", factor=2, multiplier=1.0),
    "lokr-tucker": dict(algo="lokr", use_tucker=True, conv_dim=1),
    "lokr-dora": dict(algo="lokr", dora_wd=True, linear_dim=2, conv_dim=1),
    "lokr-dora-in": dict(algo="lokr", dora_wd=True, wd_on_output=False),
    "diag-oft": dict(algo="diag-oft"),
    "diag-oft-m1": dict(algo="diag-oft", multiplier=1.0),
    "diag-oft-rescaled": dict(algo="diag-oft", rescaled=True),
    "diag-oft-constraint": dict(algo="diag-oft", constraint=0.01),
    "diag-oft-rescaled-constraint": dict(algo="diag-oft", rescaled=True, constraint=0.01, multiplier=1.0),
    "boft": dict(algo="boft"),
    "boft-rescaled": dict(algo="boft", rescaled=True),
    "boft-constraint": dict(algo="boft", constraint=0.01),
    "boft-rescaled-constraint": dict(algo="boft", rescaled=True, constraint=0.01, multiplier=1.0),
    "ia3": dict(algo="ia3"),
    "ia3-input": dict(algo="ia3", map={"Linear": {"algo": "ia3", "train_on_input": True},
                                       "Conv2d": {"algo": "ia3", "train_on_input": True}}),
    "full": dict(algo="full"),
    "norms": dict(algo="locon", train_norm=True),
    "glora": dict(algo="glora"),
    # two blocks of 4 per layer; the file carries kohya's metadata (the DyLoRA marker)
    "dylora": dict(algo="dylora", block_size=4, linear_dim=8, conv_dim=8, metadata=True),
    # one block of 2 per layer, no metadata: the loader needs algo="dylora", block_size=2
    "dylora-plain": dict(algo="dylora", block_size=2, linear_dim=2, conv_dim=2),
}
MULTIPLIER = 0.8
TARGETS = ["Linear", "Conv2d", "LayerNorm", "GroupNorm"]


class Model(nn.Module):
    """A strided conv, two norms, a linear with a bias and one without: every layer type
    the loader adapts."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(4, 16)
        self.fc1 = nn.Linear(16, 32)
        self.ln = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        h = self.norm(self.conv(x)).mean((2, 3))
        return self.fc2(F.gelu(self.ln(self.fc1(h))))


def inputs():
    return torch.randn(3, 8, 7, 6, generator=torch.Generator().manual_seed(0))


def network_metadata(case):
    """The metadata kohya's trainer writes for a lycoris.kohya network (its DyLoRA marker)."""
    kw = CASES[case]
    args = {"algo": kw["algo"], "block_size": str(kw["block_size"])}
    return {"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps(args)}


def _network(case, model):
    from lycoris import LycorisNetwork, create_lycoris  # the peer: only in this process

    kw = dict(CASES[case])
    kw.pop("metadata", None)
    LycorisNetwork.apply_preset({"target_module": TARGETS, "module_algo_map": kw.pop("map", {}),
                                 "name_algo_map": {}})
    net = create_lycoris(model, kw.pop("multiplier", MULTIPLIER), linear_dim=kw.pop("linear_dim", 4),
                         linear_alpha=2, conv_dim=kw.pop("conv_dim", 4), conv_alpha=2, **kw)
    net.apply_to()
    return net


def _randomize(net, seed):
    """Random adapter tensors (dora_scale, rescale and scalars around 1, the rest around 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.2
            if name.endswith("dora_scale"):
                p.mul_(1 + noise)
            elif name.endswith(("rescale", "scalar")):
                p.copy_(1 + noise)
            else:
                p.copy_(noise)


def _full_rank_seed(net):
    """A seed for Python's random under which every DyLoRA module of the network draws its
    last block (lycoris-lora draws a random rank per forward; all blocks = the file's rank)."""
    counts = [m.block_count for m in net.loras]
    for seed in range(10_000):
        random.seed(seed)
        if all(random.randint(0, c - 1) == c - 1 for c in counts):
            return seed
    raise RuntimeError("no seed draws every DyLoRA block")


def _saved_grads(net, sd):
    """Gradients of the parameters saved under their own name with their own value (not a
    ``use_scalar`` up, saved times the scalar), of Full's weight and bias under ``diff`` and
    ``diff_b`` (the weight is the original plus the diff), and of DyLoRA's last blocks (the
    only ones its forward trains) under their parameter names."""
    grads = {}
    for lora in net.loras:
        for n, p in lora.named_parameters():
            if p.grad is None:
                continue
            key = f"{lora.lora_name}.{n}"
            if type(lora).__name__ == "FullModule":
                key = f"{lora.lora_name}.{dict(weight='diff', bias='diff_b')[n]}"
            elif key in sd and not torch.equal(sd[key], p.detach()):
                continue
            elif key not in sd and not (hasattr(lora, "block_count") and n.endswith(f"_list.{lora.block_count - 1}")):
                continue
            grads[key] = p.grad.clone()
    return grads


def make(folder):
    for i, case in enumerate(CASES):
        torch.manual_seed(1)
        model = Model()
        base = {k: v.clone() for k, v in model.state_dict().items()}
        net = _network(case, model)
        _randomize(net, 100 + i)
        x = inputs().requires_grad_(True)
        if CASES[case]["algo"] == "dylora":
            random.seed(_full_rank_seed(net))
        y = model(x)
        y.square().sum().backward()
        sd = net.state_dict()
        meta = network_metadata(case) if CASES[case].get("metadata") else None
        net.save_weights(os.path.join(folder, f"{case}.safetensors"), None, meta)
        torch.save({"base": base, "y": y.detach(), "gx": x.grad.clone(), "grads": _saved_grads(net, sd)},
                   os.path.join(folder, f"{case}.pt"))


def check(folder, *cases):
    for case in cases:
        path = os.path.join(folder, f"{case}.ours.safetensors")
        ref = torch.load(os.path.join(folder, f"{case}.pt"))
        model = Model()
        model.load_state_dict(ref["base"])
        net = _network(case, model)
        info = net.load_weights(path)
        with torch.no_grad():
            y = model(inputs())
        torch.save({"y": y, "load": {k: list(v) for k, v in info.items()}},
                   os.path.join(folder, f"{case}.check.pt"))


if __name__ == "__main__":
    {"make": make, "check": check}[sys.argv[1]](*sys.argv[2:])
