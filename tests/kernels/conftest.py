"""Kernel tests run the Triton kernels in Triton's CPU interpreter unless a CUDA GPU is present.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when kernels/triton_lora.py is
imported. Nothing imports that module before these tests do (kernels.lora_ops imports it on
its first CUDA call only), so setting the variable here, at collection time, is early enough;
test_lora_kernels.py checks that the kernels really are interpreted.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
