"""LlamaConfig: the shape and numerics of a Llama-architecture checkpoint.

One frozen, validated dataclass built from either source we load:

    LlamaConfig.from_hf_dict(json.load(open("config.json")), name="my-model")
    LlamaConfig.from_gguf_metadata({"general.architecture": "llama", "llama.block_count": 30, ...})

RoPE variants (`rope_scaling`, a RopeScaling; `rope_freq_factors`, GGUF only) are described
in inference/layers/rope_scaling.py (inference/layers/rotary.py implements them). Anything else (dynamic NTK, YaRN, ...)
is rejected with a ValueError naming it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from inference.layers.rope_scaling import RopeScaling

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # [head_dim // 2], llama.cpp divisors
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v/o projections carry a bias
    mlp_bias: bool = False  # gate/up/down projections carry a bias
    bos_token_id: int | None = None
    eos_token_id: int | None = None  # the first (primary) end-of-sequence id
    eos_token_ids: tuple[int, ...] = field(
        default=()
    )  # every end-of-sequence id (Llama 3 has several)
    name: str = "llama"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (isinstance(self.rms_norm_eps, float) and self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be a float > 0, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, float) and self.rope_theta > 1):
            raise ValueError(f"rope_theta must be a float > 1, got {self.rope_theta!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
            )
        if self.rope_freq_factors is not None:
            if len(self.rope_freq_factors) != self.head_dim // 2:
                raise ValueError(
                    f"rope_freq_factors must have head_dim // 2 = {self.head_dim // 2} entries, "
                    f"got {len(self.rope_freq_factors)}"
                )
            if not all(math.isfinite(f) and f > 0 for f in self.rope_freq_factors):
                raise ValueError("rope_freq_factors must all be finite and > 0")
            if self.rope_scaling is not None:
                raise ValueError("rope_freq_factors and rope_scaling cannot both be set")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value < self.vocab_size):
                raise ValueError(
                    f"{name} must be in [0, vocab_size={self.vocab_size}), got {value!r}"
                )
        for value in self.eos_token_ids:
            if not (isinstance(value, int) and 0 <= value < self.vocab_size):
                raise ValueError(
                    f"eos_token_ids: {value!r} is not in [0, vocab_size={self.vocab_size})"
                )
        if (
            self.eos_token_id is not None
            and self.eos_token_ids
            and self.eos_token_id not in self.eos_token_ids
        ):
            raise ValueError(
                f"eos_token_id {self.eos_token_id} must be one of eos_token_ids {self.eos_token_ids}"
            )

    # --- derived sizes -------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    # --- builders ------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], name: str = "llama") -> LlamaConfig:
        """Build from an HF `config.json` dict (transformers 4 or 5 layout)."""
        architectures = d.get("architectures") or []
        model_type = d.get("model_type")
        if architectures:
            unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
            if unsupported:
                raise ValueError(
                    f"architectures: unsupported {unsupported} (supported: {list(SUPPORTED_ARCHITECTURES)})"
                )
        elif model_type != "llama":
            raise ValueError(f"model_type: unsupported {model_type!r} (supported: 'llama')")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: unsupported {d['hidden_act']!r} (supported: 'silu')")
        if d.get("pretraining_tp", 1) not in (None, 1):
            raise ValueError(f"pretraining_tp: unsupported {d['pretraining_tp']!r} (supported: 1)")
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if key not in d:
                raise ValueError(f"{key}: missing from config.json")

        rope_params = d.get("rope_parameters")  # transformers 5 keeps theta and scaling here
        if isinstance(rope_params, Mapping) and "rope_theta" in rope_params:
            rope_theta = rope_params["rope_theta"]
        else:
            rope_theta = d.get("rope_theta", 10000.0)
        rope_scaling = RopeScaling.from_hf(d.get("rope_scaling") or rope_params)

        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or _divide("hidden_size", d["hidden_size"], heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_ids[0] if eos_ids else None,
            eos_token_ids=eos_ids,
            name=name,
        )

    @classmethod
    def from_gguf_metadata(
        cls,
        meta: Mapping[str, Any],
        *,
        tie_word_embeddings: bool,
        name: str | None = None,
        rope_freq_factors: tuple[float, ...] | None = None,
    ) -> LlamaConfig:
        """Build from a GGUF file's key/value metadata (plain Python values).

        GGUF has no tie flag: the embedding is tied when the file has no `output.weight`,
        which the caller knows from the tensor list. `tokenizer.ggml.tokens` may be the
        token list or just its length.
        """
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"general.architecture: unsupported {arch!r} (supported: 'llama')")

        def need(key: str) -> Any:
            if key not in meta:
                raise ValueError(f"{key}: missing from the GGUF metadata")
            return meta[key]

        hidden = int(need("llama.embedding_length"))
        heads = int(need("llama.attention.head_count"))
        kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
        head_dim = int(
            meta.get("llama.attention.key_length")
            or _divide("llama.embedding_length", hidden, heads)
        )
        rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise ValueError(
                f"llama.rope.dimension_count: partial RoPE ({rope_dim} of {head_dim}) is not supported"
            )

        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = meta.get("llama.vocab_size")
        if vocab is None and tokens is not None:
            vocab = tokens if isinstance(tokens, int) else len(tokens)
        if vocab is None:
            raise ValueError("llama.vocab_size: missing (and no tokenizer.ggml.tokens to count)")

        scaling_type = meta.get("llama.rope.scaling.type", "none")
        rope_scaling: RopeScaling | None = None
        if scaling_type == "linear":
            rope_scaling = RopeScaling("linear", float(need("llama.rope.scaling.factor")))
        elif scaling_type not in ("none", None):
            raise ValueError(
                f"llama.rope.scaling.type: unsupported {scaling_type!r} (supported: none, linear)"
            )

        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = (int(eos),) if eos is not None else ()
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("llama.feed_forward_length")),
            num_hidden_layers=int(need("llama.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(need("llama.attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            rope_freq_factors=rope_freq_factors,
            max_position_embeddings=int(need("llama.context_length")),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=eos_ids[0] if eos_ids else None,
            eos_token_ids=eos_ids,
            name=name or str(meta.get("general.name") or "llama"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _divide(field_name: str, numerator: int, heads: int) -> int:
    if numerator % heads:
        raise ValueError(f"{field_name} ({numerator}) is not divisible by the head count ({heads})")
    return numerator // heads
