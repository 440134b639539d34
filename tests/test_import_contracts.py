"""The import boundary between the web side and the inference side, as CI enforces it.

The contracts live in pyproject.toml ([tool.importlinter]); these tests run lint-imports on the
real tree, and on a copy of it with a planted violation to prove the contracts can fail.
"""

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("portal", "inference", "kernels")
WEB_CONTRACT = "The web side never imports torch, triton or the inference side"
INFERENCE_CONTRACT = "The inference side never imports the web stack"
KERNELS_CONTRACT = "Kernels stand alone: the inference side imports kernels, never the reverse"
NUM_CONTRACTS = len(
    tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
)


def lint_imports(cwd: Path, *config: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", *config],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    """The three packages copied as they are, with the real contracts in a config of its own."""
    for package in PACKAGES:
        shutil.copytree(
            REPO_ROOT / package,
            tmp_path / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    contracts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    # JSON strings, lists and booleans are valid TOML values.
    lines = ["[tool.importlinter]"]
    lines += [
        f"{key} = {json.dumps(value)}" for key, value in contracts.items() if key != "contracts"
    ]
    for contract in contracts["contracts"]:
        lines.append("[[tool.importlinter.contracts]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in contract.items()]
    (tmp_path / "contracts.toml").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_the_real_tree_keeps_both_contracts():
    result = lint_imports(REPO_ROOT)

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{WEB_CONTRACT} KEPT" in result.stdout
    assert f"{INFERENCE_CONTRACT} KEPT" in result.stdout
    assert f"{KERNELS_CONTRACT} KEPT" in result.stdout


def test_the_copied_tree_passes_before_anything_is_planted(tree_copy):
    result = lint_imports(tree_copy, "contracts.toml")

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{NUM_CONTRACTS} kept, 0 broken" in result.stdout


def test_torch_planted_in_the_portal_breaks_the_web_contract(tree_copy):
    (tree_copy / "portal" / "core" / "planted.py").write_text("import torch\n")

    result = lint_imports(tree_copy, "contracts.toml")

    assert result.returncode != 0
    assert f"{WEB_CONTRACT} BROKEN" in result.stdout
    assert f"{INFERENCE_CONTRACT} KEPT" in result.stdout
    assert "portal.core.planted -> torch" in result.stdout


def test_django_planted_in_inference_breaks_the_inference_contract(tree_copy):
    (tree_copy / "inference" / "planted.py").write_text("from django.conf import settings\n")

    result = lint_imports(tree_copy, "contracts.toml")

    assert result.returncode != 0
    assert f"{INFERENCE_CONTRACT} BROKEN" in result.stdout
    assert f"{WEB_CONTRACT} KEPT" in result.stdout
    assert "inference.planted -> django" in result.stdout


def test_inference_planted_in_kernels_breaks_the_kernels_contract(tree_copy):
    (tree_copy / "kernels" / "planted.py").write_text("from inference.engine import sequence\n")

    result = lint_imports(tree_copy, "contracts.toml")

    assert result.returncode != 0
    assert f"{KERNELS_CONTRACT} BROKEN" in result.stdout
    assert f"{WEB_CONTRACT} KEPT" in result.stdout
    assert "kernels.planted -> inference.engine.sequence" in result.stdout
