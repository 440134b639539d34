"""Engine benchmark: throughput against HF transformers, decode speed against a roofline, TTFT.

    .venv/bin/python bench/engine_throughput.py [--model PATH] [--requests 64] [--skip-hf]

Everything is measured in this one run on this machine, and printed as numbers and
ratios (no assertions: speed goals are read, not tested):

1. Throughput: N chat requests (prompts 20–400 tokens, 128 output tokens each, bf16)
   through our engine vs HF transformers' batched `generate` on the same prompts/dtype.
2. Decode tokens/s at batch 1, 32, 64, 128, and the roofline those should approach:
   this run's bf16 matmul ceiling (GFLOP/s of a [64, hidden] x [hidden, ffn] product)
   divided by the model's matmul FLOPs per token.
3. Time to first token for a 400-token prompt.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import machine_line, matmul_ceilings, plan_line  # noqa: E402
from inference.config import EngineConfig  # noqa: E402
from inference.engine.llm_engine import LLMEngine  # noqa: E402
from inference.engine.sampling_params import SamplingParams  # noqa: E402
from inference.models.fetch import default_model_path  # noqa: E402

WORDS = (
    "the model serves many adapters from one base and batches requests together while the "
    "scheduler admits work that fits in the cache and streams tokens back to every client as "
    "soon as they are sampled so that latency stays low and throughput stays high"
).split()


def make_prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """n chat prompts whose token counts spread evenly over [lo, hi]."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        target = lo + (hi - lo) * i // max(1, n - 1)
        words = []
        while True:
            words.append(rng.choice(WORDS))
            text = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(words)}])
            ids = tokenizer.encode(text)
            if len(ids) >= target:
                prompts.append(ids)
                break
    rng.shuffle(prompts)
    return prompts


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def bench_throughput(engine: LLMEngine, prompts, max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done, seconds = timed(lambda: engine.run_until_done(ids))
    return seconds, sum(o.usage.completion_tokens for o in done.values())


def bench_hf(model_path: Path, prompts, max_tokens: int, dtype, batch: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    if model_path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    hf.eval()
    pad = hf.config.eos_token_id if isinstance(hf.config.eos_token_id, int) else 0
    total_tokens, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(len(p) for p in group)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = hf.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad,
            )
        total_tokens += (out.shape[1] - width) * len(group)
    return time.perf_counter() - start, total_tokens


def decode_tokens_per_s(engine: LLMEngine, batch: int, steps: int = 16) -> float:
    """Steady-state decode: `batch` running sequences, one token each per step."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request([1 + (i % 50)] * 32, params) for i in range(batch)]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill everything first
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - start
    engine.run_until_done(ids)
    return batch * steps / seconds


def matmul_flops_per_token(cfg) -> int:
    """2 x the weights every token multiplies through: q/k/v/o, gate/up/down, lm_head."""
    h, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    attn = h * d * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    mlp = 3 * h * cfg.intermediate_size
    return 2 * (L * (attn + mlp) + h * cfg.vocab_size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=256), progress=False)
    cfg = engine.model_config
    print(f"model {engine.model_name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"dtype {args.dtype}\n{machine_line()}\n{plan_line(engine)}")

    prompts = make_prompts(engine.tokenizer, args.requests, 20, 400)
    lens = [len(p) for p in prompts]
    print(f"\n[1] throughput: {len(prompts)} requests, prompts {min(lens)}-{max(lens)} tokens "
          f"(mean {statistics.mean(lens):.0f}), {args.max_tokens} output tokens each")
    bench_throughput(engine, prompts[:4], 4)  # warm-up
    ours_s, ours_tokens = bench_throughput(engine, prompts, args.max_tokens)
    ours_tps = ours_tokens / ours_s
    print(f"    ours: {ours_tokens} tokens in {ours_s:.1f}s = {ours_tps:.1f} output tok/s")
    if not args.skip_hf:
        hf_s, hf_tokens = bench_hf(engine.config.model_path, prompts, args.max_tokens, dtype, args.hf_batch)
        hf_tps = hf_tokens / hf_s
        print(f"    HF transformers generate (batch {args.hf_batch}): {hf_tokens} tokens in {hf_s:.1f}s "
              f"= {hf_tps:.1f} output tok/s")
        print(f"    ratio ours / HF = {ours_tps / hf_tps:.2f}x   (goal >= 4x)")

    print("\n[2] decode tokens/s (steady state, 32-token contexts)")
    per_token = matmul_flops_per_token(cfg)
    ceilings = matmul_ceilings(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
    for name, value in ceilings.items():
        print(f"    {name:<12} [64,{cfg.hidden_size}]x[{cfg.hidden_size},{cfg.intermediate_size}]: "
              f"{value:7.1f} GFLOP/s -> {value * 1e9 / per_token:7.0f} tok/s")
    fastest = max(ceilings, key=ceilings.get)
    roofline = ceilings[fastest] * 1e9 / per_token
    print(f"    ({per_token / 1e6:.0f} MFLOP/token; roofline = the fastest path measured here, {fastest}: "
          f"{roofline:.0f} tok/s; the engine's {plan_line(engine)})")
    for batch in (1, 32, 64, 128):
        tps = decode_tokens_per_s(engine, batch)
        print(f"    batch {batch:>3}: {tps:8.1f} tok/s  = {tps / roofline:6.1%} of roofline")
    print("    single-stream decode against llama.cpp: bench/single_stream.py")

    print("\n[3] time to first token, 400-token prompt")
    [long_prompt] = make_prompts(engine.tokenizer, 1, 400, 400, seed=1)
    ttfts = []
    for _ in range(3):
        rid = engine.add_request(long_prompt, SamplingParams(max_tokens=1))
        out = engine.run_until_done([rid])[rid]
        ttfts.append(out.time_to_first_token)
    print(f"    {len(long_prompt)} tokens: TTFT median {statistics.median(ttfts) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
