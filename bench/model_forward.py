"""Model forward speed on this machine: decode steps at batch 1 and 64, one 400-token prefill.

    python bench/model_forward.py [--model PATH] [--dtypes float32,bfloat16] [--ctx 256]

Times one engine-shaped step (attention metadata + forward + logits of the sampled rows),
best and median of several runs. Decode at batch 64 is shown for a uniform context and for
contexts drawn from [20, 528] (what a mixed chat workload looks like). Use OMP_NUM_THREADS to
compare thread counts; other processes on a 2-core box make the numbers swing a lot.
"""

from __future__ import annotations

import argparse
import time

import torch

from inference.layers.attention import allocate_kv_cache
from inference.layers.attention_metadata import build_attention_metadata
from inference.models.loader import load_model

BLOCK = 16


def timed(fn, runs: int) -> tuple[float, float]:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[0], times[len(times) // 2]


def kv_cache(model, num_blocks: int, dtype: torch.dtype):
    c = model.config
    return allocate_kv_cache(
        num_layers=c.num_hidden_layers, num_blocks=num_blocks, block_size=BLOCK,
        num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=dtype,
    )  # fmt: skip


def decode_step(model, lens: list[int], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in lens]
    kv = kv_cache(model, sum(blocks), dtype)
    order = torch.randperm(sum(blocks), generator=g).tolist()  # scattered blocks, like a busy cache
    tables, used = [], 0
    for n in blocks:
        tables.append(order[used : used + n])
        used += n
    ids = torch.randint(0, model.config.vocab_size, (len(lens),), generator=g)
    positions = torch.tensor([n - 1 for n in lens])

    def step():
        meta = build_attention_metadata(lens, [1] * len(lens), tables, BLOCK)
        return model.compute_logits(model(ids, positions, kv, meta))

    return step


def prefill_step(model, length: int, dtype: torch.dtype):
    n_blocks = -(-length // BLOCK)
    kv = kv_cache(model, n_blocks, dtype)
    ids = torch.randint(0, model.config.vocab_size, (length,))
    positions = torch.arange(length)

    def step():
        meta = build_attention_metadata([length], [length], [list(range(n_blocks))], BLOCK)
        hidden = model(ids, positions, kv, meta)
        return model.compute_logits(hidden[-1:])

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--ctx", type=int, default=256, help="context length of the uniform decode runs"
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"
    )
    mixed = torch.randint(20, 529, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        model = load_model(args.model, dtype=dtype, progress=False)
        with torch.inference_mode():
            for label, lens, runs in [
                (f"decode batch  1, ctx {args.ctx}", [args.ctx], 10),
                (f"decode batch 64, ctx {args.ctx}", [args.ctx] * 64, 5),
                ("decode batch 64, ctx 20..528", mixed, 5),
            ]:
                best, median = timed(decode_step(model, lens, dtype), runs)
                print(
                    f"{name:8s} {label}: {best * 1e3:7.1f} ms/step (median {median * 1e3:7.1f})"
                    f"  {len(lens) / best:6.1f} tok/s"
                )
            best, median = timed(prefill_step(model, 400, dtype), 3)
            print(
                f"{name:8s} prefill 400 tokens:        {best * 1e3:7.1f} ms      (median {median * 1e3:7.1f})  {400 / best:6.1f} tok/s"
            )


if __name__ == "__main__":
    main()
