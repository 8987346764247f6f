"""Build lycoris_ops._C (the operator schemas) with torch's C++ extension tools.

    pip install torch==2.13.0            # first and alone: see README
    pip install --no-build-isolation -e ".[test]"
"""
import os

from setuptools import find_packages, setup
import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

# -g0: no debug info; it halves the build.
extra_compile_args = {"cxx": ["-O2", "-g0", "-std=c++17"]}
# With a CUDA torch and CUDA's toolkit, csrc/launch.cpp also gets its replaying CUDA
# kernel (host C++ only: nothing is compiled by nvcc). LYCORIS_CUDA_LAUNCH=0 leaves it out.
cuda_launch = bool(torch.version.cuda) and CUDA_HOME is not None and os.environ.get("LYCORIS_CUDA_LAUNCH", "1") != "0"
Extension = CUDAExtension if cuda_launch else CppExtension

setup(
    name="lycoris_ops",
    version="0.1.0",
    description="Fused LyCORIS adapter ops as torch.ops.lycoris.* custom ops",
    packages=find_packages(include=["lycoris_ops", "lycoris_ops.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11"],
    extras_require={
        "triton": ["triton>=3.6"],
        "tilelang": ["tilelang==0.1.15"],
        "test": ["pytest", "expecttest", "numpy", "peft>=0.21"],  # peft: the patch_peft tests run against PEFT itself
        "bench": ["numpy", "matplotlib"],
    },
    ext_modules=[
        Extension(
            "lycoris_ops._C",
            ["csrc/ops.cpp", "csrc/autograd.cpp", "csrc/launch.cpp", "csrc/module.cpp"],
            include_dirs=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")],
            define_macros=[("LYCORIS_CUDA_LAUNCH", None)] if cuda_launch else [],
            extra_compile_args=extra_compile_args,
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
