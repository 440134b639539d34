"""Every setting the portal reads is declared: assigned in portal/settings.py (from WebConfig, so
it has an environment variable, a default and validation) or one of Django's own. A setting read
with `getattr(settings, NAME, default)` could never be set from the environment; it fails here."""

from __future__ import annotations

import ast
from pathlib import Path

from django.conf import global_settings

from portal.config import VARIABLES

ROOT = Path(__file__).resolve().parents[2]
PORTAL = ROOT / "portal"


def declared() -> set[str]:
    tree = ast.parse((PORTAL / "settings.py").read_text())
    names = {target.id for node in tree.body if isinstance(node, ast.Assign)
             for target in node.targets if isinstance(target, ast.Name)}
    return names | {name for name in dir(global_settings) if name.isupper()}


def settings_reads() -> list[tuple[str, int, str, bool]]:
    """(file, line, setting, read with a getattr default) for every read of django.conf.settings."""
    reads = []
    for path in sorted(PORTAL.rglob("*.py")):
        if path.name == "settings.py" and path.parent == PORTAL:
            continue
        tree = ast.parse(path.read_text())
        if not any(isinstance(node, ast.ImportFrom) and node.module == "django.conf"
                   and any(alias.name == "settings" for alias in node.names) for node in ast.walk(tree)):
            continue
        where = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "settings":
                reads.append((where, node.lineno, node.attr, False))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "settings"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                reads.append((where, node.lineno, node.args[1].value, len(node.args) > 2))
    return reads


def test_the_scan_sees_the_settings_the_portal_reads():
    names = {name for _, _, name, _ in settings_reads()}
    assert {"INFERENCE_URLS", "MAX_UPLOAD_BYTES", "GATEWAY_MAX_BODY_BYTES", "FLEET_MAX_LOAD"} <= names


def test_every_setting_read_is_declared():
    known = declared()
    undeclared = [f"{where}:{line} {name}" for where, line, name, _ in settings_reads() if name not in known]
    assert not undeclared, f"read but never declared in portal/settings.py: {undeclared}"


def test_no_setting_is_read_with_a_fallback_default():
    fallbacks = [f"{where}:{line} {name}" for where, line, name, default in settings_reads() if default]
    assert not fallbacks, f"declare these in portal/config.py and read settings.NAME: {fallbacks}"


def test_every_variable_of_the_config_is_documented_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in VARIABLES if f"`{name}`" not in readme]
    assert not missing, f"read from the environment but missing from README.md's tables: {missing}"
