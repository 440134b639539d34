"""Test helper: a tiny random HF Llama checkpoint with a word-level tokenizer ("t0".."t299", one
word per id) and PEFT adapters saved by PEFT itself. Import as `tests.inference.server.tiny_lora`."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.inference.models.tiny_llama import write_tiny_checkpoint

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig kwargs: different ranks and targets, so every adapter changes the output.
ADAPTERS = {
    f"ad{i}": dict(r=4 + 2 * (i % 3), lora_alpha=16, target_modules=ALL if i % 2 else ["q_proj", "v_proj", "down_proj"])
    for i in range(8)
}


def write_base(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = write_tiny_checkpoint(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(hf.config.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def write_adapters(base: Path, root: Path) -> dict[str, Path]:
    """Every adapter of ADAPTERS under root/NAME, plus root/bad_nan (a NaN in its weights)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    out = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        model = transformers.LlamaForCausalLM.from_pretrained(base).eval()
        torch.manual_seed(100 + i)
        peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **kwargs))
        peft_model.save_pretrained(root / name, save_embedding_layers=False)
        out[name] = root / name
    shutil.copytree(root / "ad0", root / "bad_nan")
    weights = root / "bad_nan" / "adapter_model.safetensors"
    tensors = load_file(weights)
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    out["bad_nan"] = root / "bad_nan"
    return out


def word_prompt(seed: int, length: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"t{i}" for i in torch.randint(3, 300, (length,), generator=g).tolist())
