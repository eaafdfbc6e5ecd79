"""Without CUDA, Triton kernels run in Triton's CPU interpreter (read when a kernel is first built)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
