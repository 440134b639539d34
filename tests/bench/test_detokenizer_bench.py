"""bench/detokenizer.py --quick runs end to end: both detokenizers stream the same text as the
full decode (the bench exits non-zero otherwise) and a row is printed per text, with the CPU."""

import subprocess
import sys
from pathlib import Path

import pytest

from inference.models.fetch import default_model_path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_checks_both_outputs_and_prints_every_text() -> None:
    if not default_model_path().exists():
        pytest.fail(f"{default_model_path()} is missing: run `python -m inference.models fetch` (make test does)")
    out = subprocess.run([sys.executable, "bench/detokenizer.py", "--quick"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("CPU: ") and "capability" in out.stdout
    rows = {line.split("  ")[0].strip() for line in out.stdout.splitlines()[2:5]}
    assert rows == {"English", "CJK + emoji", "mixed"}
    assert all(line.rstrip().endswith("x") for line in out.stdout.splitlines()[2:5])
