"""Safe extraction of an uploaded .zip / .tar.gz of a PEFT adapter directory.

Nothing in an archive is trusted. Refused, each with a readable reason:
    absolute paths, drive letters, `..` components (path traversal), NUL bytes in names
    symlinks, hard links, device files, FIFOs and any other non-regular entry
    encrypted zip entries, the same name twice
    more entries than max_files
    zip bombs: more uncompressed bytes declared than max_bytes, or more actually produced
        while streaming (an entry that inflates past its declared size, a tar stream that
        decompresses past the bound)
    a file that is not a valid archive, or is corrupt or truncated (CRC errors included)

Every entry is checked before any byte is written for a zip (its central directory comes
first); a tar is a stream, so its entries are checked as they come and extraction stops at the
first problem while the remaining headers are still read for more reasons. Files are written
with bounded memory (1 MiB chunks) into `dest`, a fresh directory the caller owns and removes.
"""

from __future__ import annotations

import gzip
import re
import stat
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath

CHUNK = 1 << 20
ARCHIVE_SUFFIXES = {".zip": "zip", ".tar.gz": "tar", ".tgz": "tar", ".tar": "tar"}
IGNORED_TOP_LEVEL = ("__MACOSX",)  # resource forks macOS adds to zips


class ArchiveError(ValueError):
    """An archive that will not be extracted; `reasons` lists every problem found."""

    def __init__(self, reasons: list[str]):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


class _TooLarge(Exception):
    pass


def archive_kind(filename: str) -> str | None:
    """'zip' or 'tar' by the file name's suffix, or None when it names no supported archive."""
    lower = filename.lower()
    for suffix, kind in ARCHIVE_SUFFIXES.items():
        if lower.endswith(suffix):
            return kind
    return None


def extract_archive(path: Path, dest: Path, *, kind: str, max_files: int, max_bytes: int) -> None:
    """Extract archive `path` into the empty directory `dest`; ArchiveError lists every reason
    it was refused (then `dest` may hold partial output: the caller discards it)."""
    if kind == "zip":
        _extract_zip(path, dest, max_files=max_files, max_bytes=max_bytes)
    elif kind == "tar":
        _extract_tar(path, dest, max_files=max_files, max_bytes=max_bytes)
    else:
        raise ArchiveError([f"unsupported archive kind {kind!r}; upload a .zip or .tar.gz"])


def find_adapter_root(dest: Path, config_name: str = "adapter_config.json") -> Path:
    """The extracted directory holding the adapter: `dest` itself, or its one top-level folder
    (archives of a directory usually hold `name/adapter_config.json`)."""
    if (dest / config_name).exists():
        return dest
    entries = [p for p in dest.iterdir() if p.name not in IGNORED_TOP_LEVEL and not p.name.startswith(".")]
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    return dest


# --- names --------------------------------------------------------------------------------------


def _name_problem(name: str) -> str | None:
    """Why an entry name is unsafe to extract, or None."""
    if "\x00" in name:
        return f"entry {name!r} has a NUL byte in its name"
    normalized = name.replace("\\", "/")
    if normalized.startswith("/") or re.match(r"^[A-Za-z]:", normalized):
        return f"entry {name!r} has an absolute path"
    if ".." in PurePosixPath(normalized).parts:
        return f"entry {name!r} escapes the archive with '..' (path traversal)"
    if not [p for p in PurePosixPath(normalized).parts if p not in ("", ".")]:
        return f"entry {name!r} has an empty name"
    return None


def _target(dest: Path, name: str) -> Path:
    parts = [p for p in PurePosixPath(name.replace("\\", "/")).parts if p not in ("", ".")]
    target = dest.joinpath(*parts)
    # Defence in depth: the checks above already make this impossible.
    if not target.resolve().is_relative_to(dest.resolve()):
        raise ArchiveError([f"entry {name!r} escapes the archive (path traversal)"])
    return target


def _bomb(max_bytes: int) -> str:
    return f"the archive unpacks to more than {max_bytes} bytes (zip bomb?); the limit is {max_bytes} bytes"


def _copy(src, target: Path, *, budget: int, declared: int | None, name: str) -> int:
    """Stream `src` into `target`; returns bytes written. Raises _TooLarge past `budget` and
    ArchiveError when the entry produces more than it declared."""
    target.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(target, "xb") as out:
        while chunk := src.read(CHUNK):
            written += len(chunk)
            if declared is not None and written > declared:
                raise ArchiveError(
                    [f"entry {name!r} inflates past its declared size of {declared} bytes (zip bomb?)"]
                )
            if written > budget:
                raise _TooLarge
            out.write(chunk)
    return written


# --- zip ----------------------------------------------------------------------------------------


