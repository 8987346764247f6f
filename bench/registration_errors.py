"""Do registration errors of our C++ kernels reach Python, or kill the process?

    python bench/registration_errors.py

Each case runs in a fresh process: bad arguments to ``_C._register_autograd`` (a check of
our own code, and a map of the direct backward), an unknown op name (an error raised inside
libtorch), and a valid registration. Every case should print a Python exception (or "no
error"), exit status 0. On the H200 (torch 2.11, 14:34 in bench/RESULTS.md) our own checks
killed the process with SIGSEGV (status -11) while TORCH_CHECK built them; they now throw
``pybind11::value_error`` (csrc/python_bridge.h: LYCORIS_REGISTRATION_CHECK).
"""
import subprocess
import sys

PRELUDE = """
import torch, lycoris_ops
from lycoris_ops import _C
lib = torch.library.Library("lycoris_regcheck", "DEF")
lib.define("f(Tensor x, Tensor w, float k, Tensor? base=None) -> Tensor")
lib.define("b(Tensor grad, Tensor x, Tensor w, float k) -> (Tensor, Tensor)")
fn = lambda *a: None
"""
CASES = {
    "bad save_inputs index": "_C._register_autograd('lycoris_regcheck::f', fn, [7], [], [])",
    "direct backward passes an unsaved tensor": (
        "_C._register_autograd('lycoris_regcheck::f', fn, [0], [], [], direct_op='lycoris_regcheck::b', "
        "direct_args=[-1, 0, 1, 2], direct_targets=[0, -1], direct_passthrough=3)"),
    "unknown direct op (libtorch's error)": (
        "_C._register_autograd('lycoris_regcheck::f', fn, [0, 1], [], [], direct_op='lycoris_regcheck::nope', "
        "direct_args=[-1, 0, 1, 2], direct_targets=[0, 1], direct_passthrough=3)"),
    "unknown op (libtorch's error)": "_C._register_autograd('lycoris_regcheck::nope', fn, [0], [], [])",
    "valid direct registration": (
        "_C._register_autograd('lycoris_regcheck::f', fn, [0, 1], [], [], direct_op='lycoris_regcheck::b', "
        "direct_args=[-1, 0, 1, 2], direct_targets=[0, 1], direct_passthrough=3)"),
}


def main() -> int:
    bad = 0
    for name, call in CASES.items():
        code = PRELUDE + f"try:\n    {call}\n    print('no error')\nexcept Exception as e:\n" \
                         f"    print(type(e).__name__ + ': ' + str(e)[:100])\n"
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True)
        bad += r.returncode != 0
        print(f"{name:42s} exit {r.returncode:4d}  {r.stdout.strip()[-120:]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
