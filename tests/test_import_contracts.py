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
PACKAGES = ("portal", "inference", "kernels", "protocol")
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


CONTRACT_NAMES = [contract["name"] for contract in
                  tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]]
# A violation per structural contract, planted all at once: (file, its import, the contract's
# name prefix, the chain lint-imports must print).
PLANTED = [
    ("protocol/planted.py", "import django\n", "The shared protocol stands alone", "protocol.planted -> django"),
    ("inference/engine/planted.py", "from inference.server import app\n", "Inference layers",
     "inference.engine.planted -> inference.server.app"),
    ("inference/models/planted.py", "from inference.lora import manager\n", "Inference layers",
     "inference.models.planted -> inference.lora.manager"),
    ("portal/core/planted.py", "from portal.tenants import models\n", "portal.core imports no app",
     "portal.core.planted -> portal.tenants.models"),
    ("portal/keys/selectors.py", "from portal.keys import services\n", "Inside each portal app",
     "portal.keys.selectors -> portal.keys.services"),
    ("portal/adapters/traffic.py", "from portal.adapters import staging\n", "portal.adapters:",
     "portal.adapters.traffic -> portal.adapters.staging"),
    ("portal/gateway/auth.py", "from portal.gateway import relay\n", "portal.gateway:",
     "portal.gateway.auth -> portal.gateway.relay"),
]


def test_each_structural_contract_bites(tree_copy):
    for path, line, _, _ in PLANTED:
        target = tree_copy / path
        target.write_text(line + (target.read_text() if target.exists() else ""))

    result = lint_imports(tree_copy, "contracts.toml")

    assert result.returncode != 0
    squashed = "".join(result.stdout.split())  # lint-imports wraps long names anywhere

    def said(text: str) -> bool:
        return "".join(text.split()) in squashed

    for _, _, prefix, chain in PLANTED:
        [name] = [n for n in CONTRACT_NAMES if n.startswith(prefix)]
        assert said(f"{name} BROKEN"), (name, result.stdout)
        assert said(chain), (chain, result.stdout)
    assert said(f"{WEB_CONTRACT} KEPT")


def import_cycles(graph) -> list[list[str]]:
    """The import cycles of a grimp graph: its strongly connected components of more than one
    module (Tarjan's algorithm, iterative)."""
    modules = sorted(graph.modules)
    edges = {module: sorted(graph.find_modules_directly_imported_by(module)) for module in modules}
    order, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def enter(node: str) -> None:
        order[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)

    for root in modules:
        if root in order:
            continue
        enter(root)
        work = [(root, iter(edges[root]))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == order[node]:
                    component = []
                    while (member := stack.pop()) != node:
                        on_stack.discard(member)
                        component.append(member)
                    on_stack.discard(node)
                    if component:
                        cycles.append(sorted([node, *component]))
            elif child not in order:
                enter(child)
                work.append((child, iter(edges.get(child, ()))))
            elif child in on_stack:
                low[node] = min(low[node], order[child])
    return cycles


def test_no_module_of_the_project_imports_itself_back():
    """No import cycle between modules anywhere in the project (grimp: the graph lint-imports
    uses, so an import inside a function counts too)."""
    import grimp

    graph = grimp.build_graph(*PACKAGES)
    assert import_cycles(graph) == []

    graph.add_import(importer="portal.gateway.errors", imported="portal.gateway.views")  # planted
    assert any({"portal.gateway.errors", "portal.gateway.views"} <= set(cycle) for cycle in import_cycles(graph))
