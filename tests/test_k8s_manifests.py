"""deploy/k8s/: the Kustomize overlays render (no cluster needed), every object is valid for a
named Kubernetes release, and what the pods are told agrees with the code and with compose."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from inference.config import AccessConfig, EngineConfig, url_origin
from portal.config import VARIABLES, WebConfig

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_RELEASE = "1.30.0"
NAMESPACE = "loraplex"
SECRET = "loraplex-secrets"
# Kinds from CRDs (KEDA, the Prometheus Operator): kubernetes-validate has no schema for them, so
# only their apiVersion, kind and metadata are checked here.
CRD_KINDS = {"ScaledObject": "keda.sh/v1alpha1", "ServiceMonitor": "monitoring.coreos.com/v1"}
WORKLOADS = ("Deployment", "StatefulSet")
CELERY_EXPORTER_IMAGE = "ghcr.io/danihodovic/celery-exporter"  # deploy/k8s/base/celery-exporter.yaml, pinned there
# How the processes find each other: set in compose.yaml and in the manifests alike.
PORTAL_WIRING = {"PORTAL_INTERNAL_URL", "DATABASE_URL", "REDIS_URL"}
# How the portal finds its workers: a static list (compose: two named services) or a DNS name
# (Kubernetes: the headless Service, re-resolved on every poll); each side sets one of them.
WORKER_FINDING = {"INFERENCE_URLS", "INFERENCE_DISCOVERY"}
INFERENCE_WIRING = {"INFERENCE_PORTAL_ORIGINS"}
SECRET_VARIABLES = {"SECRET_KEY", "INFERENCE_ADMIN_TOKEN", "DATABASE_URL", "REDIS_URL", "METRICS_TOKEN"}
# What the secrets stand for when the rendered settings are loaded by the real config classes.
EXAMPLE_SECRETS = {
    "SECRET_KEY": "e" * 30 + "xample-s3cret-KEY-" + "q" * 10,
    "INFERENCE_ADMIN_TOKEN": "example-fleet-token-of-32-characters",
    "DATABASE_URL": "postgres://loraplex:pw@postgres.example:5432/loraplex",
    "REDIS_URL": "redis://redis.example:6379/0",
    "METRICS_TOKEN": "example-metrics-token-of-32-characters",
}


def portal_variables() -> set[str]:
    return set(VARIABLES)


def inference_variables() -> set[str]:
    """INFERENCE_<FIELD> for every EngineConfig field, and the access settings inference/config.py reads."""
    names = {f"INFERENCE_{f.name.upper()}" for f in fields(EngineConfig)}
    return names | set(re.findall(r'env\.get\("(INFERENCE_[A-Z0-9_]+)"', (ROOT / "inference/config.py").read_text()))


def render(path: Path) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not found: deploy/k8s is rendered with `kubectl kustomize` (no cluster needed)")
    result = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / "overlays" / request.param)


@pytest.fixture(scope="module")
def objects(overlay) -> list[dict]:
    return overlay[1]


def get(objects: list[dict], kind: str, name: str) -> dict:
    [found] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in (*WORKLOADS, "Job")]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def all_containers(workload: dict) -> list[dict]:
    spec = pod_spec(workload)
    return spec.get("initContainers", []) + spec["containers"]


def side(container: dict) -> str:
    """'portal' for the web image (web, Celery, migrations), 'inference' for the workers,
    'celery-exporter' for the exporter of Celery's metrics (a third-party image)."""
    image = container["image"]
    if image.startswith("loraplex-web"):
        return "portal"
    if image.split(":")[0] == CELERY_EXPORTER_IMAGE:
        return "celery-exporter"
    assert image.startswith("loraplex-inference"), image
    return "inference"


