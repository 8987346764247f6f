"""Test session setup.

Without a GPU, Triton kernels run under its interpreter on CPU tensors; the
variable must be set before triton is first imported (one process is either
interpreted or not, so the compile-only checks run in subprocesses).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
