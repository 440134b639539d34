"""Safe extraction: every malicious archive kind is refused with a readable reason."""

from __future__ import annotations

import tarfile

import pytest

from portal.adapters.archive import ArchiveError, archive_kind, extract_archive, find_adapter_root
from tests.portal.adapters.peft_files import (
    tar_bytes,
    tar_dir,
    tar_file,
    tar_special,
    write_peft,
    zip_bytes,
    zip_dir,
    zip_lying_about_size,
    zip_symlink,
)

LIMITS = {"max_files": 8, "max_bytes": 1 << 20}


def extract(tmp_path, data: bytes, kind: str, **limits) -> list[str]:
    src = tmp_path / f"upload.{kind}"
    src.write_bytes(data)
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(ArchiveError) as info:
        extract_archive(src, dest, kind=kind, **{**LIMITS, **limits})
    return info.value.reasons


@pytest.mark.parametrize("kind", ["zip", "tar"])
@pytest.mark.parametrize("prefix", ["", "my-adapter/"])
def test_a_peft_directory_round_trips(tmp_path, kind, prefix) -> None:
    adapter = write_peft(tmp_path / "adapter")
    data = zip_dir(adapter, prefix=prefix) if kind == "zip" else tar_dir(adapter, prefix=prefix)
    src = tmp_path / "upload"
    src.write_bytes(data)
    dest = tmp_path / "out"
    dest.mkdir()
    extract_archive(src, dest, kind=kind, **LIMITS)
    root = find_adapter_root(dest)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (root / name).read_bytes() == (adapter / name).read_bytes()


def test_archive_kinds() -> None:
    assert [archive_kind(n) for n in ("a.zip", "A.TAR.GZ", "a.tgz", "a.tar", "a.rar", "adapter_model.bin")] == [
        "zip", "tar", "tar", "tar", None, None,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("../evil.json", "escapes the archive with '..' (path traversal)"),
        ("a/../../evil.json", "path traversal"),
        ("/etc/cron.d/evil", "has an absolute path"),
        ("C:\\Windows\\evil.dll", "has an absolute path"),
        ("..\\evil.json", "path traversal"),
    ],
)
@pytest.mark.parametrize("kind", ["zip", "tar"])
def test_path_traversal_and_absolute_paths(tmp_path, kind, name, reason) -> None:
    data = zip_bytes({name: b"x"}) if kind == "zip" else tar_bytes([tar_file(name, b"x")])
    reasons = extract(tmp_path, data, kind)
    assert any(reason in r for r in reasons), reasons
    assert not list((tmp_path / "out").iterdir())  # nothing was written
    assert not (tmp_path / "evil.json").exists()


def test_zip_symlink(tmp_path) -> None:
    reasons = extract(tmp_path, zip_symlink("adapter_model.safetensors", "/etc/passwd"), "zip")
    assert reasons == ["entry 'adapter_model.safetensors' is a symbolic link; links are not accepted"]


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        (tarfile.SYMTYPE, "is a symbolic link (to '/etc/passwd')"),
        (tarfile.LNKTYPE, "is a hard link (to '/etc/passwd')"),
        (tarfile.CHRTYPE, "is a device file or FIFO"),
        (tarfile.BLKTYPE, "is a device file or FIFO"),
        (tarfile.FIFOTYPE, "is a device file or FIFO"),
    ],
)
def test_tar_links_and_device_files(tmp_path, kind, reason) -> None:
    data = tar_bytes([tar_file("adapter_config.json", b"{}"), tar_special("adapter_model.safetensors", kind, "/etc/passwd")])
    reasons = extract(tmp_path, data, "tar")
    assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize("kind", ["zip", "tar"])
def test_too_many_files(tmp_path, kind) -> None:
    entries = {f"f{i}.txt": b"x" for i in range(9)}
    data = zip_bytes(entries) if kind == "zip" else tar_bytes([tar_file(n, d) for n, d in entries.items()])
    reasons = extract(tmp_path, data, kind)
    assert any("files" in r and "8" in r for r in reasons), reasons


@pytest.mark.parametrize("kind", ["zip", "tar"])
def test_bomb_by_declared_size(tmp_path, kind) -> None:
    zeros = bytes(2 << 20)  # 2 MiB of zeros compress to a few KiB
    data = zip_bytes({"adapter_model.safetensors": zeros}) if kind == "zip" else tar_bytes(
        [tar_file("adapter_model.safetensors", zeros)]
    )
    assert len(data) < 64 << 10
    reasons = extract(tmp_path, data, kind)
    assert any("zip bomb" in r and str(1 << 20) in r for r in reasons), reasons


def test_bomb_by_actual_size_a_zip_that_lies_about_its_size(tmp_path) -> None:
    data = zip_lying_about_size("adapter_model.safetensors", bytes(4 << 20), declared=100)
    reasons = extract(tmp_path, data, "zip")
    assert len(reasons) == 1 and ("zip bomb" in reasons[0] or "corrupt" in reasons[0]), reasons
    written = sum(p.stat().st_size for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert written <= 100


@pytest.mark.parametrize("kind", ["zip", "tar"])
def test_not_an_archive_or_truncated(tmp_path, kind) -> None:
    assert extract(tmp_path, b"this is not an archive at all", kind)
    adapter = write_peft(tmp_path / "adapter")
    whole = zip_dir(adapter) if kind == "zip" else tar_dir(adapter)
    (tmp_path / "out").rmdir()
    reasons = extract(tmp_path, whole[: len(whole) // 2], kind)
    assert reasons and ("corrupt or truncated" in reasons[0] or "not a valid" in reasons[0]), reasons


@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_duplicate_names(tmp_path) -> None:
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("adapter_config.json", "{}")
        zf.writestr("adapter_config.json", "{\"evil\": 1}")
    reasons = extract(tmp_path, buf.getvalue(), "zip")
    assert reasons == ["entry 'adapter_config.json' appears twice in the archive"]