def container_env(objects: list[dict], container: dict) -> dict[str, object]:
    """Every variable a container gets: its env entries (value or the valueFrom reference) and
    the keys of the ConfigMaps it takes whole. A Secret taken whole would hide its names."""
    env: dict[str, object] = {}
    for source in container.get("envFrom", []):
        assert "configMapRef" in source, f"{container['name']}: envFrom {source} (name each secret key in env)"
        env.update(get(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for entry in container.get("env", []):
        env[entry["name"]] = entry.get("value", entry.get("valueFrom"))
    return env


def undeclared_variables(objects: list[dict]) -> list[str]:
    # The exporter takes its settings as flags; only the broker URL comes in, from the Secret
    # (its args say --broker-url=$(REDIS_URL)).
    declared = {"portal": portal_variables(), "inference": inference_variables(), "celery-exporter": {"REDIS_URL"}}
    return [f"{w['metadata']['name']}/{c['name']}: {name}"
            for w in workloads(objects) for c in all_containers(w)
            for name in container_env(objects, c) if name not in declared[side(c)]]


def side_env(objects: list[dict], wanted: str) -> dict[str, dict[str, object]]:
    return {f"{w['metadata']['name']}/{c['name']}": container_env(objects, c)
            for w in workloads(objects) for c in all_containers(w) if side(c) == wanted}


# --- rendering and schemas ------------------------------------------------------------------------


def test_each_overlay_renders_every_part_of_the_platform(objects) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Namespace", NAMESPACE), ("Deployment", "web"), ("Service", "web"), ("Ingress", "web"),
            ("Job", "migrate"), ("Deployment", "celery-worker"), ("Deployment", "celery-fleet-worker"),
            ("Deployment", "celery-beat"), ("ServiceMonitor", "web"),
            ("StatefulSet", "inference"), ("Service", "inference-headless"),
            ("PodDisruptionBudget", "inference"), ("NetworkPolicy", "inference"),
            ("PersistentVolumeClaim", "adapter-storage"), ("ScaledObject", "inference"),
            ("ServiceMonitor", "inference")} <= kinds
    for o in objects:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == NAMESPACE, (o["kind"], o["metadata"]["name"])


def test_every_object_is_valid_for_the_named_kubernetes_release(objects) -> None:
    """Built-in kinds against the release's schemas (strict: an unknown field is an error), from
    the schemas kubernetes-validate ships (no network). CRD kinds: apiVersion, kind, metadata."""
    for o in objects:
        what = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in CRD_KINDS:
            assert o["apiVersion"] == CRD_KINDS[o["kind"]], what
            assert o["metadata"]["name"] and o["metadata"]["namespace"] == NAMESPACE, what
            assert isinstance(o["spec"], dict), what
            continue
        try:
            kubernetes_validate.validate(o, KUBERNETES_RELEASE, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{what} is not valid Kubernetes {KUBERNETES_RELEASE}: {error.message} at {list(error.path)}")


def test_the_schema_check_catches_a_bad_manifest(objects) -> None:
    """The validation above can fail: a misspelt field and a wrong type are both caught."""
    web = get(objects, "Deployment", "web")
    misspelt = {**web, "spec": {**web["spec"], "replica": 2}}
    wrong_type = {**web, "spec": {**web["spec"], "replicas": "two"}}
    for bad in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBERNETES_RELEASE, strict=True)


# --- secrets and the public surface -------------------------------------------------------------


def test_no_manifest_carries_a_secret_value(objects) -> None:
    assert not [o for o in objects if o["kind"] == "Secret"], "the Secret is created by the operator, never here"
    for config_map in (o for o in objects if o["kind"] == "ConfigMap"):
        assert not SECRET_VARIABLES & set(config_map["data"]), config_map["metadata"]["name"]
    for w in workloads(objects):
        for c in all_containers(w):
            for entry in c.get("env", []):
                assert "value" not in entry or entry["name"] not in SECRET_VARIABLES, (c["name"], entry["name"])
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref == {"name": SECRET, "key": entry["name"]}, (c["name"], ref)


def route(ingress: dict, request_path: str) -> str:
    """The Service an Ingress sends a path to: the longest matching Prefix, element by element."""
    best, service = -1, ""
    for rule in ingress["spec"]["rules"]:
        for p in rule["http"]["paths"]:
            assert p["pathType"] == "Prefix"
            prefix = p["path"].rstrip("/")
            if request_path == prefix or request_path.startswith(prefix + "/") or prefix == "":
                if len(prefix) > best:
                    best, service = len(prefix), p["backend"]["service"]["name"]
    return service


def test_the_ingress_routes_only_the_public_paths(objects) -> None:
    ingress = get(objects, "Ingress", "web")
    to_web = {p["path"] for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]
              if p["backend"]["service"]["name"] == "web"}
    assert to_web == {"/", "/v1", "/api", "/static"}
    for public in ("/", "/v1/chat/completions", "/api/v1/adapters/", "/static/app.css", "/login/", "/t/acme/"):
        assert route(ingress, public) == "web", public
    for private in ("/internal", "/internal/adapters/3/files/adapter_model.safetensors", "/metrics"):
        assert route(ingress, private) == "not-public", private
    blackhole = get(objects, "Service", "not-public")
    assert "selector" not in blackhole["spec"]  # no endpoints: nothing behind it
    assert not [o for o in objects if o["kind"] in ("Endpoints", "EndpointSlice")]


# --- environment: declared, wired, and the same names as compose ----------------------------------