def _extract_zip(path: Path, dest: Path, *, max_files: int, max_bytes: int) -> None:
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as e:
        raise ArchiveError([f"not a valid zip archive: {e}"]) from None
    with zf:
        infos = zf.infolist()
        reasons: list[str] = []
        seen: set[str] = set()
        files = 0
        declared = 0
        for info in infos:
            name = info.filename
            if problem := _name_problem(name):
                reasons.append(problem)
                continue
            key = name.replace("\\", "/").rstrip("/")
            if key in seen:
                reasons.append(f"entry {name!r} appears twice in the archive")
            seen.add(key)
            mode = info.external_attr >> 16
            kind = stat.S_IFMT(mode)
            if stat.S_ISLNK(mode):
                reasons.append(f"entry {name!r} is a symbolic link; links are not accepted")
                continue
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                reasons.append(f"entry {name!r} is a device, FIFO or socket, not a regular file")
                continue
            if info.flag_bits & 0x1:
                reasons.append(f"entry {name!r} is encrypted")
            if info.is_dir():
                continue
            files += 1
            declared += info.file_size
        if files > max_files:
            reasons.append(f"the archive holds {files} files; at most {max_files} are accepted")
        if declared > max_bytes:
            reasons.append(
                f"the archive declares {declared} bytes uncompressed (zip bomb?); the limit is {max_bytes} bytes"
            )
        if reasons:
            raise ArchiveError(reasons)

        budget = max_bytes
        for info in infos:
            target = _target(dest, info.filename)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            try:
                with zf.open(info) as src:
                    budget -= _copy(src, target, budget=budget, declared=info.file_size, name=info.filename)
            except _TooLarge:
                raise ArchiveError([_bomb(max_bytes)]) from None
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError, OSError) as e:
                raise ArchiveError([f"entry {info.filename!r} is corrupt or truncated: {e}"]) from None


# --- tar(.gz) -----------------------------------------------------------------------------------


class _Limited:
    """A read-only stream that raises _TooLarge after `limit` bytes (bounds a gzip stream's output)."""

    def __init__(self, raw, limit: int):
        self.raw, self.limit, self.count = raw, limit, 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size if size is not None and size >= 0 else CHUNK)
        self.count += len(data)
        if self.count > self.limit:
            raise _TooLarge
        return data


def _extract_tar(path: Path, dest: Path, *, max_files: int, max_bytes: int) -> None:
    # Headers and padding take at most 1.5 KiB an entry (pax/GNU long names a little more).
    stream_limit = max_bytes + (max_files + 16) * 4096 + (1 << 20)
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        source = gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw
        try:
            _extract_tar_stream(_Limited(source, stream_limit), dest, max_files=max_files, max_bytes=max_bytes)
        except _TooLarge:
            raise ArchiveError([_bomb(max_bytes)]) from None
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, OSError) as e:
            raise ArchiveError([f"not a valid tar.gz archive, or a corrupt or truncated one: {e}"]) from None


def _extract_tar_stream(stream, dest: Path, *, max_files: int, max_bytes: int) -> None:
    reasons: list[str] = []
    seen: set[str] = set()
    files = 0
    declared = 0
    budget = max_bytes
    with tarfile.open(fileobj=stream, mode="r|") as tf:
        for member in tf:
            name = member.name
            if problem := _name_problem(name):
                reasons.append(problem)
                continue
            key = name.replace("\\", "/").rstrip("/")
            if key in seen:
                reasons.append(f"entry {name!r} appears twice in the archive")
            seen.add(key)
            if member.issym() or member.islnk():
                link = "symbolic" if member.issym() else "hard"
                reasons.append(f"entry {name!r} is a {link} link (to {member.linkname!r}); links are not accepted")
                continue
            if member.ischr() or member.isblk() or member.isfifo():
                reasons.append(f"entry {name!r} is a device file or FIFO, not a regular file")
                continue
            if member.isdir():
                if not reasons:
                    _target(dest, name).mkdir(parents=True, exist_ok=True)
                continue
            if not member.isreg():
                reasons.append(f"entry {name!r} is not a regular file (tar type {member.type!r})")
                continue
            files += 1
            declared += member.size
            if files > max_files:
                reasons.append(f"the archive holds more than {max_files} files")
                break
            if declared > max_bytes:
                reasons.append(
                    f"the archive declares more than {max_bytes} bytes uncompressed (zip bomb?); "
                    f"the limit is {max_bytes} bytes"
                )
                break
            if reasons:
                continue  # keep reading headers for more reasons, extract nothing more
            src = tf.extractfile(member)
            try:
                budget -= _copy(src, _target(dest, name), budget=budget, declared=member.size, name=name)
            finally:
                src.close()
    if reasons:
        raise ArchiveError(reasons)
