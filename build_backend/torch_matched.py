"""PEP 517 build backend: setuptools', asking for the torch that is installed where pip installs.

lycoris_ops._C is compiled against torch's headers and links libtorch, so it loads only with
the torch it was built against. In pip's isolated build environment a plain ``torch``
requirement pulls the newest torch; this backend requires exactly the installed one instead,
and stops at once, with what to do, where none is installed.
"""
import subprocess
import sys

from setuptools.build_meta import *  # noqa: F401,F403  (every other hook is setuptools')

# pip (its isolated builds to date) runs the hooks with the interpreter of the environment it
# installs into, hiding that environment's packages through PYTHONPATH and PYTHONNOUSERSITE;
# -E ignores both, so this child sees them. A frontend that runs the hooks in a virtual
# environment of its own (python -m build, uv) has no torch here and gets the message below.
_TORCH_DIST_VERSION = "import importlib.metadata as m; print(m.version('torch'))"

_NO_TORCH = """
lycoris_ops is compiled against the torch it will run with, and the environment of
{python} (where this build looks for it) has no torch.
Install torch first, then lycoris_ops:
    {python} -m pip install torch==2.13.0
    {python} -m pip install .
A frontend that builds in an environment of its own (python -m build, uv) cannot see the
installed torch: build without isolation, in an environment that has torch, setuptools,
wheel and ninja: pip install --no-build-isolation . (or python -m build --no-isolation).
"""


def _installed_torch_requirement():
    probe = subprocess.run([sys.executable, "-E", "-c", _TORCH_DIST_VERSION], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(_NO_TORCH.format(python=sys.executable))
    return [f"torch=={probe.stdout.strip()}"]


# setuptools' own versions of these run setup.py, which imports torch: not yet installed here.
def get_requires_for_build_wheel(config_settings=None):
    return _installed_torch_requirement()


def get_requires_for_build_editable(config_settings=None):
    return _installed_torch_requirement()


def get_requires_for_build_sdist(config_settings=None):
    return _installed_torch_requirement()
