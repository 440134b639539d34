"""Test helper: a LoRA adapter directory written by the real tools, byte for byte what a tenant
gets after training: the HF Trainer's save_model calls PEFT's PeftModel.save_pretrained
(adapter_config.json, adapter_model.safetensors and a README.md model card), then saves the
tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja) and torch.save()s its
TrainingArguments as training_args.bin, a pickle.

The model is a random Llama with the tests' tiny base shapes (peft_files.TINY), so the adapter
validates against it. torch, transformers and PEFT are imported here only (seconds, once per
process); build the directory once per module and copy files out of it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from tests.portal.adapters.peft_files import TINY

WRITTEN_BY_THE_TOOLS = {
    "adapter_config.json", "adapter_model.safetensors", "README.md",  # PeftModel.save_pretrained
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",  # the tokenizer's save_pretrained
    "training_args.bin",  # Trainer.save_model: torch.save(TrainingArguments), a pickle
}  # fmt: skip
PICKLE = "training_args.bin"


def write_trainer_output(out: Path, *, seed: int = 0) -> Path:
    """Train nothing, save everything: Trainer(model=PeftModel, processing_class=tokenizer).save_model(out)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation chatter between the libraries, not ours to fix
        _save(out, seed=seed)
    written = {p.name for p in out.iterdir()}
    # The tests prove less if the tools stop writing these; say so rather than pass quietly.
    assert WRITTEN_BY_THE_TOOLS <= written, f"the tools wrote {sorted(written)}"
    return out


def _save(out: Path, *, seed: int) -> None:
    import peft
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=TINY.hidden_size, intermediate_size=TINY.intermediate_size,
        num_attention_heads=TINY.num_attention_heads, num_key_value_heads=TINY.num_key_value_heads,
        head_dim=TINY.head_dim, num_hidden_layers=TINY.num_hidden_layers, vocab_size=32,
    )  # fmt: skip
    base = transformers.LlamaForCausalLM(config)
    # init_lora_weights=False: lora_B random too (PEFT's default zeros would make a no-op adapter).
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                           init_lora_weights=False)
    model = peft.get_peft_model(base, lora)

    vocab = {"<unk>": 0, "<eos>": 1, **{chr(97 + i): i + 2 for i in range(26)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<eos>{% endfor %}"

    args = transformers.TrainingArguments(output_dir=str(out), report_to=[], use_cpu=True)
    transformers.Trainer(model=model, args=args, processing_class=tokenizer).save_model(str(out))
