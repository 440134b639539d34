"""Mixed-adapter throughput: N requests spread over 8 distinct adapters vs the same N on the base alone.

    .venv/bin/python bench/multi_lora_throughput.py [--quick] [--model PATH] [--requests 64]

Adapters: random PEFT LoRA, rank 16 on all seven projections (q/k/v/o/gate/up/down), bf16,
written for the base's shapes (bench/lora_adapters.py), registered with `add_adapter` and warmed
into device slots (max_loras = 8) before timing, so this measures the LoRA compute and the
mixed-batch scheduling, not adapter loading (bench/cold_adapter.py measures that).

Both workloads use identical prompts (mixed lengths) and output lengths (ignore_eos), submitted
all at once. The two runs alternate (base, LoRA, base, LoRA, ...) so that a noisy machine hurts
both alike; the ratio uses each side's best run. Goal: LoRA / base >= 0.9. No assertions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_throughput import make_prompts  # noqa: E402
from bench.lora_adapters import adapter_nbytes, base_config, write_random_adapters  # noqa: E402
from bench.machine import machine_line, plan_line  # noqa: E402
from inference.config import EngineConfig  # noqa: E402
from inference.engine.llm_engine import LLMEngine  # noqa: E402
from inference.engine.sampling_params import SamplingParams  # noqa: E402
from inference.models.fetch import default_model_path  # noqa: E402


def run(engine: LLMEngine, prompts, loras, max_tokens: int) -> tuple[float, int]:
    """Submit every request at once; (seconds until all finished, output tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params, lora=lora) for p, lora in zip(prompts, loras, strict=True)]
    done = engine.run_until_done(ids)
    seconds = time.perf_counter() - start
    errors = [o.error for o in done.values() if o.finish_reason == "error"]
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    return seconds, sum(o.usage.completion_tokens for o in done.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", default="20,200", help="lo,hi prompt lengths")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="short prompts (16-64), 16 output tokens, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.prompt_tokens, args.repeats = 16, "16,64", 1
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))

    cfg = base_config(args.model)
    engine = LLMEngine(
        EngineConfig(
            model=args.model, dtype=args.dtype, max_num_seqs=256, max_loras=args.adapters,
            max_cpu_loras=max(16, args.adapters), max_lora_rank=args.rank,
        ),
        progress=False,
    )
    prompts = make_prompts(engine.tokenizer, args.requests, lo, hi)
    lens = [len(p) for p in prompts]
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        paths = write_random_adapters(Path(tmp), cfg, args.adapters, rank=args.rank)
        names = [p.name for p in paths]
        for name, path in zip(names, paths, strict=True):
            engine.add_adapter(name, path)
        routes = [names[i % len(names)] for i in range(len(prompts))]
        print(f"{machine_line()}\n{plan_line(engine)}")
        print(
            f"model {engine.model_name}, {args.dtype}; {len(prompts)} requests, prompts {min(lens)}-{max(lens)} "
            f"tokens (mean {statistics.mean(lens):.0f}), {args.max_tokens} output tokens each; "
            f"{len(names)} adapters rank {args.rank}, all seven projections "
            f"({adapter_nbytes(cfg, args.rank) / 2**20:.1f} MiB each)"
        )
        # Warm-up: one short request per adapter (puts every adapter in a device slot) and base-only.
        run(engine, [prompts[0][:16]] * len(names), names, 2)
        run(engine, [prompts[0][:16]], [None], 2)

        base_tps, lora_tps = [], []
        for rep in range(args.repeats):
            s, n = run(engine, prompts, [None] * len(prompts), args.max_tokens)
            base_tps.append(n / s)
            print(f"  [{rep}] base only      : {n} tokens in {s:6.1f}s = {n / s:7.1f} output tok/s")
            s, n = run(engine, prompts, routes, args.max_tokens)
            lora_tps.append(n / s)
            print(f"  [{rep}] {len(names)} adapters mixed: {n} tokens in {s:6.1f}s = {n / s:7.1f} output tok/s")

        stats = engine.lora_stats()
        print(f"  lora_stats: hits {stats['hits']}, misses {stats['misses']}, loads {stats['loads']}, "
              f"evictions {stats['evictions']}")
        mem = engine.memory_stats()
        print("  memory: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in mem.items()))
    ratio = max(lora_tps) / max(base_tps)
    print(f"\nratio mixed-adapter / base-only throughput = {ratio:.3f}   (goal >= 0.9)")


if __name__ == "__main__":
    main()
