"""deploy/: the files that cannot be built here still have to agree with the code."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from inference.config import EngineConfig
from inference.models.fetch import MODEL_FILENAME
from portal.config import VARIABLES, WebConfig

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
# Files whose quoted "NAME"s count as variables the code reads.
READERS = ("portal/config.py", "inference/config.py", "inference/models/fetch.py")


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
    assert set(services) == {"postgres", "redis", "web", "worker", "fleet-worker", "beat", "inference-1", "inference-2"}
    assert services["postgres"]["image"] == "postgres:16"
    assert services["redis"]["image"] == "redis:7"
    for name, service in services.items():
        assert "healthcheck" in service, name
    for name in ("web", "worker", "fleet-worker", "beat", "inference-1", "inference-2"):
        assert services[name]["env_file"] == ".env"
        dockerfile = DEPLOY.parent / services[name]["build"]["dockerfile"]
        assert dockerfile.is_file(), dockerfile


def test_web_migrates_before_serving_and_workers_wait_for_it(compose: dict) -> None:
    services = compose["services"]
    web = " ".join(services["web"]["command"])
    assert web.index("manage.py migrate") < web.index("uvicorn portal.asgi:application")
    for name in ("worker", "fleet-worker"):
        assert services[name]["command"][:4] == ["celery", "-A", "portal.celery", "worker"]
    assert services["beat"]["command"][:4] == ["celery", "-A", "portal.celery", "beat"]
    for name in ("worker", "fleet-worker", "beat"):
        assert services[name]["depends_on"]["web"]["condition"] == "service_healthy"


def consumed_queues(command: list[str]) -> set[str]:
    """The queues a `celery worker` command line consumes (every configured one without --queues)."""
    from django.conf import settings

    for flag in ("--queues", "-Q"):
        if flag in command:
            return set(command[command.index(flag) + 1].split(","))
    return {queue.name for queue in settings.CELERY_TASK_QUEUES}


def test_the_fleet_poll_has_a_worker_of_its_own_and_every_queue_a_worker(compose: dict) -> None:
    from django.conf import settings

    services = compose["services"]
    assert consumed_queues(services["fleet-worker"]["command"]) == {"fleet"}
    assert "fleet" not in consumed_queues(services["worker"]["command"])
    configured = {queue.name for queue in settings.CELERY_TASK_QUEUES}
    assert consumed_queues(services["worker"]["command"]) | {"fleet"} == configured
    # One box (deploy/local/run.py) runs a single worker without --queues: it takes them all.
    [one_box] = [line for line in (DEPLOY / "local" / "run.py").read_text().splitlines()
                 if "celery -A portal.celery worker" in line]
    assert consumed_queues(one_box.split()) == configured


def example_values() -> dict[str, str]:
    """The uncommented NAME=value lines of .env.example."""
    values = {}
    for line in (DEPLOY / ".env.example").read_text().splitlines():
        m = re.match(r"^([A-Z][A-Z0-9_]*)=(.*)$", line)
        if m:
            values[m.group(1)] = m.group(2)
    return values


def test_every_example_variable_is_read_by_the_code_or_compose() -> None:
    sources = "\n".join((ROOT / path).read_text() for path in READERS)
    read_by_code = set(re.findall(r'"([A-Z][A-Z0-9_]+)"', sources))
    read_by_code |= {f"INFERENCE_{f.name.upper()}" for f in fields(EngineConfig)}
    read_by_compose = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", (DEPLOY / "compose.yaml").read_text()))
    unknown = example_variables() - read_by_code - read_by_compose
    assert not unknown, f"documented in .env.example but read by nothing: {sorted(unknown)}"


def test_every_variable_the_code_reads_is_documented() -> None:
    portal = set(re.findall(r'env\.get\("([A-Z][A-Z0-9_]+)"', (ROOT / "portal/config.py").read_text()))
    assert portal == set(VARIABLES)  # the list tests use to start processes without the caller's values
    inference = {f"INFERENCE_{f.name.upper()}" for f in fields(EngineConfig)}
    inference |= set(re.findall(r'env\.get\("(INFERENCE_[A-Z0-9_]+)"', (ROOT / "inference/config.py").read_text()))
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


# --- production wiring --------------------------------------------------------------------------


def test_the_web_image_collects_static_files_for_production(tmp_path) -> None:
    """The Dockerfile's collectstatic step, run as written, writes the manifest production pages
    need (collected in development mode there is none, and every production page is a 500)."""
    dockerfile = (DEPLOY / "Dockerfile.web").read_text()
    instructions = "\n".join(line for line in dockerfile.splitlines() if not line.startswith("#")).replace("\\\n", " ")
    [run] = [line for line in instructions.splitlines() if line.startswith("RUN ") and "collectstatic" in line]
    [collect] = [part for part in run.removeprefix("RUN ").split(" && ") if "collectstatic" in part]
    assert "ENV SECRET_KEY" not in dockerfile and "ARG SECRET_KEY" not in dockerfile  # nothing baked in
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES and k != "DJANGO_SETTINGS_MODULE"}
    env.update(STATIC_ROOT=str(tmp_path / "static"), PATH=f"{Path(sys.executable).parent}:{env['PATH']}")

    result = subprocess.run(["bash", "-c", collect], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "static" / "staticfiles.json").is_file()


def test_compose_wires_the_fleet_to_the_portal_over_the_internal_network(compose: dict) -> None:
    services = compose["services"]
    for name in ("web", "worker", "beat"):  # the web process and Celery both hand out adapter URLs
        assert services[name]["environment"]["PORTAL_INTERNAL_URL"] == "http://web:8000"
    for name in ("inference-1", "inference-2"):  # two workers, each its own host and URL
        assert services[name]["environment"]["INFERENCE_PORTAL_ORIGINS"] == "http://web:8000"
        assert services[name]["environment"]["INFERENCE_ALLOW_RUNTIME_LORA_UPDATING"] == "true"  # staging loads
    assert services["web"]["environment"]["INFERENCE_URLS"].split(",") == [
        "http://inference-1:8001", "http://inference-2:8001"]
    example = example_values()
    assert example["INFERENCE_ENV"] == "production"
    assert "web" in example["ALLOWED_HOSTS"].split(",")  # the Host of the workers' downloads


def test_the_example_settings_start_in_production_once_the_secrets_are_filled_in(compose: dict) -> None:
    environ = {**example_values(), "SECRET_KEY": "e" * 30 + "xample-s3cret-KEY-" + "q" * 10,
               "INFERENCE_ADMIN_TOKEN": "example-fleet-token-of-32-characters", "POSTGRES_PASSWORD": "pw"}
    wired = {k: re.sub(r"\$\{(\w+)[^}]*\}", lambda m: environ.get(m.group(1)) or "loraplex", str(v))
             for k, v in compose["services"]["web"]["environment"].items()}

    config = WebConfig.from_env({**environ, **wired})

    assert config.is_production and config.secure_ssl_redirect and config.hsts_seconds == 31536000
    assert config.portal_internal_url == "http://web:8000"


def load_run_script():
    spec = importlib.util.spec_from_file_location("local_run", DEPLOY / "local" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_run_gives_every_process_one_generated_fleet_token() -> None:
    run = load_run_script()

    first, second = run.local_environment({}), run.local_environment({})

    assert len(first["INFERENCE_ADMIN_TOKEN"]) >= 32
    assert first["INFERENCE_ADMIN_TOKEN"] != second["INFERENCE_ADMIN_TOKEN"]  # random, per run
    assert first["PORTAL_INTERNAL_URL"] == "http://127.0.0.1:8000"
    assert first["INFERENCE_PORTAL_ORIGINS"] == "http://127.0.0.1:8000"
    # The portal stages adapters on the local worker at run time: the worker's load route must exist.
    assert first["INFERENCE_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    assert run.local_environment({"INFERENCE_ALLOW_RUNTIME_LORA_UPDATING": "false"})[
        "INFERENCE_ALLOW_RUNTIME_LORA_UPDATING"] == "false"
    # The processes inherit it from the environment: it is on no command line (ps shows those).
    assert not any(first["INFERENCE_ADMIN_TOKEN"] in cmd or "admin-token" in cmd for cmd in run.processes().values())


def test_make_run_keeps_what_the_environment_sets() -> None:
    run = load_run_script()
    mine = {"INFERENCE_ADMIN_TOKEN": "t" * 40, "PORTAL_INTERNAL_URL": "http://portal.lan:8080"}

    env = run.local_environment(mine)
    assert env["INFERENCE_ADMIN_TOKEN"] == "t" * 40
    assert env["INFERENCE_PORTAL_ORIGINS"] == "http://portal.lan:8080"
    on_every_interface = run.local_environment({}, web_host="0.0.0.0", web_port="9000")
    assert on_every_interface["PORTAL_INTERNAL_URL"] == "http://127.0.0.1:9000"
    assert on_every_interface["INFERENCE_PORTAL_ORIGINS"] == "http://127.0.0.1:9000"
    # The web process must answer the address the worker fetches adapters from and the browser opens.
    assert "ALLOWED_HOSTS" not in run.local_environment({}) and "ALLOWED_HOSTS" not in on_every_interface
    assert run.local_environment({}, web_host="127.0.0.9")["ALLOWED_HOSTS"] == "localhost,127.0.0.1,[::1],127.0.0.9"
    assert run.local_environment({}, web_host="::2")["ALLOWED_HOSTS"] == "localhost,127.0.0.1,[::1],[::2]"
    assert run.local_environment({"ALLOWED_HOSTS": "portal.lan"}, web_host="127.0.0.9")["ALLOWED_HOSTS"] == "portal.lan"
    assert run.local_environment(mine)["ALLOWED_HOSTS"] == "localhost,127.0.0.1,[::1],portal.lan"


def test_make_run_starts_a_local_fleet_when_asked(monkeypatch, capsys) -> None:
    run = load_run_script()

    env = run.local_environment({"INFERENCE_WORKERS": "3"})
    assert env["INFERENCE_URLS"] == "http://127.0.0.1:8001,http://127.0.0.1:8002,http://127.0.0.1:8003"
    monkeypatch.setattr(run.os, "environ", env)
    procs = run.processes()
    assert [procs[f"inference-{i}"].split()[-1] for i in (1, 2, 3)] == ["8001", "8002", "8003"]
    assert "inference" not in procs
    # One worker keeps its old name and the default INFERENCE_URLS; a list the caller set wins.
    assert "INFERENCE_URLS" not in run.local_environment({})
    assert run.local_environment({"INFERENCE_WORKERS": "2", "INFERENCE_URLS": "http://gpu:8001"})[
        "INFERENCE_URLS"] == "http://gpu:8001"
    for bad in ("0", "nine", "-1", "99"):
        with pytest.raises(SystemExit) as stopped:
            run.local_environment({"INFERENCE_WORKERS": bad})
        assert stopped.value.code == 2
        assert "INFERENCE_WORKERS" in capsys.readouterr().err


def _third_party_imports(*packages: str) -> set[str]:
    """Top-level modules imported anywhere in these packages that are neither the standard
    library nor the project's own."""
    import ast
    import sys

    own = {"portal", "inference", "kernels", "protocol"}
    found = set()
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                found |= {name.split(".")[0] for name in names}
    return {name for name in found if name not in own and name not in sys.stdlib_module_names}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _distributions(modules: set[str]) -> set[str]:
    from importlib.metadata import packages_distributions

    mapping = packages_distributions()
    return {_normalized(dist) for module in modules for dist in mapping.get(module, [module])}


