"""Llama for serving, gpt-fast style: read it top to bottom.

    input_ids [T] ─ embed ─▶ x [T, hidden]
        repeat num_hidden_layers:
            x = x + o_proj(attention(rope(q), rope(k), v))      q, k, v = qkv_proj(rmsnorm(x))
            x = x + down_proj(silu(gate) * up)                  gate, up = gate_up_proj(rmsnorm(x))
    rmsnorm(x) ─▶ hidden [T, hidden]        compute_logits: hidden [N, hidden] ─ lm_head ─▶ [N, vocab] fp32

T is every new token of every sequence in this step, flattened sequence after sequence (a
decode step contributes 1 token, a prefill chunk many). There is no batch dimension: which
token belongs to which sequence, and where its KV lives, is in `attn_meta` (see
inference/engine/attention.py).

Checkpoint conventions this file relies on (the loaders translate into them):
- q/k/v are one fused `qkv_proj` and gate/up one fused `gate_up_proj` (one matmul each);
- RoPE uses HF's rotate_half layout (first half / second half of each head), which is what HF
  checkpoints store; GGUF's interleaved Q/K row order is undone at load time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from inference.engine.attention import AttentionMetadata, paged_attention
from inference.models.config import LlamaConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, n_kv_heads, head_dim]


def _cpu_has_bf16_matmul() -> bool:
    try:  # oneDNN's bf16 kernels need AVX512-BF16 or AMX; torch routes bf16 matmul there if present
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


CPU_HAS_BF16_MATMUL = _cpu_has_bf16_matmul()
# Without bf16 units (AVX2 only) torch's bf16 GEMM runs 5-8x slower than fp32. A product of a
# few rows is bound by reading the weight, where bf16's half size wins; from this many rows on,
# the weight is upcast to fp32 a slab at a time (the slab stays in cache for its GEMM, so
# memory traffic stays that of bf16). Both paths accumulate in fp32 and round the result to bf16.
BF16_UPCAST_MIN_ROWS = 5
UPCAST_SLAB_ROWS = 512


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except multi-row bf16 products on CPUs without bf16 matmul units (see above)."""
    if upcasts_to_fp32(x):
        return linear_fp32(x.float(), weight, bias).to(x.dtype)
    return F.linear(x, weight, bias)


def upcasts_to_fp32(x: torch.Tensor) -> bool:
    """Whether `linear` computes this bf16 input in fp32 slabs (and rounds once at the end)."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and not CPU_HAS_BF16_MATMUL
        and x.shape[0] >= BF16_UPCAST_MIN_ROWS
    )


def linear_fp32(x32: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x32 [T, in] fp32 @ weight (any dtype, upcast a slab at a time).T -> [T, out] fp32, unrounded."""
    out = x32.new_empty(x32.shape[0], weight.shape[0])  # [T, out] fp32
    for i in range(0, weight.shape[0], UPCAST_SLAB_ROWS):
        slab = weight[i : i + UPCAST_SLAB_ROWS].float()  # [rows, in]
        torch.matmul(x32, slab.t(), out=out[:, i : i + UPCAST_SLAB_ROWS])
    if bias is not None:
        out += bias
    return out


