"""deploy/: the files that cannot be built here still have to agree with the code."""

from __future__ import annotations

import re
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from inference.config import EngineConfig
from inference.models.fetch import MODEL_FILENAME

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def example_variables() -> set[str]:
    """Names assigned in .env.example, including the commented-out `# NAME=value` overrides."""
    names = set()
    for line in (DEPLOY / ".env.example").read_text().splitlines():
        m = re.match(r"^#?\s*([A-Z][A-Z0-9_]*)=", line)
        if m:
            names.add(m.group(1))
    return names


def pyproject_dependencies() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def requirement_lines(name: str) -> list[str]:
    lines = (DEPLOY / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_compose_has_every_process_with_healthchecks(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "redis", "web", "worker", "beat", "inference"}
    assert services["postgres"]["image"] == "postgres:16"
    assert services["redis"]["image"] == "redis:7"
    for name, service in services.items():
        assert "healthcheck" in service, name
    for name in ("web", "worker", "beat", "inference"):
        assert services[name]["env_file"] == ".env"
        dockerfile = DEPLOY.parent / services[name]["build"]["dockerfile"]
        assert dockerfile.is_file(), dockerfile


def test_web_migrates_before_serving_and_workers_wait_for_it(compose: dict) -> None:
    services = compose["services"]
    web = " ".join(services["web"]["command"])
    assert web.index("manage.py migrate") < web.index("uvicorn portal.asgi:application")
    assert services["worker"]["command"][:4] == ["celery", "-A", "portal.celery", "worker"]
    assert services["beat"]["command"][:4] == ["celery", "-A", "portal.celery", "beat"]
    for name in ("worker", "beat"):
        assert services[name]["depends_on"]["web"]["condition"] == "service_healthy"
    assert services["web"]["environment"]["INFERENCE_URLS"] == "http://inference:8001"


def test_every_example_variable_is_read_by_the_code_or_compose() -> None:
    sources = "\n".join(
        (ROOT / path).read_text() for path in ("portal/config.py", "inference/models/fetch.py")
    )
    read_by_code = set(re.findall(r'"([A-Z][A-Z0-9_]+)"', sources))
    read_by_code |= {f"INFERENCE_{f.name.upper()}" for f in fields(EngineConfig)}
    read_by_compose = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", (DEPLOY / "compose.yaml").read_text()))
    unknown = example_variables() - read_by_code - read_by_compose
    assert not unknown, f"documented in .env.example but read by nothing: {sorted(unknown)}"


def test_every_variable_the_code_reads_is_documented() -> None:
    portal = set(re.findall(r'env\.get\("([A-Z][A-Z0-9_]+)"', (ROOT / "portal/config.py").read_text()))
    inference = {f"INFERENCE_{f.name.upper()}" for f in fields(EngineConfig)}
    missing = (portal | inference | {"MODELS_DIR"}) - example_variables()
    assert not missing, f"read by the code but missing from .env.example: {sorted(missing)}"


@pytest.mark.parametrize("name", ["requirements-web.txt", "requirements-inference.txt"])
def test_image_requirements_use_the_pyproject_ranges(name: str) -> None:
    deps = pyproject_dependencies()
    for requirement in requirement_lines(name):
        assert requirement in deps, f"{name}: {requirement!r} is not (or not with that range) in pyproject.toml"


def test_web_image_has_no_inference_side() -> None:
    assert not any(re.match(r"(torch|triton)\b", r) for r in requirement_lines("requirements-web.txt"))
    copies = [line for line in (DEPLOY / "Dockerfile.web").read_text().splitlines() if line.startswith("COPY")]
    assert copies and not any("inference" in line or "kernels" in line for line in copies)


def test_inference_image_fetches_the_model_it_serves() -> None:
    dockerfile = (DEPLOY / "Dockerfile.inference").read_text()
    assert '"torch==2.13.0"' not in dockerfile and "torch==2.13.0" in dockerfile
    assert "download.pytorch.org/whl/cpu" in dockerfile
    assert dockerfile.index("python -m inference.models fetch") < dockerfile.index("CMD")
    assert f'"/app/models/{MODEL_FILENAME}"' in dockerfile
