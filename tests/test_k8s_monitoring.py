"""deploy/k8s monitoring: every process is scraped by Prometheus (a ServiceMonitor, or for the
Celery worker and beat, the celery-exporter reading their task events), the NetworkPolicies let
Prometheus in, and the Grafana dashboard ships as a ConfigMap the Grafana sidecar picks up."""

from __future__ import annotations

import copy
import json

import pytest

from tests.test_grafana_dashboard import CELERY_EXPORTER_IMAGE, DASHBOARD
from tests.test_k8s_manifests import K8S, OVERLAYS, SECRET, get, pod_spec, render, selects

MONITORING_NAMESPACE = "monitoring"  # where Prometheus runs (network-policy.yaml says so too)
# kubectl apply (client side) keeps the whole object in an annotation, and annotations are
# limited to 256 KiB in all.
LAST_APPLIED_LIMIT = 256 * 1024


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request) -> list[dict]:
    return render(K8S / "overlays" / request.param)


def processes(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def is_celery(workload: dict) -> bool:
    """The Celery worker and beat: they serve no /metrics; their task events do the telling."""
    return pod_spec(workload)["containers"][0].get("command", [])[:3] == ["celery", "-A", "portal.celery"]


def scraped(objects: list[dict]) -> list[tuple[dict, dict, int]]:
    """(ServiceMonitor, workload, container port) for every port a ServiceMonitor reaches: its
    endpoint names a port of a Service it selects, whose targetPort names a port of the pods."""
    found = []
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        for service in (o for o in objects if o["kind"] == "Service"):
            if not selects(monitor["spec"]["selector"], service["metadata"].get("labels", {})):
                continue
            for endpoint in monitor["spec"]["endpoints"]:
                [port] = [p for p in service["spec"]["ports"] if p.get("name") == endpoint["port"]]
                for workload in processes(objects):
                    pod = workload["spec"]["template"]
                    if not selects({"matchLabels": service["spec"].get("selector", {})}, pod["metadata"]["labels"]):
                        continue
                    numbers = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"]
                               for p in c.get("ports", [])}
                    assert port["targetPort"] in numbers, (monitor["metadata"]["name"], port)
                    found.append((monitor, workload, numbers[port["targetPort"]]))
    return found


def admits_prometheus(rule: dict, port: int) -> bool:
    """An ingress rule that lets every pod of Prometheus's namespace reach `port` (a rule without
    `from` or `ports` admits any source or port)."""
    peers = rule.get("from")
    ports = rule.get("ports")
    return (peers is None or any(
        "namespaceSelector" in peer and "podSelector" not in peer
        and selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": MONITORING_NAMESPACE})
        for peer in peers)) and (ports is None or any(p.get("port") == port for p in ports))


def unreachable(objects: list[dict]) -> list[str]:
    """Scraped ports that a NetworkPolicy on their pods keeps Prometheus's namespace away from."""
    problems = []
    for monitor, workload, port in scraped(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
            spec = policy["spec"]
            if "Ingress" not in spec.get("policyTypes", []) or not selects(spec["podSelector"], labels):
                continue
            if not any(admits_prometheus(rule, port) for rule in spec.get("ingress", [])):
                problems.append(f"{policy['metadata']['name']} blocks Prometheus from "
                                f"{workload['metadata']['name']}:{port} ({monitor['metadata']['name']})")
    return problems


def exporter_container(objects: list[dict]) -> dict:
    [container] = pod_spec(get(objects, "Deployment", "celery-exporter"))["containers"]
    return container


# --- every process is scraped ----------------------------------------------------------------------


def test_every_process_has_a_service_monitor(objects) -> None:
    scraped_names = {workload["metadata"]["name"] for _, workload, _ in scraped(objects)}
    for workload in processes(objects):
        name = workload["metadata"]["name"]
        if is_celery(workload):
            assert "celery-exporter" in scraped_names, f"{name}: its events are exported by nobody scraped"
        else:
            assert name in scraped_names, f"{name}: no ServiceMonitor reaches it"
    assert {"web", "inference", "celery-exporter"} <= scraped_names
    assert {w["metadata"]["name"] for w in processes(objects) if is_celery(w)} >= {"celery-worker", "celery-beat"}
    for monitor, _, _ in scraped(objects):
        assert [e["path"] for e in monitor["spec"]["endpoints"]] == ["/metrics"]


def test_prometheus_is_let_through_to_every_scraped_port(objects) -> None:
    assert unreachable(objects) == []


def test_a_policy_that_shuts_prometheus_out_is_reported(objects) -> None:
    planted = copy.deepcopy(objects)
    policy = get(planted, "NetworkPolicy", "inference")["spec"]
    policy["ingress"] = [rule for rule in policy["ingress"]
                         if not any("namespaceSelector" in peer for peer in rule["from"])]

    assert unreachable(planted) == ["inference blocks Prometheus from inference:8001 (inference)"]


# --- the celery-exporter -----------------------------------------------------------------------


def test_the_celery_exporter_reads_the_broker_named_by_the_secret(objects) -> None:
    from django.conf import settings

    deployment = get(objects, "Deployment", "celery-exporter")
    assert deployment["spec"]["replicas"] == 1  # two would count every event twice
    container = exporter_container(objects)
    assert container["image"] == CELERY_EXPORTER_IMAGE  # the release whose series the dashboard test pins
    args = dict(arg.removeprefix("--").partition("=")[::2] for arg in container["args"])
    # The same Secret key as the web and Celery pods' REDIS_URL, expanded by the kubelet.
    assert args["broker-url"] == "$(REDIS_URL)"
    assert container["env"] == [{"name": "REDIS_URL", "valueFrom": {"secretKeyRef": {"name": SECRET, "key": "REDIS_URL"}}}]
    # Every queue the portal routes to, so each length is reported even with no worker on it.
    assert args["queues"].split(",") == [queue.name for queue in settings.CELERY_TASK_QUEUES]
    assert settings.CELERY_TASK_DEFAULT_QUEUE == "celery"  # the exporter's --default-queue-name
    buckets = [float(b) for b in args["buckets"].split(",")]
    assert buckets == sorted(buckets) and buckets[-1] >= 660  # the longest task's hard time limit
    [port] = container["ports"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": port["name"]}
    assert int(args["port"]) == port["containerPort"]


def test_celery_sends_the_task_events_the_exporter_counts() -> None:
    from portal.celery import app

    assert app.conf.worker_send_task_events is True  # received, started, succeeded, failed, retried
    assert app.conf.task_send_sent_event is True  # sent (web, beat)


# --- the dashboard ---------------------------------------------------------------------------------


def test_the_dashboard_ships_as_a_configmap_the_grafana_sidecar_loads(objects) -> None:
    config_map = get(objects, "ConfigMap", "loraplex-grafana-dashboard")  # no hash suffix: one copy, ever
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert list(config_map["data"]) == [DASHBOARD.name]
    assert json.loads(config_map["data"][DASHBOARD.name]) == json.loads(DASHBOARD.read_text())
    assert len(json.dumps(config_map)) < LAST_APPLIED_LIMIT
