"""Compile the Triton LoRA kernels to GPU code without a GPU (run by test_lora_kernels.py).

The interpreter runs the kernels' Python, not Triton's compiler: type rules (both branches of
the slice pick yielding one type, dot operand dtypes and shapes, early returns) are only
checked when compiling. Triton's NVIDIA backend lowers to PTX and cubin on any machine, so
this runs the whole pipeline for one target, each dtype and a split-K variant.

    python tests/kernels/compile_for_gpu.py [arch, e.g. 90]
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: the interpreter never compiles")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import triton_lora  # noqa: E402


def compile_kernel(fn, arg_types: list[str], constexprs: dict, target: GPUTarget) -> int:
    names = list(fn.arg_names)
    signature = dict(zip(names, arg_types + ["constexpr"] * len(constexprs), strict=True))
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=target)
    return len(compiled.asm["cubin"])


def main() -> None:
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    target = GPUTarget("cuda", arch, 32)
    for dtype, split_k in (("fp32", 1), ("bf16", 1), ("fp16", 4)):
        shrink_types = [f"*{dtype}"] * 4 + ["*fp32", "*i32", "*i32"] + ["i32"] * 6
        size = compile_kernel(
            triton_lora._lora_shrink_kernel,
            shrink_types,
            {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 128, "SPLIT_K": split_k,
             "DOT_FP32": dtype == "fp32"},
            target,
        )  # fmt: skip
        print(f"shrink {dtype} split_k={split_k} sm_{arch}: cubin {size} bytes")
        expand_types = ["*fp32"] + [f"*{dtype}"] * 4 + ["*i32", "*i32"] + ["i32"] * 10
        size = compile_kernel(
            triton_lora._lora_expand_kernel,
            expand_types,
            {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_R": 16, "DOT_FP32": dtype == "fp32"},
            target,
        )
        print(f"expand {dtype} sm_{arch}: cubin {size} bytes")


if __name__ == "__main__":
    main()