def _required(name: str) -> set[str]:
    """The distributions a requirements file installs: those it names and what they require
    (installed here, so their metadata says; optional extras' requirements left out)."""
    from importlib.metadata import PackageNotFoundError, requires

    todo = [re.split(r"[\[<>=!~ ]", line, maxsplit=1)[0] for line in requirement_lines(name)]
    seen: set[str] = set()
    while todo:
        dist = _normalized(todo.pop())
        if dist in seen:
            continue
        seen.add(dist)
        try:
            needs = requires(dist) or []
        except PackageNotFoundError:
            continue
        todo += [re.split(r"[\[<>=!~ ;(]", need, maxsplit=1)[0] for need in needs if "extra ==" not in need]
    return seen


@pytest.mark.parametrize(("image", "packages", "extra"), [
    ("requirements-web.txt", ("portal", "protocol"), set()),
    ("requirements-inference.txt", ("inference", "kernels", "protocol"), {"torch"}),  # torch: its own index
])
def test_each_image_installs_what_its_code_imports(image, packages, extra) -> None:
    missing = _distributions(_third_party_imports(*packages)) - _required(image) - extra
    assert not missing, f"{image} lacks what {', '.join(packages)} import: {sorted(missing)}"


def test_the_web_image_installs_every_installed_app() -> None:
    # Apps named only as strings in settings (drf_spectacular_sidecar: the API docs' assets)
    # are no import the check above can see; the image fails at start-up without them.
    import ast

    settings = ast.parse((ROOT / "portal/settings.py").read_text())
    apps = next(ast.literal_eval(node.value) for node in settings.body
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "INSTALLED_APPS")
    modules = {app.split(".")[0] for app in apps} - {"portal", "django"}
    missing = _distributions(modules) - _required("requirements-web.txt")
    assert not missing, f"requirements-web.txt lacks installed apps: {sorted(missing)}"
