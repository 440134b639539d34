"""The fast GGUF metadata reader against the `gguf` package's own reader and writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFWriter

from inference.models.gguf_metadata import GGUFFormatError, read_gguf_metadata


def reader_values(path: Path) -> dict:
    return {k: f.contents() for k, f in GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_value_type_round_trips(tmp_path: Path, endian: GGUFEndian) -> None:
    path = tmp_path / "all_types.gguf"
    writer = GGUFWriter(path, "llama", endianess=endian)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.5)
    writer.add_uint64("t.u64", 2**63)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo 中文 🎉")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.strs", ["a", "", "Ġthe", "<|im_end|>"])
    writer.add_array("t.floats", [0.25, -1.5])
    writer.add_tensor("w", np.ones((2, 3), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = read_gguf_metadata(path)

    assert ours == reader_values(path)
    assert ours["t.strs"] == ["a", "", "Ġthe", "<|im_end|>"]
    assert ours["t.u64"] == 2**63 and ours["t.bool"] is True


def test_real_model_metadata_matches_gguf_reader(fetched: Path, fetched_gguf_fields: dict) -> None:
    ours = read_gguf_metadata(fetched)
    assert ours == fetched_gguf_fields
    assert len(ours["tokenizer.ggml.tokens"]) == 49152


def test_not_gguf_and_truncated_files_are_rejected(smollm2_path: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_gguf_metadata(empty)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    with pytest.raises(GGUFFormatError, match="bad magic"):
        read_gguf_metadata(other)
    truncated = tmp_path / "truncated.gguf"
    with smollm2_path.open("rb") as f:
        truncated.write_bytes(f.read(200_000))  # cut inside the token list
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_gguf_metadata(truncated)
