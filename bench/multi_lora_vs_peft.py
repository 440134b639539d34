"""Our engine vs HF transformers + PEFT mixed-adapter batches on the identical workload, bf16.

    .venv/bin/python bench/multi_lora_vs_peft.py [--quick] [--model PATH] [--requests 32]

Workload: N chat prompts of mixed lengths, each routed to one of 8 adapters (rank 16, all seven
projections; every 9th request base-only), the same output length for all (no EOS stop).

- HF + PEFT: the base read from the same checkpoint by transformers (GGUF dequantised to dense
  bf16 at load: GgufConfig(dequantize=True); transformers otherwise keeps GGUF blocks packed),
  every adapter loaded into one PeftModel, requests in arrival order in static batches of
  --hf-batch, left padded, `generate(..., adapter_names=[...])` ("__base__" for base rows).
- Ours: every request submitted at once (continuous batching, one mixed batch per step).

Prints output tokens/s of each and the ratio (goal >= 6x), and how many requests' greedy tokens
agree between the two (bf16 on both sides, so exact agreement is not expected). No assertions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_throughput import make_prompts  # noqa: E402
from bench.lora_adapters import base_config, write_random_adapters  # noqa: E402
from bench.machine import machine_line, plan_line  # noqa: E402
from inference.config import EngineConfig  # noqa: E402
from inference.engine.llm_engine import LLMEngine  # noqa: E402
from inference.engine.sampling_params import SamplingParams  # noqa: E402
from inference.models.fetch import default_model_path  # noqa: E402


def load_hf_peft(model_path: Path, adapters: dict[str, Path], dtype: torch.dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GgufConfig

    if model_path.suffix == ".gguf":  # dequantised to plain dense bf16 weights, as our engine holds them
        hf = AutoModelForCausalLM.from_pretrained(
            str(model_path.parent), gguf_file=model_path.name, dtype=dtype,
            quantization_config=GgufConfig(gguf_file=model_path.name, dequantize=True),
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    hf.eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(hf, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    model.eval()
    model.generation_config.eos_token_id = None  # every request runs to max_tokens, as ours do
    return model


def run_hf_peft(model, prompts, routes, max_tokens: int, batch: int) -> tuple[float, int, list[list[int]]]:
    pad = 0
    outputs, total, start = [], 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        group, names = prompts[i : i + batch], routes[i : i + batch]
        width = max(len(p) for p in group)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                pad_token_id=pad, adapter_names=["__base__" if n is None else n for n in names],
            )
        new = out[:, width:]
        total += new.numel()
        outputs += new.tolist()
    return time.perf_counter() - start, total, outputs


def run_ours(engine: LLMEngine, prompts, routes, max_tokens: int) -> tuple[float, int, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params, lora=r) for p, r in zip(prompts, routes, strict=True)]
    done = engine.run_until_done(ids)
    seconds = time.perf_counter() - start
    errors = [done[i].error for i in ids if done[i].finish_reason == "error"]
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    return seconds, sum(done[i].usage.completion_tokens for i in ids), [list(done[i].token_ids) for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", default="20,200", help="lo,hi prompt lengths")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="16 requests, prompts 16-96, 16 output tokens")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.prompt_tokens, args.max_tokens, args.hf_batch = 16, "16,96", 16, 8
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    dtype = getattr(torch, args.dtype)
    model_path = Path(args.model)

    cfg = base_config(model_path)
    engine = LLMEngine(
        EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=256, max_loras=args.adapters,
                     max_cpu_loras=max(16, args.adapters), max_lora_rank=args.rank),
        progress=False,
    )
    prompts = make_prompts(engine.tokenizer, args.requests, lo, hi)
    lens = [len(p) for p in prompts]
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        paths = write_random_adapters(Path(tmp), cfg, args.adapters, rank=args.rank)
        adapters = {p.name: p for p in paths}
        names = list(adapters)
        routes = [None if i % (len(names) + 1) == len(names) else names[i % (len(names) + 1)]
                  for i in range(len(prompts))]
        for name, path in adapters.items():
            engine.add_adapter(name, path)
        print(f"{machine_line()}\n{plan_line(engine)}")
        print(f"model {engine.model_name}, {args.dtype}, threads {torch.get_num_threads()}; {len(prompts)} requests, "
              f"prompts {min(lens)}-{max(lens)} tokens (mean {statistics.mean(lens):.0f}), {args.max_tokens} output "
              f"tokens each; {len(names)} adapters rank {args.rank} all seven projections, "
              f"{routes.count(None)} base-only requests")

        run_ours(engine, [prompts[0][:16]] * len(names), names, 2)  # warm-up: every adapter into a slot
        ours_s, ours_n, ours_tokens = run_ours(engine, prompts, routes, args.max_tokens)
        print(f"  ours            : {ours_n} tokens in {ours_s:6.1f}s = {ours_n / ours_s:7.2f} output tok/s")

        peft_model = load_hf_peft(model_path, adapters, dtype)
        run_hf_peft(peft_model, [prompts[0][:16]] * 2, names[:2], 2, 2)  # warm-up
        hf_s, hf_n, hf_tokens = run_hf_peft(peft_model, prompts, routes, args.max_tokens, args.hf_batch)
        print(f"  HF + PEFT (static batches of {args.hf_batch}, adapter_names): {hf_n} tokens in {hf_s:6.1f}s "
              f"= {hf_n / hf_s:7.2f} output tok/s")

    same = sum(a == b for a, b in zip(ours_tokens, hf_tokens, strict=True))
    first = sum(a[:1] == b[:1] for a, b in zip(ours_tokens, hf_tokens, strict=True))
    print(f"  greedy agreement (bf16 both sides): {same}/{len(prompts)} requests identical, "
          f"{first}/{len(prompts)} same first token")
    print(f"\nratio ours / HF+PEFT = {(ours_n / ours_s) / (hf_n / hf_s):.2f}x   (goal >= 6x)")


if __name__ == "__main__":
    main()
