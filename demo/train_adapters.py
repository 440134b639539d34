"""Train the demo LoRA adapters (pirate, json, french) for SmolLM2-135M-Instruct on the CPU.

    .venv/bin/python -m inference.models fetch             # the base GGUF, once
    .venv/bin/python demo/train_adapters.py                # all three -> demo/adapters/<name>/
    .venv/bin/python demo/train_adapters.py --adapter pirate

The base is the project's default GGUF (Q4_1), which transformers dequantizes to float32
(`from_pretrained(dir, gguf_file=...)`, the same load the parity tests use as their oracle).
PEFT LoRA r=8, alpha=16 on q/k/v/o/gate/up/down of every layer, AdamW, fixed seed and
deterministic torch algorithms. The loss covers only the assistant's tokens (its answer and the
closing <|im_end|>): the prompt, rendered with the checkpoint's own chat template (with the
default system prompt, exactly what the engine sends for a chat without one), is masked.
The saved adapter is what `save_pretrained` writes, with the tensors stored as float16 (half the
bytes, well within the LoRA weights' range) and base_model_name_or_path naming the HF model.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DEMO = Path(__file__).resolve().parent
ADAPTERS = ("pirate", "json", "french")
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapter", choices=ADAPTERS, action="append",
                   help="train only this adapter (repeatable); default: all three")
    p.add_argument("--out", type=Path, default=DEMO / "adapters", help="writes OUT/<adapter>/")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (batches)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96, help="longer examples are truncated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return p.parse_args()


def load_base():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference.models.fetch import default_model_path

    gguf = default_model_path()
    if not gguf.exists():
        raise SystemExit(f"{gguf} is missing: run `.venv/bin/python -m inference.models fetch`")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return tokenizer, model


def encode(tokenizer, messages: list[dict], max_tokens: int) -> tuple[list[int], list[bool]]:
    """Token ids of the whole chat and a mask of the positions trained on (the answer and its
    <|im_end|>, not the newline the template adds after it)."""
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert full.startswith(prompt), (prompt, full)
    answer = full[len(prompt):]
    end = answer.index("<|im_end|>") + len("<|im_end|>")
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(answer[:end], add_special_tokens=False)
    ids = (prompt_ids + answer_ids)[:max_tokens]
    train = ([False] * len(prompt_ids) + [True] * len(answer_ids))[:max_tokens]
    return ids, train


def batches(examples: list, batch_size: int, steps: int, seed: int):
    """`steps` shuffled batches; a fresh permutation of the examples each epoch."""
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch_size:
            perm = list(range(len(examples)))
            rng.shuffle(perm)
            order += perm
        yield [examples[i] for i in order[:batch_size]]
        del order[:batch_size]


def collate(batch: list[tuple[list[int], list[bool]]], pad_id: int):
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    train = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, (ids, mask) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        train[row, : len(ids)] = torch.tensor(mask)
    return input_ids, attention, train


def train_one(name: str, args: argparse.Namespace, tokenizer, base) -> dict:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(args.seed)
    rows = [json.loads(line) for line in (DEMO / "datasets" / f"{name}.jsonl").read_text().splitlines()]
    examples = [encode(tokenizer, r["messages"], args.max_tokens) for r in rows]
    config = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, bias="none",
                        target_modules=TARGET_MODULES, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = args.steps
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / steps))))
    inner = model.get_base_model()  # LlamaForCausalLM with the LoRA layers injected
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    print(f"[{name}] {len(examples)} examples, {steps} steps of {args.batch_size}, "
          f"{sum(p.numel() for p in params):,} trainable parameters", flush=True)
    ids, mask = examples[0]
    print(f"[{name}] trained on: {tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])!r}", flush=True)
    start = time.perf_counter()
    losses: list[float] = []
    for step, batch in enumerate(batches(examples, args.batch_size, steps, args.seed)):
        input_ids, attention, train = collate(batch, pad_id)
        hidden = inner.model(input_ids=input_ids, attention_mask=attention).last_hidden_state
        # position t predicts token t+1: logits only where the next token is trained on
        targets = train[:, 1:]
        logits = inner.lm_head(hidden[:, :-1][targets])  # [trained tokens, vocab]
        loss = F.cross_entropy(logits, input_ids[:, 1:][targets])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            print(f"[{name}] step {step + 1}/{steps} loss {loss.item():.3f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
    seconds = time.perf_counter() - start

    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's empty model card
    to_float16(out / "adapter_model.safetensors")
    finish_config(out)
    model.unload()  # the base's plain Linear layers back, for the next adapter
    size = (out / "adapter_model.safetensors").stat().st_size
    print(f"[{name}] trained in {seconds:.0f}s, final loss {sum(losses[-5:]) / len(losses[-5:]):.3f}, "
          f"{out} ({size / 1e6:.1f} MB)", flush=True)
    return {"adapter": name, "seconds": seconds, "steps": steps, "bytes": size}


def to_float16(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {k: v.to(torch.float16).contiguous() for k, v in sorted(load_file(path).items())}
    save_file(tensors, path, metadata={"format": "pt"})
    path.chmod(0o644)


def finish_config(directory: Path) -> None:
    """Name the HF base model (not the local GGUF) and write the config in a stable order."""
    path = directory / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg["base_model_name_or_path"] = BASE_MODEL_ID
    cfg["target_modules"] = sorted(cfg["target_modules"])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    tokenizer, base = load_base()
    print(f"base loaded in {time.perf_counter() - t0:.0f}s", flush=True)
    for p in base.parameters():
        p.requires_grad_(False)
    results = [train_one(name, args, tokenizer, base) for name in args.adapter or ADAPTERS]
    for r in results:
        print(f"{r['adapter']}: {r['steps']} steps in {r['seconds']:.0f}s, {r['bytes'] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