def test_every_container_variable_is_declared_by_the_configs(objects) -> None:
    assert not undeclared_variables(objects)


def test_an_undeclared_variable_is_reported(objects) -> None:
    planted = [dict(o) for o in objects]
    web = get(planted, "Deployment", "web")
    container = dict(pod_spec(web)["containers"][0])
    container["env"] = [*container["env"], {"name": "PORTAL_INTERNAL_ULR", "value": "http://web:8000"}]
    web["spec"] = {**web["spec"], "template": {**web["spec"]["template"], "spec": {
        **pod_spec(web), "containers": [container]}}}

    assert undeclared_variables(planted) == ["web/web: PORTAL_INTERNAL_ULR"]


def compose_env(wanted: str) -> dict[str, set[str]]:
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    names = {"portal": ("web", "worker", "fleet-worker", "beat"), "inference": tuple(s for s in services if s.startswith("inference"))}
    return {name: set(services[name].get("environment", {})) for name in names[wanted]}


@pytest.mark.parametrize(("wanted", "declared", "wiring"), [
    ("portal", portal_variables, PORTAL_WIRING),
    ("inference", inference_variables, INFERENCE_WIRING),
])
def test_compose_and_the_manifests_name_the_same_variables(objects, wanted, declared, wiring) -> None:
    compose = compose_env(wanted)
    manifests = {where: set(env) for where, env in side_env(objects, wanted).items()}
    assert compose and manifests
    for where, names in (*compose.items(), *manifests.items()):
        assert names <= declared(), f"{where}: not declared by the config: {sorted(names - declared())}"
        assert wiring <= names, f"{where}: no {sorted(wiring - names)}"
        if wanted == "portal":
            assert names & WORKER_FINDING, f"{where}: finds no worker (neither of {sorted(WORKER_FINDING)})"
    # What compose wires, the manifests wire too, under the same name.
    compose_names = set.union(*compose.values()) - WORKER_FINDING
    for where, names in manifests.items():
        assert compose_names <= names, f"{where} lacks {sorted(compose_names - names)} that compose sets"


def test_every_process_starts_in_production_with_the_rendered_settings(objects) -> None:
    """The real config classes accept what the pods get, with the Secret's keys filled in."""
    for where, env in side_env(objects, "portal").items():
        values = {k: v if isinstance(v, str) else EXAMPLE_SECRETS[k] for k, v in env.items()}
        config = WebConfig.from_env(values)
        assert config.is_production and config.secure_ssl_redirect, where
        assert {"SECRET_KEY", "INFERENCE_ADMIN_TOKEN", "DATABASE_URL", "REDIS_URL"} <= {
            k for k, v in env.items() if not isinstance(v, str)}, where
    for where, env in side_env(objects, "inference").items():
        values = {k: v if isinstance(v, str) else EXAMPLE_SECRETS[k] for k, v in env.items()}
        assert not isinstance(env["INFERENCE_ADMIN_TOKEN"], str), where  # from the Secret
        access = AccessConfig.from_env(values)
        assert access.environment == "production" and access.admin_token, where
        assert access.allow_runtime_lora_updating, where  # the portal stages adapters at run time
        EngineConfig.from_env(values)  # raises ConfigError on a bad value


def test_the_workers_and_the_portal_name_each_other(objects) -> None:
    [web_env] = [env for where, env in side_env(objects, "portal").items() if where == "web/web"]
    [inference_env] = side_env(objects, "inference").values()
    internal = web_env["PORTAL_INTERNAL_URL"]
    assert internal == "http://web:8000"
    assert inference_env["INFERENCE_PORTAL_ORIGINS"] == "http://web:8000"
    assert url_origin(internal) in AccessConfig.from_env(
        {"INFERENCE_PORTAL_ORIGINS": inference_env["INFERENCE_PORTAL_ORIGINS"]}).portal_origins
    host = urlsplit(internal).hostname
    assert host in web_env["ALLOWED_HOSTS"].split(",")  # the Host of the workers' downloads
    assert urlsplit(internal).port in [p["port"] for p in get(objects, "Service", host)["spec"]["ports"]]

    statefulset = get(objects, "StatefulSet", "inference")
    headless = get(objects, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    scaled = get(objects, "ScaledObject", "inference")
    # Every ready pod is an address record of the headless Service: the fleet finds them all,
    # however many KEDA starts; a pod that is loading or draining is not published (not routed).
    assert web_env["INFERENCE_DISCOVERY"] == f"dns://{headless['metadata']['name']}:{headless['spec']['ports'][0]['port']}"
    assert "INFERENCE_URLS" not in web_env
    assert not headless["spec"].get("publishNotReadyAddresses", False)
    assert scaled["spec"]["minReplicaCount"] <= statefulset["spec"]["replicas"] <= scaled["spec"]["maxReplicaCount"]


# --- workloads ------------------------------------------------------------------------------------


def test_every_container_has_requests_limits_and_probes(objects) -> None:
    for w in workloads(objects):
        for c in all_containers(w):
            where = f"{w['metadata']['name']}/{c['name']}"
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), where
        if w["kind"] in WORKLOADS:
            for c in pod_spec(w)["containers"]:
                assert "readinessProbe" in c and "livenessProbe" in c, f"{w['metadata']['name']}/{c['name']}"


