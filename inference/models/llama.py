"""Llama for serving, gpt-fast style: read it top to bottom.

    input_ids [T] ─ embed ─▶ x [T, hidden]
        repeat num_hidden_layers:
            x = x + o_proj(attention(rope(q), rope(k), v))      q, k, v = qkv_proj(rmsnorm(x))
            x = x + down_proj(silu(gate) * up)                  gate, up = gate_up_proj(rmsnorm(x))
    rmsnorm(x) ─▶ hidden [T, hidden]        compute_logits: hidden [N, hidden] ─ lm_head ─▶ [N, vocab] fp32

T is every new token of every sequence in this step, flattened sequence after sequence (a
decode step contributes 1 token, a prefill chunk many). There is no batch dimension: which
token belongs to which sequence, and where its KV lives, is in `attn_meta`; which adapter
slot each token uses is in `lora_meta` (None: no token of the step has an adapter). The
engine builds both once per step (inference/engine/model_runner.py).

The four projections of each layer are LoRALinear: with LoRA enabled each adds its tokens'
adapter deltas (inference/layers/lora_linear.py); `slice_names` are the PEFT modules of their
output slices. The building blocks are in inference/layers/.

Checkpoint conventions this file relies on (the loaders translate into them at load time):
- q/k/v are one fused `qkv_proj` and gate/up one fused `gate_up_proj` (one matmul each);
- RoPE uses HF's rotate_half layout (first half / second half of each head), which is what HF
  checkpoints store; GGUF's interleaved Q/K row order is undone at load time.
"""

from __future__ import annotations

import torch
from torch import nn

from inference.layers.activation import silu_mul
from inference.layers.attention import KVCache, paged_attention
from inference.layers.attention_metadata import AttentionMetadata
from inference.layers.linear import DEFAULT_PLAN, Linear, linear
from inference.layers.lora_linear import LoRALinear
from inference.layers.norm import RMSNorm
from inference.layers.quantized import PackedWeight
from inference.layers.rotary import RotaryEmbedding, rope_heads
from inference.models.config import LlamaConfig
from kernels.metadata import LoRABatchMetadata


class LlamaForCausalLM(nn.Module):
    """State dict names (what the loaders produce):

    embed_tokens.weight                                [vocab, hidden]
    layers.N.input_layernorm.weight                    [hidden]
    layers.N.self_attn.qkv_proj.weight                 [(Hq + 2·Hkv)·D, hidden]   (+ .bias)
    layers.N.self_attn.o_proj.weight                   [hidden, Hq·D]             (+ .bias)
    layers.N.post_attention_layernorm.weight           [hidden]
    layers.N.mlp.gate_up_proj.weight                   [2·inter, hidden]          (+ .bias)
    layers.N.mlp.down_proj.weight                      [hidden, inter]            (+ .bias)
    norm.weight                                        [hidden]
    lm_head.weight                                     [vocab, hidden]  (untied only)
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied checkpoints reuse the embedding matrix; no second parameter to keep in sync.
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, [config.vocab_size])
        )
        # --weights-dtype int8/int4: the head's quantised weight (inference/models/quantize.py)
        self.lm_head_packed: PackedWeight | None = None
        self.rotary = RotaryEmbedding(
            head_dim=config.head_dim,
            max_positions=config.max_position_embeddings,
            theta=config.rope_theta,
            scaling=config.rope_scaling,
            freq_factors=config.rope_freq_factors,
        )
        self.plan = DEFAULT_PLAN  # the engine's measured plan, set by layers.linear.apply_plan

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_caches: list[KVCache],  # one (k, v) per layer
        attn_meta: AttentionMetadata,
        lora_meta: LoRABatchMetadata | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, x.dtype)  # [T, 1, D] each, shared by all layers
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, attn_meta, lora_meta)  # [T, hidden]
        return self.norm(x)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [N, hidden] -> logits [N, vocab] fp32
        if self.lm_head_packed is not None:
            return self.lm_head_packed.linear(hidden).float()
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return linear(hidden, self.embed_tokens.weight, plan=self.plan).float()


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        kv_cache: KVCache,
        attn_meta: AttentionMetadata,
        lora_meta: LoRABatchMetadata | None,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn_meta, lora_meta)
        x, h = self.post_attention_layernorm.add_and_norm(x, attn)  # x + attn, and its norm [T, hidden]
        return x + self.mlp(h, lora_meta)  # [T, hidden]


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = LoRALinear(
            config.hidden_size,
            [config.q_size, config.kv_size, config.kv_size],
            slice_names=("q_proj", "k_proj", "v_proj"),
            bias=config.attention_bias,
        )
        self.o_proj = LoRALinear(
            config.q_size, [config.hidden_size], slice_names=("o_proj",), bias=config.attention_bias
        )

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        kv_cache: KVCache,
        attn_meta: AttentionMetadata,
        lora_meta: LoRABatchMetadata | None,
    ) -> torch.Tensor:
        T = x.shape[0]
        Hq, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x, lora_meta).view(T, Hq + 2 * Hkv, self.head_dim)  # [T, Hq + 2·Hkv, D]
        qk = rope_heads(qkv, cos, sin, Hq + Hkv)  # q and k heads rotated in one go
        q, k = qk.split([Hq, Hkv], dim=1)  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, Hq + Hkv :]  # [T, Hkv, D]
        out = paged_attention(q, k, v, kv_cache, attn_meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, Hq * self.head_dim), lora_meta)  # [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = LoRALinear(
            config.hidden_size,
            [inter, inter],
            slice_names=("gate_proj", "up_proj"),
            bias=config.mlp_bias,
        )
        self.down_proj = LoRALinear(
            inter, [config.hidden_size], slice_names=("down_proj",), bias=config.mlp_bias
        )

    def forward(
        self, x: torch.Tensor, lora_meta: LoRABatchMetadata | None
    ) -> torch.Tensor:  # [T, hidden]
        gate_up = self.gate_up_proj(x, lora_meta)  # [T, 2 * inter]
        return self.down_proj(silu_mul(gate_up), lora_meta)  # [T, hidden]
