"""Memory: peak RSS serving 8 adapters vs the base alone vs 8 merged copies of the base.

    .venv/bin/python bench/multi_lora_memory.py [--quick] [--model PATH] [--configs base lora8]

Each configuration runs in a fresh Python process (so peaks don't carry over) that builds the
engine, serves a small workload, and reports `resource.getrusage(RUSAGE_SELF).ru_maxrss`:

- base:    the engine without LoRA (max_loras=0), base-only requests.
- lora8:   the engine with LoRA (max_loras=8, max_lora_rank=16) and 8 adapters (rank 16, all seven projections, bf16) registered and
           resident in device slots, the same requests spread over them.
- merged8: what 8 separate deployments hold in weights: the engine plus 7 more copies of the base
           weights (load_model), each with one adapter merged in (W += scale·B·A); the same
           base-only requests (KV cache counted once, so this understates 8 real deployments).

On a CPU an adapter in a device slot is held once: the host tier's entry shares the slot's
memory (inference/lora/slots.py), so lora8 pays the slots and not a second copy.

Goal: lora8 <= 1.15x base. Also prints the engine's memory_stats() breakdown. No assertions.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.models.fetch import default_model_path  # noqa: E402

CONFIGS = ("base", "lora8", "merged8")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def merge_into(model, adapter) -> None:
    """W += B·A (scale already folded into B) for every adapted projection of our fused layout."""
    import torch

    cfg = model.config
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    rows = {  # module -> (attribute path in the decoder layer, first row in the fused weight)
        "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", q),
        "v_proj": ("self_attn.qkv_proj", q + kv), "o_proj": ("self_attn.o_proj", 0),
        "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", inter),
        "down_proj": ("mlp.down_proj", 0),
    }
    with torch.no_grad():
        for (layer, module), w in adapter.weights.items():
            path, row = rows[module]
            linear = model.layers[layer].get_submodule(path)
            delta = (w.b.float() @ w.a.float()).to(linear.weight.dtype)  # [out, in]
            linear.weight[row : row + delta.shape[0]] += delta


def child(config: str, model: str, adapter_dirs: list[str], requests: int, max_tokens: int) -> None:
    from inference.config import EngineConfig
    from inference.engine.llm_engine import LLMEngine
    from inference.engine.sampling_params import SamplingParams

    lora = dict(max_loras=8, max_cpu_loras=16, max_lora_rank=16) if config == "lora8" else dict(max_loras=0)
    engine = LLMEngine(EngineConfig(model=model, dtype="bfloat16", **lora), progress=False)
    names: list[str | None] = [None]
    if config == "lora8":
        names = []
        for path in adapter_dirs:
            engine.add_adapter(Path(path).name, path)
            names.append(Path(path).name)
    elif config == "merged8":
        import torch

        from inference.lora.adapter import load_adapter
        from inference.models.loader import load_model

        copies = []
        for path in adapter_dirs[1:]:
            copy = load_model(model, dtype=engine.dtype, progress=False)
            merge_into(copy, load_adapter(path, Path(path).name, copy.config, max_lora_rank=16, dtype=torch.float32))
            copies.append(copy)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[1 + (i * 7 + j) % 500 for j in range(32 + 8 * i)] for i in range(requests)]
    ids = [engine.add_request(p, params, lora=names[i % len(names)]) for i, p in enumerate(prompts)]
    done = engine.run_until_done(ids)
    errors = [o.error for o in done.values() if o.finish_reason == "error"]
    resident = [a.name for a in engine.list_adapters() if a.tier == "device"] if config == "lora8" else []
    print(json.dumps({
        "config": config, "peak_rss": peak_rss_bytes(), "memory_stats": engine.memory_stats(),
        "resident_on_device": len(resident), "errors": errors,
    }))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="8 requests, 4 output tokens")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
                    help="a subset to run (base is always run: the ratios are against it)")
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--adapters", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_tokens = 8, 4
    if args.child:
        child(args.child, args.model, args.adapters, args.requests, args.max_tokens)
        return

    from bench.lora_adapters import adapter_nbytes, base_config, write_random_adapters
    from bench.machine import machine_line

    cfg = base_config(args.model)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-lora-mem-") as tmp:
        dirs = [str(p) for p in write_random_adapters(Path(tmp), cfg, 8, rank=16)]
        print(machine_line())
        print(f"8 adapters, rank 16, all seven projections: {adapter_nbytes(cfg, 16) / 2**20:.1f} MiB each (bf16); "
              f"{args.requests} requests x {args.max_tokens} tokens per configuration")
        for config in [c for c in CONFIGS if c == "base" or c in args.configs]:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", config, "--model", args.model, "--requests", str(args.requests),
                 "--max-tokens", str(args.max_tokens), "--adapters", *dirs],
                capture_output=True, text=True,
            )
            if proc.returncode != 0:
                raise SystemExit(f"{config} failed:\n{proc.stderr[-3000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            results[config] = result
            mem = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in result["memory_stats"].items())
            print(f"  {config:<8} peak RSS {result['peak_rss'] / 2**20:8.1f} MiB   (memory_stats MiB: {mem}; "
                  f"adapters on device {result['resident_on_device']}, errors {len(result['errors'])})")
    base = results["base"]["peak_rss"]
    if "lora8" in results:
        print(f"\nratio lora8 / base   = {results['lora8']['peak_rss'] / base:.3f}   (goal <= 1.15)")
    if "merged8" in results:
        print(f"ratio merged8 / base = {results['merged8']['peak_rss'] / base:.3f}   "
              f"(8 weight copies, one KV cache; 8 real deployments would be ~8x base = "
              f"{8 * base / 2**30:.1f} GiB)")


if __name__ == "__main__":
    main()
