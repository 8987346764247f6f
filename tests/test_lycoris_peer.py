"""Cross-check against lycoris-lora itself (optional: skipped unless LYCORIS_PEER_PATH names a
folder where ``import lycoris`` works, e.g. ``pip install --target DIR lycoris_lora einops``).

tests/peer_networks.py runs in a subprocess with the peer on its path (the two packages
cannot share a process: both register the ``lycoris`` operator namespace) and saves, per
algorithm, a small model's base weights, a LyCORIS network's state dict with random adapter
tensors, an input and the network's output. Here ``load_lycoris_state_dict`` rebuilds the
network on our ops: same output and the same gradients for the input and every adapter
tensor (fp32), and ``lycoris_state_dict`` gives back the same state dict.
"""
import os
import subprocess
import sys

import pytest
import torch

from lycoris_ops import nn as lnn

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.environ.get("LYCORIS_PEER_PATH", "")


@pytest.fixture(scope="module")
def peer_networks(tmp_path_factory):
    if not PEER or not os.path.isdir(os.path.join(PEER, "lycoris")):
        pytest.skip("lycoris-lora not available (set LYCORIS_PEER_PATH)")
    path = tmp_path_factory.mktemp("peer") / "nets.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PEER, HERE]), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "peer_networks.py"), str(path)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(path.parent))
    if proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr:
        pytest.skip("lycoris-lora's dependencies are missing: " + proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


sys.path.insert(0, HERE)
from peer_networks import CONFIGS, Model  # noqa: E402


@pytest.mark.parametrize("name", list(CONFIGS))
def test_network_on_our_ops_matches_lycoris(peer_networks, name):
    net = peer_networks["nets"][name]
    model = Model()
    model.load_state_dict(net["base"])
    lnn.load_lycoris_state_dict(model, net["sd"], multiplier=net["multiplier"])
    kinds = {type(a).__name__ for _, a in lnn.adapters(model)}
    assert len(list(lnn.adapters(model))) == 5, kinds  # conv, two norms, two linears
    x = peer_networks["x"].clone().requires_grad_(True)
    y = model(x)
    err = ((y.detach() - net["y"]).norm() / net["y"].norm()).item()
    assert err < 1e-5, f"{name}: rel err {err:.2e} against lycoris-lora ({sorted(kinds)})"
    y.square().sum().backward()
    torch.testing.assert_close(x.grad, net["gx"], rtol=1e-4, atol=1e-6)
    ours = {}  # our parameters under LyCORIS's names, for their gradients
    for mname, ad in lnn.adapters(model):
        for k, t in lnn._lycoris_tensors(ad).items():
            if isinstance(t, torch.nn.Parameter):
                ours[f"lycoris_{mname.replace('.', '_')}.{k}"] = t
    assert net["grads"] and set(net["grads"]) <= set(ours), sorted(set(net["grads"]) - set(ours))
    for k, g in net["grads"].items():
        torch.testing.assert_close(ours[k].grad.reshape(g.shape), g, rtol=1e-4, atol=1e-6, msg=k)
    back = lnn.lycoris_state_dict(model)
    assert sorted(back) == sorted(net["sd"])
    for k, v in net["sd"].items():
        assert back[k].shape == v.shape, k
        torch.testing.assert_close(back[k].to(v.dtype), v.detach(), msg=k)
