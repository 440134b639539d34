"""kernels/ is the bottom layer: inference imports it, never the reverse, and no web stack."""

from __future__ import annotations

import ast
from pathlib import Path

import kernels

FORBIDDEN = ("inference", "portal", "django", "rest_framework", "channels", "celery")


def test_kernels_import_neither_inference_nor_the_web_stack():
    root = Path(kernels.__file__).parent
    files = sorted(root.glob("*.py"))
    assert len(files) >= 6
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
