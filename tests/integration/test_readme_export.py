"""The README's Example runs as written without warnings (its LoRA factors are module
parameters, so a loaded export has no lifted constants that require grad), and loading
its .pt2 without ``import lycoris_ops`` fails with the error the README quotes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def _example() -> str:
    text = open(README, encoding="utf-8").read()
    block = text[text.index("## Example"):]
    block = block[block.index("```python\n") + len("```python\n"):]
    return block[:block.index("```")]


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LYCORIS_") and k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


@pytest.mark.slow  # torch.compile and torch.export on CPU: about 15 s
def test_readme_example_is_warning_free_and_its_load_error_is_documented(tmp_path):
    # a loaded export's .module() warned twice ("... requires gradient ... not properly registered
    # as a parameter") when up/down were globals: such a warning is an error here
    check = ("\nimport warnings\nwarnings.filterwarnings('error', message='.*requires gradient')\n"
             "torch.export.load('lora.pt2').module()(x)\nprint('loaded')\n")
    out = _run(_example() + check, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "lycoris.lora_bypass_fwd" in out.stdout and "loaded" in out.stdout
    assert "Warning" not in out.stderr, out.stderr

    bare = _run("import torch\ntorch.export.load('lora.pt2')\n", tmp_path)  # no `import lycoris_ops`
    assert bare.returncode != 0
    readme, err = (" ".join(t.split()) for t in (open(README, encoding="utf-8").read(), bare.stderr))
    for quoted in ("RuntimeError: We ran into an error when deserializing the saved file",
                   "We failed to resolve torch.ops.lycoris.lora_bypass_fwd.default to an operator"):
        assert f"`{quoted}`" in readme and quoted in err
