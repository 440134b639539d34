"""Test helpers: small random-weight Llama checkpoints written with transformers (and turned
into GGUF files the way llama.cpp's converter lays them out), and a greedy driver for our
model that runs it the way the engine does.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from inference.layers.attention import allocate_kv_cache
from inference.layers.attention_metadata import build_attention_metadata
from inference.models.llama import LlamaForCausalLM

BLOCK = 16
NEW_TOKENS = 32

TINY = dict(
    hidden_size=64,
    intermediate_size=192,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=3,
    vocab_size=300,
    rope_theta=5000.0,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.2,  # logits spread enough that greedy has clear winners
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,  # small, so every band of frequencies occurs
)
TINY_PROMPT_LENS = [5, 17, 40, 1]


def write_tiny_checkpoint(path: Path, seed: int = 0, **overrides):
    """A random HF Llama saved as safetensors in `path`; returns the transformers model (fp32, eval)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TINY, **overrides})
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: make every tensor matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


def tiny_prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in TINY_PROMPT_LENS]


# --- GGUF, laid out like llama.cpp's convert_hf_to_gguf.py ------------------------------------

_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, HF row (half h, index i) goes to row 2i + h."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_freq_factors(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs` for Llama 3.1 scaling: divisors of each frequency."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(
    hf_model, path: Path, matrix_type: str = "F32", types: dict[str, str] | None = None
) -> Path:
    """Write `hf_model` as a llama GGUF: matrices stored as `matrix_type` (or `types[gguf_name]`),
    norms F32, Q/K rows permuted, `rope_freqs` for Llama 3.1 scaling, no `output` when tied."""
    import gguf

    c = hf_model.config
    rope = getattr(c, "rope_parameters", None) or {}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", TINY["rope_theta"])))
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor(
            "rope_freqs.weight", llama3_rope_freq_factors(c.head_dim, rope["rope_theta"], rope)
        )

    for name, tensor in hf_model.state_dict().items():
        w = tensor.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            out = "output.weight"
        else:  # model.layers.N.<module>.weight
            parts = name.split(".")
            module = ".".join(parts[3:-1])
            out = f"blk.{parts[2]}.{_GGUF_LAYER_NAMES[module]}.{parts[-1]}"
            if module == "self_attn.q_proj":
                w = llama_cpp_permute(w, c.num_attention_heads)
            elif module == "self_attn.k_proj":
                w = llama_cpp_permute(w, c.num_key_value_heads)
        qtype = (types or {}).get(out, matrix_type) if w.ndim == 2 else "F32"
        if qtype == "F32":
            writer.add_tensor(out, w)
        else:
            t = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(out, gguf.quants.quantize(w, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- driving our model -------------------------------------------------------------------


@torch.inference_mode()
def greedy(model: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int = NEW_TOKENS):
    """Greedy-decode every prompt in one batch -> (generated ids per prompt, first-step logits [S, V]).

    Each sequence owns a run of consecutive blocks (handed out back to front, so tables are
    not in block order); one prefill of all prompts, then one decode step per new token.
    """
    dtype = model.embed_tokens.weight.dtype
    blocks_per_seq = [-(-(len(p) + new_tokens) // BLOCK) for p in prompts]
    num_blocks = sum(blocks_per_seq)
    c = model.config
    kv_caches = allocate_kv_cache(
        num_layers=c.num_hidden_layers, num_blocks=num_blocks, block_size=BLOCK,
        num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=dtype,
    )  # fmt: skip
    tables, next_block = [], num_blocks
    for n in blocks_per_seq:
        next_block -= n
        tables.append(list(range(next_block, next_block + n)))

    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    meta = build_attention_metadata(lens, lens, tables, BLOCK)
    hidden = model(ids, positions, kv_caches, meta)  # [sum(lens), hidden]
    last_rows = torch.tensor(lens).cumsum(0) - 1
    first_logits = model.compute_logits(hidden[last_rows])  # [S, vocab]
    token = first_logits.argmax(-1)  # [S]
    out = [token]
    for _ in range(new_tokens - 1):
        positions = torch.tensor(lens)  # the new token's position = tokens before it
        lens = [n + 1 for n in lens]
        meta = build_attention_metadata(lens, [1] * len(lens), tables, BLOCK)
        hidden = model(token, positions, kv_caches, meta)  # [S, hidden]
        token = model.compute_logits(hidden).argmax(-1)
        out.append(token)
    return torch.stack(out, dim=1).tolist(), first_logits


def until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    """The tokens up to and including the first stop token (HF generate stops there)."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """tokenizer.json for a checkpoint whose prompts are given as token ids: one word per id."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
