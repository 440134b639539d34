"""Test helpers: LoRA adapters written by PEFT itself (`save_pretrained`) on a tiny random HF
Llama, and the matching LlamaConfig of ours. Import as `tests.inference.lora.peft_adapters`."""

from __future__ import annotations

from pathlib import Path

import torch

from inference.models.config import LlamaConfig
from tests.inference.models.tiny_llama import TINY, write_tiny_checkpoint, write_word_tokenizer

# What PEFT records as the base when the adapter was trained on the default model, and the
# default GGUF's general.name (what LlamaConfig.name holds when that model is served).
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SERVED_NAME = "Smollm2 135M 8k Lc100K Mix1 Ep2"


def tiny_hf_model(seed: int = 0):
    """A random fp32 transformers LlamaForCausalLM with the TINY shapes (3 layers, hidden 64)."""
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()


def tiny_config(name: str = SERVED_NAME) -> LlamaConfig:
    """Our LlamaConfig for the TINY shapes, named like the served default model."""
    return LlamaConfig.from_hf_dict(tiny_hf_model().config.to_dict(), name=name)


def write_peft_adapter(path: Path, seed: int = 1, **lora_kwargs):
    """Wrap a fresh tiny base with PEFT LoRA (init_lora_weights=False: A and B both random, so
    every delta is non-zero), save it to `path` with save_pretrained; return the PeftModel."""
    from peft import LoraConfig, get_peft_model

    model = tiny_hf_model()
    model.name_or_path = BASE_MODEL_ID  # what from_pretrained(BASE_MODEL_ID) sets; PEFT saves it
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    peft_model.eval()
    # save_embedding_layers=False: "auto" would ask the Hub whether the base's vocabulary changed
    peft_model.save_pretrained(path, save_embedding_layers=False)
    return peft_model


def peft_lora_module(peft_model, layer: int, module: str):
    """PEFT's LoRA-wrapped module for (layer, module), or None when PEFT did not wrap it."""
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    decoder = peft_model.base_model.model.model.layers[layer]
    wrapped = getattr(getattr(decoder, parent), module)
    return wrapped if hasattr(wrapped, "lora_A") else None


# Named like the model the adapters record as their base, so a different model is recognised.
BASE_DIR = "SmolLM2-135M-Instruct"


def write_base_and_adapters(root: Path, names, first_seed: int, **lora_kwargs) -> Path:
    """root/BASE_DIR: the tiny checkpoint with a word tokenizer (prompts as token ids); root/<name>:
    a PEFT adapter per name, seeds first_seed, first_seed + 1, ... Returns root."""
    hf = write_tiny_checkpoint(root / BASE_DIR)
    write_word_tokenizer(root / BASE_DIR, hf.config.vocab_size)
    for i, name in enumerate(names):
        write_peft_adapter(root / name, seed=first_seed + i, **lora_kwargs)
    return root
