"""Our Llama against HF transformers loading the same checkpoint (the oracle), in float32.

Two checkpoints:
  - small random-weight HF Llamas written here with transformers (untied, tied, Llama 3.1 RoPE
    scaling, linear RoPE scaling with biases; all with a non-default rope_theta and GQA);
  - the SmolLM2-135M-Instruct Q4_1 GGUF, which transformers dequantizes itself.
For each: last-position logits close, and greedy decoding equal token for token.

Our model is driven the way the engine drives it: all prompts prefilled in one forward
pass, then one batched decode step per token, over a paged KV cache.
"""

from __future__ import annotations

import pytest
import torch

from inference.layers.linear import apply_plan
from inference.layers.matmul_plan import PATHS, forced_plan

from inference.models.llama import LlamaForCausalLM
from inference.models.loader import load_model
from tests.inference.models.tiny_llama import (
    LLAMA3_ROPE,
    NEW_TOKENS,
    greedy,
    tiny_prompts,
    until_stop,
    write_tiny_checkpoint,
)

# --- small random-weight HF checkpoints ---------------------------------------------------

VARIANTS = {
    "untied": dict(tie_word_embeddings=False),
    "tied": dict(tie_word_embeddings=True),
    "llama3_rope": dict(tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE),
    "linear_rope_bias": dict(
        tie_word_embeddings=False,
        rope_scaling=dict(rope_type="linear", factor=2.0),
        attention_bias=True,
        mlp_bias=True,
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_checkpoint_matches_transformers(variant, tmp_path):
    hf = write_tiny_checkpoint(tmp_path, **VARIANTS[variant])
    ours = load_model(tmp_path, dtype=torch.float32, progress=False)
    assert ours.config.tie_word_embeddings == VARIANTS[variant]["tie_word_embeddings"]
    prompts = tiny_prompts()

    tokens, logits = greedy(ours, prompts)
    with torch.inference_mode():
        ref_logits = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
        ref_tokens = [
            hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    diff = (logits - ref_logits).abs().max().item()
    print(f"\n[{variant}] max abs last-position logit diff vs transformers: {diff:.3g}")
    assert diff < 1e-4
    for ours_t, ref_t in zip(tokens, ref_tokens, strict=True):
        assert until_stop(ours_t, {2}) == ref_t


@pytest.mark.parametrize("path", PATHS)
def test_tiny_checkpoint_bfloat16_as_accurate_as_transformers(tmp_path, path):
    """The default dtype, on each matmul path the calibration may pick (forced here). bf16 rounds
    differently in every implementation, so the oracle is accuracy: our bf16 logits must be
    about as close to the fp32 truth as transformers' bf16."""
    hf = write_tiny_checkpoint(tmp_path)
    ours = load_model(tmp_path, dtype=torch.bfloat16, progress=False)
    apply_plan(ours, forced_plan(path, torch.bfloat16))
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    prompts = tiny_prompts()
    _, logits = greedy(ours, prompts, new_tokens=1)
    with torch.inference_mode():
        truth = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
        hf.to(torch.bfloat16)
        hf_bf16 = torch.stack([hf(torch.tensor([p])).logits[0, -1].float() for p in prompts])
    ours_err = (logits - truth).abs().max().item()
    hf_err = (hf_bf16 - truth).abs().max().item()
    print(
        f"\n[bf16 {path}] max abs logit error vs fp32: ours {ours_err:.3g}, transformers bf16 {hf_err:.3g}"
    )
    assert ours_err < 2 * hf_err
    assert logits.argmax(-1).tolist() == truth.argmax(-1).tolist()


# --- the SmolLM2 GGUF ---------------------------------------------------------------------

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
    "Give me a tip for staying focused while studying.",
    "Translate 'thank you very much' into German.",
    "Why is the sky blue? Answer briefly, then explain Rayleigh scattering in a few sentences, "
    "mentioning wavelength and the size of the molecules in the atmosphere.",
    "What is 17 times 23?",
]
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(question: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_path) -> LlamaForCausalLM:
    return load_model(smollm2_path, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def chat_prompts(hf_smollm2_tokenizer) -> list[list[int]]:
    return [hf_smollm2_tokenizer.encode(chatml(q), add_special_tokens=False) for q in QUESTIONS]


def test_smollm2_config_from_gguf(smollm2_ours):
    c = smollm2_ours.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (c.vocab_size, c.intermediate_size, c.head_dim, c.max_position_embeddings) == (
        49152,
        1536,
        64,
        8192,
    )
    assert c.tie_word_embeddings and smollm2_ours.lm_head is None
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)


def test_smollm2_logits_match_transformers(smollm2_ours, smollm2_hf, chat_prompts):
    prompts = chat_prompts[:3] + [[1, 504, 3458, 282]]  # chat prompts and a short raw one
    _, logits = greedy(smollm2_ours, prompts, new_tokens=1)
    with torch.inference_mode():
        ref = torch.stack([smollm2_hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    diff = (logits - ref).abs().max().item()
    print(f"\n[SmolLM2 Q4_1 GGUF] max abs last-position logit diff vs transformers: {diff:.3g}")
    assert diff < 1e-3


def test_smollm2_greedy_matches_transformers(
    smollm2_ours, smollm2_hf, chat_prompts, hf_smollm2_tokenizer
):
    tok = hf_smollm2_tokenizer
    ours, _ = greedy(smollm2_ours, chat_prompts)

    # the oracle: one left-padded batched generate
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in chat_prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chat_prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chat_prompts])
    with torch.inference_mode():
        out = smollm2_hf.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=pad,
        )[:, width:].tolist()

    stop = {smollm2_ours.config.eos_token_id}
    compared = sum(len(until_stop(ref, stop)) for ref in out)
    print(
        f"\n[SmolLM2 Q4_1 GGUF] greedy: {len(out)} chat prompts, {compared} generated tokens compared"
    )
    assert compared >= 8 * NEW_TOKENS * 3 // 4  # most answers run the full 32 tokens
    for i, (mine, ref) in enumerate(zip(ours, out, strict=True)):
        ref = until_stop(ref, stop)
        assert until_stop(mine, stop) == ref, (
            f"prompt {i}: {QUESTIONS[i]!r}\nours {tok.decode(mine)!r}\nhf   {tok.decode(ref)!r}"
        )
    assert len(ours) >= 8
