"""GGUF file -> LlamaConfig + our state dict.

The header is read with inference/models/gguf_metadata.py (gguf.GGUFReader took 2-5 s of
every engine's start parsing the vocabulary's strings into numpy views); the tensors stay in
the memory-mapped file and are dequantized with `gguf.quants.dequantize` to float32 one at a
time (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_x and the K-quants; whatever the `gguf` package can
dequantize), then cast to the model dtype.

Names (llama.cpp -> ours, N = layer):
    token_embd.weight            embed_tokens.weight
    blk.N.attn_norm.weight       layers.N.input_layernorm.weight
    blk.N.attn_q/k/v.weight      layers.N.self_attn.qkv_proj.weight   (fused, Q/K un-permuted)
    blk.N.attn_output.weight     layers.N.self_attn.o_proj.weight
    blk.N.ffn_norm.weight        layers.N.post_attention_layernorm.weight
    blk.N.ffn_gate/up.weight     layers.N.mlp.gate_up_proj.weight     (fused)
    blk.N.ffn_down.weight        layers.N.mlp.down_proj.weight
    output_norm.weight           norm.weight
    output.weight                lm_head.weight   (absent: tied to token_embd)
    rope_freqs.weight            config.rope_freq_factors (Llama 3.1 files)

llama.cpp's converter reorders the rows of Q and K for its RoPE, which rotates adjacent pairs
(x0, x1), (x2, x3)... where HF's rotate_half pairs x_i with x_{i+D/2}. Within each head it
writes HF row (half h, index i) at position 2i + h. We put the rows back so the model keeps
HF's convention.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from inference.models.config import LlamaConfig
from inference.models.gguf_metadata import GGUFTensorInfo, read_gguf_header
from inference.models.gguf_quants import INT4_TYPES, int4_groups
from inference.models.weights import SourceNames, load_plan

GGUF_NAMES = SourceNames(
    embed="token_embd.weight",
    norm="output_norm.weight",
    lm_head="output.weight",
    attn_norm="blk.{i}.attn_norm.weight",
    q="blk.{i}.attn_q.weight",
    k="blk.{i}.attn_k.weight",
    v="blk.{i}.attn_v.weight",
    o="blk.{i}.attn_output.weight",
    mlp_norm="blk.{i}.ffn_norm.weight",
    gate="blk.{i}.ffn_gate.weight",
    up="blk.{i}.ffn_up.weight",
    down="blk.{i}.ffn_down.weight",
)
ROPE_FREQS = "rope_freqs.weight"

# The element types stored as plain arrays; every other type is read as its blocks' bytes
# (what gguf.quants.dequantize takes, as GGUFReader hands them out)
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip

# Metadata the config is made from (the token list only counted).
_CONFIG_KEYS = (
    "general.architecture",
    "general.name",
    "llama.vocab_size",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.block_count",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.key_length",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "llama.rope.dimension_count",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
)


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order. w: [n_heads·D, in] or a bias [n_heads·D]."""
    rest = w.shape[1:]
    head_dim = w.shape[0] // n_heads
    # GGUF row 2i + h of a head holds HF row h·D/2 + i
    return w.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def tensor_view(mapped: np.ndarray, info: GGUFTensorInfo, endian: str) -> np.ndarray:
    """A tensor's bytes in its mapped file (`mapped`: the whole file as uint8), viewed as
    GGUFReader views them: plain types as their elements in PyTorch's shape (byte-swapped where
    the file is big-endian, `endian` ">"), block types as [..., bytes of a row's blocks]."""
    # a plain ndarray view: numpy's memmap subclass costs a Python call on every slice of it
    raw = mapped[info.offset : info.offset + info.nbytes].view(np.ndarray)
    plain = _PLAIN_DTYPES.get(info.type)
    if plain is not None:
        return raw.view(np.dtype(plain).newbyteorder(endian)).reshape(info.shape)
    return raw.reshape(quant_shape_to_byte_shape(info.shape, info.type))


class GGUFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            header = read_gguf_header(self.path)  # bad magic, truncated header or data: ValueError
            self._file = np.memmap(self.path, dtype=np.uint8, mode="r")  # the tensors' bytes, mapped
        except (ValueError, OSError) as e:
            raise ValueError(f"{self.path}: not a readable GGUF file ({e})") from e
        self._endian = header.endian
        self.tensors: dict[str, GGUFTensorInfo] = header.tensors
        meta = self._metadata(header.metadata)
        freq_factors = None
        if ROPE_FREQS in self.tensors:
            freq_factors = tuple(float(f) for f in self._read(ROPE_FREQS).reshape(-1))
        try:
            self.config = LlamaConfig.from_gguf_metadata(
                meta,
                tie_word_embeddings=GGUF_NAMES.lm_head not in self.tensors,
                rope_freq_factors=freq_factors,
            )
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from e
        self.plan = load_plan(self.config, GGUF_NAMES)
        used = {s for sources in self.plan.values() for s in sources} | {ROPE_FREQS}
        unexpected = sorted(set(self.tensors) - used)
        if unexpected:
            raise ValueError(
                f"{self.path}: unexpected tensors {unexpected[:5]} ({len(unexpected)} in all)"
            )

    @property
    def num_tensors(self) -> int:
        """Source tensors `load_state_dict` reads (for progress bars)."""
        return sum(len(sources) for sources in self.plan.values())

    @staticmethod
    def _metadata(fields: dict[str, Any]) -> dict[str, Any]:
        meta = {key: fields[key] for key in _CONFIG_KEYS if key in fields}
        if "tokenizer.ggml.tokens" in fields:
            meta["tokenizer.ggml.tokens"] = len(fields["tokenizer.ggml.tokens"])
        return meta

    def _data(self, info: GGUFTensorInfo) -> np.ndarray:
        return tensor_view(self._file, info, self._endian)

    def _read(self, name: str) -> torch.Tensor:
        """One tensor, dequantized to float32, in PyTorch's [out, in] order."""
        info = self.tensors.get(name)
        if info is None:
            raise ValueError(f"{self.path}: tensor {name!r} is missing")
        try:
            values = dequantize(self._data(info), info.type)
        except NotImplementedError as e:
            raise ValueError(f"{self.path}: tensor {name!r}: {e}") from e
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(info.shape))

    def read_int4_groups(self, ours: str) -> tuple[torch.Tensor, ...] | None:
        """Our weight `ours` as int4 groups taken from the file's Q4_0/Q4_1 blocks as they are:
        (q [out, in] uint8 0..15, scale [out, in/32] f32, zero [out, in/32] f32), fused and
        Q/K-unpermuted like `load_state_dict`; None unless every source tensor is 4-bit."""
        sources = {s: self.tensors[s] for s in self.plan[ours]}
        if not all(t.type in INT4_TYPES for t in sources.values()):
            return None
        heads = {"attn_q": self.config.num_attention_heads, "attn_k": self.config.num_key_value_heads}
        parts = []
        for name, t in sources.items():
            rows, cols = t.shape
            groups = int4_groups(self._data(t), t.type, rows, cols)
            role = name.split(".")[2] if name.startswith("blk.") else ""
            if role in heads:  # rows move whole: a row's groups go with it
                groups = tuple(unpermute_qk(g, heads[role]) for g in groups)
            parts.append(groups)
        return tuple(torch.cat(column, dim=0) for column in zip(*parts, strict=True))

    def load_state_dict(
        self, dtype: torch.dtype, on_tensor: Callable[[str], None] = lambda name: None
    ) -> dict[str, torch.Tensor]:
        heads = {
            "attn_q": self.config.num_attention_heads,
            "attn_k": self.config.num_key_value_heads,
        }
        state: dict[str, torch.Tensor] = {}
        for ours, sources in self.plan.items():
            parts = []
            for source in sources:
                w = self._read(source)
                role = (
                    source.split(".")[2] if source.startswith("blk.") else ""
                )  # blk.N.attn_q.weight
                if role in heads:
                    w = unpermute_qk(w, heads[role])
                parts.append(w.to(dtype))
                on_tensor(source)
            state[ours] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return state
