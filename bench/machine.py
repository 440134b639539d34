"""What a benchmark's numbers were measured on: the CPU, and the matmul plan the engine chose there.

    from bench.machine import machine_line, plan_line, matmul_ceilings
    print(machine_line())           # "CPU: AMD EPYC (torch capability AVX512), 2 threads"
    print(plan_line(engine))        # "matmul plan (measured): decode native, batch native, ..."

Numbers mean little without both: the same engine picks other paths on another CPU
(inference/layers/matmul_plan.py). `matmul_ceilings` times one [rows, hidden] x [hidden, ffn]
product on every path in this run; the roofline is the fastest of them.
"""

from __future__ import annotations

import subprocess
import time

import torch
import torch.nn.functional as F

from inference.layers.matmul_plan import FP32_CACHED, FP32_UPCAST, NATIVE, linear_fp32


def cpu_name() -> str:
    """lscpu's model name ("unknown CPU" where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown CPU")  # fmt: skip


def machine_line() -> str:
    return (f"CPU: {cpu_name()} (torch {torch.__version__}, capability "
            f"{torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads")  # fmt: skip


def plan_line(engine) -> str:
    """Which path each shape class took in this engine, the LoRA stacks' dtype and kernel, the
    decode and prefill attention's kernels and the quantised weights' (each kernel with its start-up timings
    where it was raced)."""
    plan = engine.matmul_plan.describe()
    paths = ", ".join(f"{c} {p}" for c, p in plan["paths"].items())

    def kernel(name: str) -> str:
        timed = plan["timings_us"].get(name)
        return plan[name] + (" (" + ", ".join(f"{k} {us:.0f} us" for k, us in timed.items()) + ")" if timed else "")

    tiles = f", runs of >= {plan['lora_tile_rows']} tokens on AMX tiles" if plan["lora_tile_rows"] else ""
    return (f"matmul plan ({plan['source']}): {paths}; LoRA in {plan['lora_dtype']}, kernel "
            f"{kernel('lora_kernel')}{tiles}; decode attention {kernel('attention_kernel')}; prefill attention "
            f"{kernel('prefill_attention_kernel')}; quantised weights "
            f"{kernel('quant_kernel')}; dense weights {kernel('dense_layout')}")  # fmt: skip


def gflops(fn, flops: float, min_seconds: float = 0.2) -> float:
    """Best-of GFLOP/s of fn over about min_seconds (after a warm-up call)."""
    fn()
    best, spent = float("inf"), 0.0
    while spent < min_seconds:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return flops / best / 1e9


def matmul_ceilings(hidden: int, ffn: int, rows: int = 64, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """GFLOP/s of a [rows, hidden] x [hidden, ffn] product on each matmul path."""
    flops = 2 * rows * hidden * ffn
    x = torch.randn(rows, hidden).to(dtype)
    w = torch.randn(ffn, hidden).to(dtype)  # [out, in] as the model stores it
    w32 = w.float()
    if dtype == torch.float32:
        return {NATIVE: gflops(lambda: F.linear(x, w), flops)}
    return {
        NATIVE: gflops(lambda: F.linear(x, w), flops),
        FP32_UPCAST: gflops(lambda: linear_fp32(x.float(), w, None).to(dtype), flops),
        FP32_CACHED: gflops(lambda: F.linear(x.float(), w32).to(dtype), flops),
    }
