"""Test helper: PEFT LoRA adapters written with numpy + safetensors.numpy (no torch), laid out
as PEFT's save_pretrained writes them, and archives of them (good and malicious)."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from protocol.adapter_format import BaseShapes, module_path
from tests.protocol.adapter_format.peft_files import TINY
from tests.protocol.adapter_format.peft_files import lora_config as peft_config


def peft_tensors(base: BaseShapes = TINY, *, rank: int = 4, targets=("q_proj", "v_proj"), seed: int = 0,
                 dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = base.module_shapes()
    tensors = {}
    for layer in range(base.num_hidden_layers):
        for module in targets:
            d_in, d_out = shapes[module]
            prefix = f"base_model.model.{module_path(layer, module)}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) / d_in**0.5).astype(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((d_out, rank)) * 0.05).astype(dtype)
    return tensors


def write_peft(out: Path, base: BaseShapes = TINY, *, config: dict | None = None, rank: int = 4,
               targets=("q_proj", "v_proj"), seed: int = 0,
               edit: Callable[[dict[str, np.ndarray]], None] | None = None) -> Path:
    """A PEFT adapter directory; `edit` may change the tensors before they are saved."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = config if config is not None else peft_config(r=rank, target_modules=list(targets))
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    tensors = peft_tensors(base, rank=rank, targets=targets, seed=seed)
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def zip_bytes(entries: dict[str, bytes], *, compression=zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return buf.getvalue()


def zip_dir(directory: Path, *, prefix: str = "") -> bytes:
    return zip_bytes({prefix + p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()})


def tar_bytes(members: list[tuple[tarfile.TarInfo, bytes | None]], *, gz: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def tar_file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def tar_dir(directory: Path, *, prefix: str = "") -> bytes:
    return tar_bytes([tar_file(prefix + p.name, p.read_bytes()) for p in sorted(directory.iterdir()) if p.is_file()])


def tar_special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


def zip_symlink(name: str, target: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        info = zipfile.ZipInfo(name)
        info.external_attr = (0o120777 << 16)  # S_IFLNK
        zf.writestr(info, target)
        zf.writestr("adapter_config.json", "{}")
    return buf.getvalue()


def zip_lying_about_size(name: str, data: bytes, declared: int) -> bytes:
    """A zip whose headers declare `declared` uncompressed bytes for an entry that inflates to more."""
    raw = bytearray(zip_bytes({name: data}))
    local = raw.find(b"PK\x03\x04")
    raw[local + 22 : local + 26] = declared.to_bytes(4, "little")
    central = raw.find(b"PK\x01\x02")
    raw[central + 24 : central + 28] = declared.to_bytes(4, "little")
    return bytes(raw)
