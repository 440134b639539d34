"""HF checkpoint directory -> LlamaConfig + our state dict.

Reads `config.json` and the weights from `model.safetensors`, or the shards listed in
`model.safetensors.index.json`, or failing both every `*.safetensors` in the directory, with
`safetensors.safe_open` (memory-mapped, one tensor at a time; never pickle).

Names (HF -> ours, N = layer):
    model.embed_tokens.weight                      embed_tokens.weight
    model.layers.N.input_layernorm.weight          layers.N.input_layernorm.weight
    model.layers.N.self_attn.q/k/v_proj.weight     layers.N.self_attn.qkv_proj.weight  (fused)
    model.layers.N.self_attn.o_proj.weight         layers.N.self_attn.o_proj.weight
    model.layers.N.post_attention_layernorm.weight layers.N.post_attention_layernorm.weight
    model.layers.N.mlp.gate/up_proj.weight         layers.N.mlp.gate_up_proj.weight    (fused)
    model.layers.N.mlp.down_proj.weight            layers.N.mlp.down_proj.weight
    model.norm.weight                              norm.weight
    lm_head.weight                                 lm_head.weight  (ignored when tied)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from inference.models.config import LlamaConfig
from inference.models.weights import SourceNames, load_plan

HF_NAMES = SourceNames(
    embed="model.embed_tokens.weight",
    norm="model.norm.weight",
    lm_head="lm_head.weight",
    attn_norm="model.layers.{i}.input_layernorm.weight",
    q="model.layers.{i}.self_attn.q_proj.weight",
    k="model.layers.{i}.self_attn.k_proj.weight",
    v="model.layers.{i}.self_attn.v_proj.weight",
    o="model.layers.{i}.self_attn.o_proj.weight",
    mlp_norm="model.layers.{i}.post_attention_layernorm.weight",
    gate="model.layers.{i}.mlp.gate_proj.weight",
    up="model.layers.{i}.mlp.up_proj.weight",
    down="model.layers.{i}.mlp.down_proj.weight",
)
# Present in some checkpoints, recomputed by us: RoPE inverse frequencies of older exports.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class HFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(
                f"{self.path}: no config.json (an HF checkpoint directory needs config.json and *.safetensors)"
            )
        try:
            config_dict = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{config_path}: not valid JSON ({e})") from e
        if not isinstance(config_dict, dict):
            raise ValueError(f"{config_path}: expected a JSON object")
        try:
            self.config = LlamaConfig.from_hf_dict(config_dict, name=self.path.name)
        except ValueError as e:
            raise ValueError(f"{config_path}: {e}") from e

        self.files = self._weight_files()
        self.file_of: dict[str, Path] = {}  # tensor name -> shard
        for file in self.files:
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        self.file_of[name] = file
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{file}: not a readable safetensors file ({e})") from e

        if self.config.tie_word_embeddings:
            self.file_of.pop(HF_NAMES.lm_head, None)  # HF ignores it too when tied
        self.plan = load_plan(self.config, HF_NAMES)
        used = {s for sources in self.plan.values() for s in sources}
        missing = [s for s in used if s not in self.file_of]
        if missing:
            raise ValueError(
                f"{self.path}: missing tensors {sorted(missing)[:5]} ({len(missing)} in all)"
            )
        unexpected = sorted(n for n in set(self.file_of) - used if not _IGNORED.fullmatch(n))
        if unexpected:
            raise ValueError(
                f"{self.path}: unexpected tensors {unexpected[:5]} ({len(unexpected)} in all)"
            )

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{index}: not a safetensors index (needs a 'weight_map' object): {e}"
                ) from e
            files = sorted({self.path / name for name in weight_map.values()})
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise FileNotFoundError(f"{index}: shard files missing: {absent}")
            return files
        single = self.path / "model.safetensors"
        if single.is_file():
            return [single]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{self.path}: no *.safetensors weights (pickled .bin checkpoints are not loaded)"
            )
        return files

    @property
    def num_tensors(self) -> int:
        """Source tensors `load_state_dict` reads (for progress bars)."""
        return sum(len(sources) for sources in self.plan.values())

    def load_state_dict(
        self, dtype: torch.dtype, on_tensor: Callable[[str], None] = lambda name: None
    ) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for ours, sources in self.plan.items():
            for source in sources:
                by_file.setdefault(self.file_of[source], []).append((ours, source))
        loaded: dict[str, torch.Tensor] = {}
        for file, names in by_file.items():  # open each shard once
            try:
                with safe_open(file, framework="pt") as f:
                    for _, source in names:
                        loaded[source] = f.get_tensor(source).to(dtype)
                        on_tensor(source)
            except (SafetensorError, OSError, RuntimeError) as e:
                raise ValueError(f"{file}: could not read tensor data ({e})") from e
        state = {}
        for ours, sources in self.plan.items():
            parts = [loaded.pop(s) for s in sources]
            state[ours] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return state
