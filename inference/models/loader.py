"""load_model(path) -> LlamaForCausalLM, from a .gguf file or an HF checkpoint directory.

The model is built on the meta device (no memory, no random init) and the checkpoint's
tensors are assigned into it; only then are the RoPE caches computed on the real device.
Progress (tensors read / total) goes to stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

from inference.models.gguf_loader import GGUFCheckpoint
from inference.models.hf_loader import HFCheckpoint
from inference.models.llama import LlamaForCausalLM
from inference.models.quantize import quantize_model

GGUF_MAGIC = b"GGUF"


def open_checkpoint(path: str | Path) -> GGUFCheckpoint | HFCheckpoint:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no such file or directory (expected a .gguf file or an HF checkpoint directory)"
        )
    if path.is_dir():
        return HFCheckpoint(path)
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path}: not a GGUF file (magic {magic!r}); pass a .gguf file or an HF checkpoint directory"
        )
    return GGUFCheckpoint(path)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    progress: bool = True,
    weights_dtype: str = "auto",
) -> LlamaForCausalLM:
    """weights_dtype: "auto" (dense, in `dtype`), "int8" or "int4" (weight-only quantised
    projections, CPU only; inference/models/quantize.py)."""
    checkpoint = open_checkpoint(path)
    config = checkpoint.config
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}

    with tqdm(
        total=checkpoint.num_tensors,
        desc=f"loading {config.name}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
        # Under a supervisor (honcho, systemd, kubectl logs) every redraw is a log line.
        mininterval=0.1 if sys.stderr.isatty() else 5.0,
    ) as bar:
        state = checkpoint.load_state_dict(dtype, on_tensor=lambda name: bar.update())

    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:5]} ({len(missing)} in all)")
    for name, tensor in state.items():
        if name not in expected:
            raise ValueError(f"{path}: unexpected tensor {name!r}")
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, the config needs {expected[name]}"
            )

    state = {name: t.to(device) for name, t in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary.reset_cache(device)
    model.requires_grad_(False)
    quantize_model(model, checkpoint, weights_dtype)
    return model.eval()
