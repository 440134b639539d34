"""The fast GGUF header reader (metadata and tensor places) against the `gguf` package's own
reader and writer."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFWriter
from gguf.quants import quantize

from inference.models.gguf_loader import GGUFCheckpoint, tensor_view
from inference.models.gguf_metadata import GGUFFormatError, read_gguf_header, read_gguf_metadata


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


def assert_tensors_match_reader(path: Path, reader: GGUFReader | None = None) -> None:
    """Every tensor's name, type, dims, place and bytes as GGUFReader (`reader`, opened on `path`
    where None) finds them; the checkpoint's view of its data is GGUFReader's array, dtype,
    shape and values."""
    header, reader = read_gguf_header(path), reader or GGUFReader(path)
    assert list(header.tensors) == [t.name for t in reader.tensors]
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    for theirs in reader.tensors:
        ours = header.tensors[theirs.name]
        assert (ours.type, ours.dims, ours.offset, ours.nbytes) == (
            theirs.tensor_type, tuple(int(d) for d in theirs.shape), theirs.data_offset, theirs.n_bytes
        ), theirs.name
        data = tensor_view(mapped, ours, header.endian)
        assert data.dtype == theirs.data.dtype and data.shape == theirs.data.shape, theirs.name
        assert np.array_equal(data, theirs.data), theirs.name


def write_tensors(path: Path, endian: GGUFEndian = GGUFEndian.LITTLE, alignment: int | None = None) -> Path:
    """Plain and block-quantised tensors of several shapes, in one file."""
    writer = GGUFWriter(path, "llama", endianess=endian)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    gen = np.random.default_rng(0)
    writer.add_tensor("f32", gen.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", gen.standard_normal((7,)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for qtype, shape in ((GGMLQuantizationType.Q8_0, (4, 64)), (GGMLQuantizationType.Q4_1, (2, 3, 32))):
        blocks = quantize(gen.standard_normal(shape).astype(np.float32), qtype)
        writer.add_tensor(qtype.name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_tensor_places_and_bytes_match_gguf_reader(tmp_path: Path, endian: GGUFEndian) -> None:
    path = write_tensors(tmp_path / "tensors.gguf", endian)
    assert_tensors_match_reader(path)
    header = read_gguf_header(path)
    assert header.tensors["f32"].shape == (3, 5) and header.tensors["Q4_1"].shape == (2, 3, 32)
    assert read_gguf_metadata(path) == header.metadata


def test_a_custom_alignment_moves_the_data_start(tmp_path: Path) -> None:
    path = write_tensors(tmp_path / "aligned.gguf", alignment=256)
    assert all(info.offset % 256 == 0 for info in read_gguf_header(path).tensors.values())
    assert_tensors_match_reader(path)


def test_real_model_tensors_match_gguf_reader(fetched: Path, fetched_gguf_reader: GGUFReader) -> None:
    assert_tensors_match_reader(fetched, fetched_gguf_reader)
    assert len(read_gguf_header(fetched).tensors) == 272


def patched(path: Path, old: bytes, new: bytes) -> Path:
    data = path.read_bytes()
    assert data.count(old) == 1, old
    path.write_bytes(data.replace(old, new))
    return path


def test_bad_tensor_headers_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    good = write_tensors(tmp_path / "good.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[:-100])  # the last tensor's blocks run past the end
    with pytest.raises(GGUFFormatError, match="'Q4_1' runs past the end of the file"):
        read_gguf_header(cut)
    assert read_gguf_metadata(cut) == read_gguf_metadata(tmp_path / "good.gguf")  # the tokenizer's read is unaffected

    twice = tmp_path / "twice.gguf"
    twice.write_bytes(good)
    patched(twice, struct.pack("<Q", 3) + b"f16", struct.pack("<Q", 3) + b"f32")
    with pytest.raises(GGUFFormatError, match="'f32' is listed twice"):
        read_gguf_header(twice)

    unknown = tmp_path / "unknown.gguf"
    unknown.write_bytes(good)
    # i32's entry: name, 2 dims (3, 2), then its type
    entry = struct.pack("<Q", 3) + b"i32" + struct.pack("<IQQ", 2, 3, 2)
    patched(unknown, entry + struct.pack("<I", GGMLQuantizationType.I32), entry + struct.pack("<I", 999))
    with pytest.raises(GGUFFormatError, match="'i32' has an unknown type 999"):
        read_gguf_header(unknown)

    partial = tmp_path / "partial.gguf"
    partial.write_bytes(good)
    q8 = struct.pack("<Q", 4) + b"Q8_0" + struct.pack("<IQQ", 2, 64, 4)
    patched(partial, q8, struct.pack("<Q", 4) + b"Q8_0" + struct.pack("<IQQ", 2, 48, 4))
    with pytest.raises(GGUFFormatError, match="rows of 48 are not whole Q8_0 blocks"):
        read_gguf_header(partial)


def test_a_bad_alignment_is_refused(tmp_path: Path) -> None:
    path = write_tensors(tmp_path / "zero.gguf", alignment=256)
    patched(path, b"general.alignment" + struct.pack("<II", 4, 256), b"general.alignment" + struct.pack("<II", 4, 0))
    with pytest.raises(GGUFFormatError, match="general.alignment must be a positive integer, got 0"):
        read_gguf_header(path)
    with pytest.raises(ValueError, match="zero.gguf: not a readable GGUF file"):
        GGUFCheckpoint(path)