def test_replicas_web_two_beat_exactly_one(objects) -> None:
    assert get(objects, "Deployment", "web")["spec"]["replicas"] == 2
    beat = get(objects, "Deployment", "celery-beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"]["type"] == "Recreate"  # never two during a rollout
    assert pod_spec(beat)["containers"][0]["command"][:4] == ["celery", "-A", "portal.celery", "beat"]
    for name in ("celery-worker", "celery-fleet-worker"):
        worker = get(objects, "Deployment", name)
        assert pod_spec(worker)["containers"][0]["command"][:4] == ["celery", "-A", "portal.celery", "worker"]


def test_the_fleet_poll_has_a_worker_of_its_own_and_every_queue_a_worker(objects) -> None:
    from django.conf import settings

    from tests.test_deploy_files import consumed_queues

    def queues(name: str) -> set[str]:
        return consumed_queues(pod_spec(get(objects, "Deployment", name))["containers"][0]["command"])

    assert queues("celery-fleet-worker") == {"fleet"}
    assert queues("celery-worker") == {queue.name for queue in settings.CELERY_TASK_QUEUES} - {"fleet"}
    assert get(objects, "Deployment", "celery-fleet-worker")["spec"]["replicas"] == 1


def test_prometheus_scrapes_the_web_pods_with_the_metrics_token(objects) -> None:
    monitor = get(objects, "ServiceMonitor", "web")["spec"]
    service = get(objects, "Service", "web")
    assert selects(monitor["selector"], service["metadata"]["labels"])
    [endpoint] = monitor["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == (service["spec"]["ports"][0]["name"], "/metrics")
    # The token by the Secret's name and key only, the very key the web pods read.
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": SECRET, "key": "METRICS_TOKEN"}}
    [web] = pod_spec(get(objects, "Deployment", "web"))["containers"]
    assert container_env(objects, web)["METRICS_TOKEN"] == {"secretKeyRef": {"name": SECRET, "key": "METRICS_TOKEN"}}


def test_probes_hit_the_health_endpoints(objects) -> None:
    [web] = pod_spec(get(objects, "Deployment", "web"))["containers"]
    assert web["readinessProbe"]["httpGet"]["path"] == "/healthz"
    [inference] = pod_spec(get(objects, "StatefulSet", "inference"))["containers"]
    assert inference["startupProbe"]["httpGet"]["path"] == "/ready"
    assert inference["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert inference["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = inference["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # the model's load


def test_only_the_job_migrates(objects) -> None:
    job = get(objects, "Job", "migrate")
    [migrate] = pod_spec(job)["containers"]
    assert migrate["command"] == ["python", "manage.py", "migrate", "--noinput"]
    assert side(migrate) == "portal"
    for w in (o for o in objects if o["kind"] in WORKLOADS):
        for c in all_containers(w):
            command = c.get("command", [])
            # The web image's CMD is uvicorn alone; at most a pod waits with `migrate --check`.
            assert "migrate" not in command or "--check" in command, f"{w['metadata']['name']}/{c['name']}"


def test_uploads_live_on_a_shared_read_write_many_volume(objects) -> None:
    claim = get(objects, "PersistentVolumeClaim", "adapter-storage")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for name in ("web", "celery-worker"):
        spec = pod_spec(get(objects, "Deployment", name))
        [volume] = [v["name"] for v in spec["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]]
        [container] = spec["containers"]
        mounts = {m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume}
        assert mounts == {container_env(objects, container)["STORAGE_ROOT"]}, name


def selects(selector: dict, labels: dict) -> bool:
    """A label selector's matchLabels and In expressions against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_only_web_and_celery_pods_reach_the_workers(objects) -> None:
    labels = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads(objects)}
    policy = get(objects, "NetworkPolicy", "inference")["spec"]
    assert selects(policy["podSelector"], labels["inference"])
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    in_namespace = [peer["podSelector"] for rule in policy["ingress"] for peer in rule["from"]
                    if "podSelector" in peer and "namespaceSelector" not in peer]
    allowed = {name for name, pod in labels.items() if any(selects(s, pod) for s in in_namespace)}
    assert allowed == {"web", "celery-worker", "celery-fleet-worker"}
    for rule in policy["ingress"]:
        assert rule["ports"] == [{"port": 8001, "protocol": "TCP"}]
    # Out: the web pods on 8000 (adapter downloads), and DNS.
    [to_web] = [rule for rule in policy["egress"]
                if any("namespaceSelector" not in p and selects(p["podSelector"], labels["web"]) for p in rule["to"])]
    assert to_web["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert {p["port"] for rule in policy["egress"] for p in rule["ports"]} == {8000, 53}


def test_the_workers_are_disrupted_autoscaled_and_scraped_as_one_set(objects) -> None:
    statefulset = get(objects, "StatefulSet", "inference")
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert selects(get(objects, "PodDisruptionBudget", "inference")["spec"]["selector"], pod_labels)

    scaled = get(objects, "ScaledObject", "inference")["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "inference"}
    [trigger] = scaled["triggers"]
    assert trigger["type"] == "prometheus" and "vllm:num_requests_waiting" in trigger["metadata"]["query"]
    metrics = (ROOT / "inference/server/metrics.py").read_text()
    assert '"vllm:num_requests_waiting"' in metrics  # the worker exports what KEDA asks for

    monitor = get(objects, "ServiceMonitor", "inference")["spec"]
    headless = get(objects, "Service", "inference-headless")
    assert selects(monitor["selector"], headless["metadata"]["labels"])
    assert [(e["port"], e["path"]) for e in monitor["endpoints"]] == [(headless["spec"]["ports"][0]["name"], "/metrics")]


# --- overlays and images --------------------------------------------------------------------------


def test_the_overlay_picks_the_device_and_the_image(overlay) -> None:
    name, objects = overlay
    [inference] = pod_spec(get(objects, "StatefulSet", "inference"))["containers"]
    env = container_env(objects, inference)
    if name == "gpu":
        assert env["INFERENCE_DEVICE"] == "cuda"
        assert inference["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert inference["image"].split(":")[0] == "loraplex-inference-cuda"
    else:
        assert env["INFERENCE_DEVICE"] == "cpu"
        assert "nvidia.com/gpu" not in inference["resources"]["limits"]
        assert inference["image"].split(":")[0] == "loraplex-inference"
    for w in workloads(objects):
        for c in all_containers(w):
            if side(c) == "portal":
                assert c["image"].split(":")[0] == "loraplex-web"


def test_operators_retag_the_images_with_kustomize(tmp_path) -> None:
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S / "overlays" / "gpu", tmp_path)],
        "images": [{"name": "loraplex-web", "newName": "registry.example/loraplex-web", "newTag": "1.4.0"},
                   {"name": "loraplex-inference-cuda", "newName": "registry.example/loraplex-inference-cuda",
                    "newTag": "1.4.0"}],
    }))

    images = {c["image"] for w in workloads(render(tmp_path)) for c in all_containers(w)}

    assert images == {"registry.example/loraplex-web:1.4.0", "registry.example/loraplex-inference-cuda:1.4.0",
                      f"{CELERY_EXPORTER_IMAGE}:0.12.2"}  # not ours: pinned, never retagged with the release


def test_the_cuda_image_is_the_cpu_image_with_torch_from_pypi() -> None:
    cpu = (DEPLOY / "Dockerfile.inference").read_text()
    cuda = (DEPLOY / "Dockerfile.inference-cuda").read_text()

    def instructions(text: str) -> list[str]:
        joined = "\n".join(line for line in text.splitlines() if not line.startswith("#")).replace("\\\n", " ")
        return [line for line in joined.splitlines() if line.strip()]

    [cpu_torch] = [line for line in instructions(cpu) if "torch==" in line]
    [cuda_torch] = [line for line in instructions(cuda) if "torch==" in line]
    assert cpu_torch == "RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"
    assert cuda_torch == "RUN pip install torch==2.13.0"  # PyPI's default wheel: CUDA, same pin
    assert instructions(cuda)[0] == "FROM python:3.11-slim"
    # Everything else as in the CPU image, the C++ compiler included (g++ brings gcc: Triton builds
    # its GPU launcher with it; the CPU worker its fused LoRA kernel, kernels/cpu_fused.py).
    assert [line for line in instructions(cpu) if line != cpu_torch] == [
        line for line in instructions(cuda) if line != cuda_torch]
    assert any("apt-get install" in line and "g++" in line for line in instructions(cpu))
