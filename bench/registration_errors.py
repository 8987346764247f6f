"""Do registration errors of our C++ kernels reach Python, or kill the process?

    python bench/registration_errors.py

Each case runs in a fresh process: bad arguments to ``_C._register_autograd`` (a check of
our own code, and a map of the direct backward), an unknown op name (an error raised inside
libtorch), and a valid registration. Every case should print a Python exception (or "no
error"), exit status 0. On the H200 (torch 2.11, 14:34 in bench/RESULTS.md) our own checks
killed the process with SIGSEGV (status -11) while TORCH_CHECK built them; they now throw
``pybind11::value_error`` (csrc/python_bridge.h: LYCORIS_REGISTRATION_CHECK); the
``_C._error_path_probe`` cases tell the throw from the message formatting apart. Also
printed: the compiler, the C++ runtime the process maps, and (when gdb is installed) a
native backtrace of the first crashing case.
"""
import glob
import os
import shutil
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
    "probe: constant value_error": "print(_C._error_path_probe(0))",
    "probe: c10::str, no throw": "print(_C._error_path_probe(1))",
    "probe: value_error(c10::str)": "print(_C._error_path_probe(2))",
    "probe: TORCH_CHECK constant": "print(_C._error_path_probe(3))",
    "probe: std::runtime_error": "print(_C._error_path_probe(4))",
    "probe: TORCH_CHECK formatted": "print(_C._error_path_probe(5))",
    "probe: value_error(lycoris::text)": "print(_C._error_path_probe(6))",
    "probe: LYCORIS_CHECK formatted": "print(_C._error_path_probe(7))",
    "valid direct registration": (
        "_C._register_autograd('lycoris_regcheck::f', fn, [0, 1], [], [], direct_op='lycoris_regcheck::b', "
        "direct_args=[-1, 0, 1, 2], direct_targets=[0, 1], direct_passthrough=3)"),
}


def toolchain() -> None:
    """What built and what loads the extension: the compiler, the C++ runtime the process
    maps, and the newest GLIBCXX / CXXABI versions the extension needs."""
    import lycoris_ops
    so = glob.glob(os.path.join(os.path.dirname(lycoris_ops.__file__), "_C*.so"))
    cxx = os.environ.get("CXX", "c++")
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()
    print("compiler:", out[0] if out else "?")
    code = ("import torch, lycoris_ops._C\n"
            "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l or 'libgcc_s' in l}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print("runtime mapped:", r.stdout.strip() or r.stderr.strip()[-200:])
    if so and shutil.which("objdump"):
        syms = subprocess.run(["objdump", "-T", so[0]], capture_output=True, text=True).stdout
        for tag in ("GLIBCXX_", "CXXABI_", "GCC_"):
            vers = sorted({w.strip("()") for w in syms.split() if w.strip("()").startswith(tag)},
                          key=lambda v: [int(x) for x in v.split("_")[-1].split(".") if x.isdigit()])
            print(f"{tag[:-1]} needed up to:", vers[-1] if vers else "-")


def backtrace(call: str) -> None:
    """A native backtrace of one crashing case, when gdb is there."""
    if not shutil.which("gdb"):
        print("gdb: not installed")
        return
    code = PRELUDE + call + "\n"
    r = subprocess.run(["gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 25", "--args", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=120)
    lines = [l for l in r.stdout.splitlines() if l.startswith("#") or "signal" in l.lower()]
    print("\n".join(lines[:30]))


#: c10::str of a number (streams): the H200 crash itself, shown, not counted as a failure
DIAGNOSTIC = {"probe: c10::str, no throw", "probe: value_error(c10::str)", "probe: TORCH_CHECK formatted"}


def main() -> int:
    bad = 0
    crashed = []
    toolchain()
    for name, call in CASES.items():
        code = PRELUDE + f"try:\n    {call}\n    print('no error')\nexcept Exception as e:\n" \
                         f"    print(type(e).__name__ + ': ' + str(e)[:100])\n"
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True)
        bad += r.returncode != 0 and name not in DIAGNOSTIC
        if r.returncode < 0 and name not in DIAGNOSTIC:
            crashed.append(call)
        note = "  (diagnostic)" if name in DIAGNOSTIC else ""
        print(f"{name:42s} exit {r.returncode:4d}  {r.stdout.strip()[-120:]}{note}")
    if crashed:
        backtrace(crashed[0])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