class Linear(nn.Module):
    """y = x·Wᵀ (+ b), weight [out_features, in_features].

    The decoder's projections are all this module so the multi-LoRA layer can wrap each one
    (adding a per-token adapter delta). Fused projections list their slices in `output_sizes`
    (qkv_proj: [q, k, v]; gate_up_proj: [gate, up]) so an adapter per slice can be placed.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

        # Multi-LoRA hook (inference/lora/slots.py attaches one per projection): adds each
        # token's adapter delta into the output. None: no adapters, plain linear.
        self.lora = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        lora = self.lora if self.lora is not None and self.lora.active else None
        if lora is not None and upcasts_to_fp32(x):
            # bf16 on this CPU computes in fp32 anyway: add the adapters' delta to the fp32
            # product, in place, and round once (no second upcast of x, no [T, out] temporary).
            x32 = x.float()
            out32 = linear_fp32(x32, self.weight, self.bias)
            lora.apply(out32, x32)
            return out32.to(x.dtype)
        out = linear(x, self.weight, self.bias)
        if lora is not None:
            lora.apply(out, x)
        return out

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, output_sizes={self.output_sizes}, bias={self.bias is not None}"
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim]
        # Normalise in float32 and scale in the model dtype, as HF's LlamaRMSNorm does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


# --- rotary position embedding -------------------------------------------------------------


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, with the checkpoint's scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if config.rope_freq_factors is not None:
        # llama.cpp: theta_i = position * inv_freq_i / freq_factor_i
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    elif scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.rope_type == "llama3":
        inv_freq = _llama3_scaled(
            inv_freq,
            scaling.factor,
            scaling.low_freq_factor,
            scaling.high_freq_factor,
            scaling.original_max_position_embeddings,
        )
    return inv_freq


def _llama3_scaled(
    inv_freq: torch.Tensor, factor: float, low: float, high: float, old_context: int
) -> torch.Tensor:
    """Llama 3.1 frequency scaling.

    A frequency whose wavelength is longer than old_context/low is slowed by `factor`, one
    shorter than old_context/high is kept, and in between the two are blended linearly in
    old_context/wavelength (0 at the low edge, 1 at the high edge).
    """
    wavelen = 2 * math.pi / inv_freq
    blend = ((old_context / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0: slowed, 1: kept
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, scaled)
    return torch.where(wavelen < old_context / high, inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position < max_position_embeddings, computed once, gathered per step."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.reset_cache()

    def reset_cache(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the caches; the loader calls this after building the model on `meta`."""
        inv_freq = rope_inv_freq(self.config).to(device)  # [D/2]
        t = torch.arange(self.config.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [P, D]: rotate_half pairs i with i + D/2
        self.register_buffer("cos_cache", angles.cos(), persistent=False)  # [P, D] fp32
        self.register_buffer("sin_cache", angles.sin(), persistent=False)  # [P, D] fp32

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [T] -> cos, sin [T, 1, D] in the model dtype (broadcast over heads)
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D], cos/sin [T, 1, D]; rotate_half(x) = (-x[D/2:], x[:D/2])
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# --- the decoder ------------------------------------------------------------------------


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size,
            [config.q_size, config.kv_size, config.kv_size],
            bias=config.attention_bias,
        )
        self.o_proj = Linear(config.q_size, [config.hidden_size], bias=config.attention_bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        kv_cache: KVCache,
        attn_meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        Hq, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, Hq + 2 * Hkv, self.head_dim)  # [T, Hq + 2·Hkv, D]
        qk = apply_rope(qkv[:, : Hq + Hkv], cos, sin)  # q and k heads rotated in one go
        q, k = qk.split([Hq, Hkv], dim=1)  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, Hq + Hkv :]  # [T, Hkv, D]
        out = paged_attention(q, k, v, kv_cache, attn_meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, Hq * self.head_dim))  # [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, [inter, inter], bias=config.mlp_bias)
        self.down_proj = Linear(inter, [config.hidden_size], bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, inter] each
        return self.down_proj(F.silu(gate) * up)  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, kv_cache: KVCache, attn_meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(
            self.input_layernorm(x), cos, sin, kv_cache, attn_meta
        )  # [T, hidden]
        return x + self.mlp(self.post_attention_layernorm(x))  # [T, hidden]


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
        self.rotary = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_caches: list[KVCache],  # one (k, v) per layer
        attn_meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, x.dtype)  # [T, 1, D] each, shared by all layers
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, attn_meta)
        return self.norm(x)  # [T, hidden]

    def compute_logits(
        self, hidden: torch.Tensor
    ) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()
