"""Cross-check of lycoris_ops' own ``nn`` adapters against lycoris-lora itself (installed by
the test extras; skipped without it).

tests/peer_networks.py runs lycoris-lora in a subprocess without lycoris_ops (there it runs
on its own kernel layer) and saves, per algorithm, a small model's base weights, a LyCORIS
network's state dict with random adapter tensors, an input and the network's output. Here
``load_lycoris_state_dict`` rebuilds the network on our ``nn`` adapters: same output and the
same gradients for the input and every adapter tensor (fp32), and ``lycoris_state_dict``
gives back the same state dict. (tests/test_lycoris_bridge.py runs lycoris-lora's own
modules on our ops instead.)
"""
import os
import subprocess
import sys

import pytest
import torch

from lycoris_ops import nn as lnn
from lycoris_ops.nn.lycoris_io import _lycoris_tensors
from lycoris_ops.integrations.lycoris_lora import installed_version

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def peer_networks(tmp_path_factory):
    if installed_version() is None:
        pytest.skip("lycoris-lora is not installed (pip install -e '.[test]')")
    path = tmp_path_factory.mktemp("peer") / "nets.pt"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "peer_networks.py"), "nets", str(path)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(path.parent))
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
        for k, t in _lycoris_tensors(ad).items():
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
