"""Build lycoris_ops._C (the operator schemas) with torch's C++ extension tools.

    pip install torch==2.13.0            # first and alone: see README
    pip install --no-build-isolation -e ".[test]"
"""
import glob
import importlib.metadata
import os
import pathlib

from setuptools import find_packages, setup
import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension


def cuda_runtime_include():
    """A folder with CUDA's runtime headers (cuda_runtime_api.h and the crt/ headers it
    includes): CUDA_HOME's, an installed toolkit's under /usr/local, or the nvidia pip
    package's that a CUDA torch wheel installs. None: not found."""
    folders = [os.path.join(CUDA_HOME, "include")] if CUDA_HOME else []
    folders += sorted(glob.glob("/usr/local/cuda*/include"), reverse=True)
    try:
        import nvidia

        for base in nvidia.__path__:
            folders += sorted(glob.glob(os.path.join(base, "*", "include")))
    except ImportError:
        pass
    needed = ("cuda_runtime_api.h", os.path.join("crt", "host_defines.h"))
    return next((d for d in folders if all(os.path.exists(os.path.join(d, f)) for f in needed)), None)


# -g0: no debug info; it halves the build. No -std: BuildExtension adds the C++ standard
# this torch's headers are written for (hard-coding one breaks on the next torch).
extra_compile_args = {"cxx": ["-O2", "-g0"]}
# With a CUDA torch and CUDA's runtime headers, csrc/launch.cpp also gets its replaying
# CUDA kernel: host C++ only (nothing for nvcc), linked to torch's c10_cuda. Without the
# headers (a CUDA_HOME guessed from an nvcc wrapper, say) it is left out, with a note.
# LYCORIS_CUDA_LAUNCH=0 leaves it out.
cuda_include = None
if torch.version.cuda and os.environ.get("LYCORIS_CUDA_LAUNCH", "1") != "0":
    cuda_include = cuda_runtime_include()
    if cuda_include is None:
        print("lycoris_ops: CUDA's runtime headers not found (CUDA_HOME, /usr/local/cuda*, the nvidia pip package): "
              "building without the C++ CUDA launch path (csrc/launch.cpp); the ops run, with more host time per call")
cuda_launch = cuda_include is not None


class BuildWithTorchRecord(BuildExtension):
    """Writes lycoris_ops/_build_info.py beside each copy of _C (the build folder's and, for
    in-place and editable builds, the source tree's): the torch _C is compiled against, which
    lycoris_ops/__init__.py compares with the running torch before it loads _C. Ninja rebuilds
    what torch's headers changed; without ninja (BuildExtension falls back to setuptools'
    compiler, which sees only our sources), a record naming another torch forces the rebuild."""

    record = f"# Written by setup.py: the torch that lycoris_ops._C is compiled against.\nTORCH_VERSION = {torch.__version__!r}\n"

    def run(self):
        folders = [os.path.join(self.build_lib, "lycoris_ops")]
        if self.inplace:
            folders.append(self.get_finalized_command("build_py").get_package_dir("lycoris_ops"))
        built = pathlib.Path(folders[0], "_build_info.py")
        if not built.exists() or built.read_text() != self.record:
            self.force = True
        super().run()
        for folder in folders:
            pathlib.Path(folder, "_build_info.py").write_text(self.record)


setup(
    name="lycoris_ops",
    version="0.1.0",
    description="Fused LyCORIS adapter ops as torch.ops.lycoris.* custom ops",
    packages=find_packages(include=["lycoris_ops", "lycoris_ops.*"]),
    python_requires=">=3.10",
    # the torch distribution _C is compiled against: it loads with no other
    install_requires=[f"torch=={importlib.metadata.version('torch')}"],
    extras_require={
        "triton": ["triton>=3.6"],
        "tilelang": ["tilelang==0.1.15"],
        "test": ["pytest", "pytest-xdist", "expecttest", "numpy", "peft>=0.21",  # peft: the patch_peft tests run against PEFT itself
                 "lycoris-lora==4.1.3", "einops", "toml",  # lycoris-lora: the LyCORIS file tests run against it
                 "bitsandbytes>=0.45", "torchao"],  # QLoRA bases: the patched PEFT layers on quantized Linear (CPU)
        "bench": ["numpy", "matplotlib"],
    },
    ext_modules=[
        CppExtension(
            "lycoris_ops._C",
            ["csrc/ops.cpp", "csrc/autograd.cpp", "csrc/launch.cpp", "csrc/module.cpp"],
            include_dirs=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")]
            + ([cuda_include] if cuda_launch else []),
            define_macros=[("LYCORIS_CUDA_LAUNCH", None)] if cuda_launch else [],
            libraries=["c10_cuda"] if cuda_launch else [],
            extra_compile_args=extra_compile_args,
        )
    ],
    cmdclass={"build_ext": BuildWithTorchRecord.with_options(use_ninja=True)},
)
