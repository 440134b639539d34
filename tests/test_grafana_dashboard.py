"""deploy/k8s/base/grafana/loraplex-dashboard.json: a Grafana dashboard whose every query parses as
PromQL and reads only series, and labels, that a process of ours really exports:

- inference workers: a real /metrics scrape of a tiny worker that served a base and an adapter
  request (so every family, labelled ones included, has samples);
- the web process: its registry (portal.core.metrics.REGISTRY), collected in this process;
- Celery: celery-exporter's series, pinned below for the release the manifests deploy.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import httpx
import promql_parser
import pytest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy/k8s/base/grafana/loraplex-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Labels the Prometheus Operator puts on every series a ServiceMonitor scrapes.
TARGET_LABELS = {"namespace", "pod", "service", "endpoint", "job", "instance", "container"}
# Grafana's interval macros, replaced by a duration before parsing (PromQL has no `$`).
GRAFANA_DURATIONS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "6h"}

# celery-exporter 0.12.2 (danihodovic/celery-exporter, src/exporter.py at tag v0.12.2), default
# --metric-prefix celery_: series -> labels. The image deploy/k8s/base/celery-exporter.yaml runs
# must be this release (tests/test_k8s_monitoring.py checks).
CELERY_EXPORTER_IMAGE = "ghcr.io/danihodovic/celery-exporter:0.12.2"
_TASK = {"name", "hostname", "queue_name"}
CELERY_EXPORTER_SERIES = {
    **{f"celery_task_{event}_total": _TASK
       for event in ("sent", "received", "started", "succeeded", "rejected", "revoked", "retried")},
    "celery_task_failed_total": _TASK | {"exception"},
    "celery_task_runtime_bucket": _TASK | {"le"},
    "celery_task_runtime_sum": _TASK,
    "celery_task_runtime_count": _TASK,
    "celery_worker_up": {"hostname"},
    "celery_worker_tasks_active": {"hostname"},
    "celery_queue_length": {"queue_name"},
    "celery_active_consumer_count": {"queue_name"},
    "celery_active_worker_count": {"queue_name"},
    "celery_active_process_count": {"queue_name"},
}

# What issue 15 asks the dashboard to show, by the names the processes export.
REQUIRED = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
    "loraplex:lora_cache_hits_total", "loraplex:lora_cache_misses_total", "loraplex:lora_cache_evictions_total",
    "loraplex:lora_cache_loads_total", "loraplex:lora_cache_load_failures_total", "loraplex:adapter_resident",
    "loraplex_gateway_requests_total", "loraplex_gateway_request_duration_seconds_bucket",
    "loraplex_gateway_time_to_first_token_seconds_bucket", "loraplex_gateway_errors_total",
    "loraplex_gateway_quota_rejections_total", "loraplex_gateway_upstream_retries_total",
    "loraplex_ledger_writes_total", "loraplex_celery_queue_depth", "loraplex_fleet_workers",
    "celery_task_succeeded_total", "celery_task_failed_total", "celery_queue_length", "celery_worker_up",
}

Series = dict[str, set[str]]  # series name -> its label names


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


# --- what the processes export ---------------------------------------------------------------------

# The series of a family by its type (`_created` only where a sample shows it: the web process
# turns those off).
SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
                   "info": ("_info",), "summary": ("", "_sum", "_count")}


def series_of(families) -> Series:
    """Every sample name with the labels seen on it; a family without samples still names its
    series (by its type), with no labels."""
    found: Series = {}
    for family in families:
        for suffix in SAMPLE_SUFFIXES.get(family.type, ("",)):
            found.setdefault(family.name + suffix, set())
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return found


@pytest.fixture(scope="module")
def inference_series(tmp_path_factory) -> Series:
    """/metrics of a real tiny worker after a base and an adapter request."""
    import transformers
    from peft import LoraConfig, get_peft_model

    from tests.inference.server.server_process import start_server
    from tests.inference.server.tiny_lora import write_base

    root = tmp_path_factory.mktemp("dashboard_worker")
    base = write_base(root / "base")
    model = transformers.LlamaForCausalLM.from_pretrained(base).eval()
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
                   ).save_pretrained(root / "ad", save_embedding_layers=False)
    worker = start_server(["--model", str(base), "--served-model-name", "tiny", "--dtype", "float32",
                           "--kv-cache-memory", "4MiB", "--lora-modules", f"ad={root / 'ad'}"], root / "worker.log")
    try:
        for model_name in ("tiny", "ad"):  # streamed: time to first token and inter-token gaps too
            answer = httpx.post(f"{worker.url}/v1/completions", timeout=60, json={
                "model": model_name, "prompt": "t5 t6 t7", "max_tokens": 3, "stream": True})
            assert answer.status_code == 200, answer.text
        text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    finally:
        worker.stop()
    return series_of(text_string_to_metric_families(text))


def web_series() -> Series:
    """The web process's registry. Labelled counters and histograms with no child yet have no
    samples: their label names come from the metric objects."""
    from portal.core.metrics import REGISTRY

    found = series_of(REGISTRY.collect())
    for collector, names in REGISTRY._collector_to_names.items():  # noqa: SLF001 -- no public way to list them
        if isinstance(collector, MetricWrapperBase):
            for name in set(names) & found.keys():  # the registry also lists the family's own name
                found[name] |= set(collector._labelnames)  # noqa: SLF001
                if name.endswith("_bucket"):
                    found[name].add("le")
    return found


@pytest.fixture
def exports(inference_series, db) -> Series:
    """Every series of every process, by name. No name is exported by two of them."""
    web = web_series()
    assert not (inference_series.keys() & web.keys()), inference_series.keys() & web.keys()
    assert not ((inference_series.keys() | web.keys()) & CELERY_EXPORTER_SERIES.keys())
    return {**inference_series, **web, **CELERY_EXPORTER_SERIES}


# --- reading the dashboard -------------------------------------------------------------------------


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(where, PromQL, legend) for every panel target and every query variable (the selector
    inside label_values(selector, label))."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((f"panel {panel['id']} {panel['title']!r} {target.get('refId')}", target.get("expr", ""),
                          target.get("legendFormat", "")))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert m, f"variable {variable['name']}: {query}"
            found.append((f"variable {variable['name']}", m.group(1), "{{" + m.group(2) + "}}"))
    return found


def parse(expr: str):
    for macro, duration in GRAFANA_DURATIONS.items():
        expr = expr.replace(macro, duration)
    return promql_parser.parse(expr)


def children(node) -> list:
    if isinstance(node, promql_parser.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, promql_parser.Call):
        return list(node.args)
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.vector_selector]
    if isinstance(node, promql_parser.AggregateExpr):
        return [node.expr] + ([node.param] if node.param is not None else [])
    if isinstance(node, promql_parser.ParenExpr | promql_parser.UnaryExpr | promql_parser.SubqueryExpr):
        return [node.expr]
    return []


def walk(node):
    yield node
    for child in children(node):
        yield from walk(child)


def result_labels(node, exports: Series) -> set[str]:
    """The label names the series an expression returns can carry."""
    if isinstance(node, promql_parser.VectorSelector):
        return exports.get(node.name, set()) | TARGET_LABELS
    if isinstance(node, promql_parser.AggregateExpr):
        inner = result_labels(node.expr, exports)
        if str(node.op) in ("topk", "bottomk"):  # the selected series, unchanged
            return inner
        if node.modifier is None:
            return set()
        if node.modifier.type == promql_parser.AggModifierType.By:
            return set(node.modifier.labels)
        return inner - set(node.modifier.labels)
    if isinstance(node, promql_parser.Call):
        vectors = [a for a in node.args if not isinstance(a, promql_parser.NumberLiteral | promql_parser.StringLiteral)]
        if node.func.name == "histogram_quantile":
            return result_labels(node.args[1], exports) - {"le"}
        if node.func.name == "label_replace":
            return result_labels(node.args[0], exports) | {node.args[1].val}
        if node.func.name in ("scalar", "time", "vector") or not vectors:
            return set()
        return result_labels(vectors[0], exports)
    if isinstance(node, promql_parser.BinaryExpr):
        lhs, rhs = result_labels(node.lhs, exports), result_labels(node.rhs, exports)
        if isinstance(node.lhs, promql_parser.NumberLiteral):
            return rhs
        if node.modifier is not None and node.modifier.card == promql_parser.VectorMatchCardinality.OneToMany:
            return rhs | set(node.modifier.group_labels or [])
        if node.modifier is not None and node.modifier.card == promql_parser.VectorMatchCardinality.ManyToOne:
            return lhs | set(node.modifier.group_labels or [])
        return lhs
    children_ = children(node)
    return result_labels(children_[0], exports) if children_ else set()


def query_problems(where: str, expr: str, legend: str, exports: Series) -> list[str]:
    try:
        tree = parse(expr)
    except ValueError as error:
        return [f"{where}: not PromQL ({error}): {expr}"]
    problems = []
    for node in walk(tree):
        if isinstance(node, promql_parser.VectorSelector):
            if node.name not in exports:
                problems.append(f"{where}: {node.name} is exported by no process")
                continue
            matchers = {(m.name, m.value) for m in node.matchers.matchers}
            if ("namespace", "$namespace") not in matchers and where != "variable namespace":  # it lists them
                problems.append(f'{where}: {node.name} is not scoped to namespace="$namespace"')
            for name, _ in matchers:
                if name not in exports[node.name] | TARGET_LABELS:
                    problems.append(f"{where}: {node.name} has no label {name!r}")
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            inner = result_labels(node.expr, exports)
            for name in node.modifier.labels:
                if name not in inner:
                    problems.append(f"{where}: {node.op} by/without {name!r}, a label none of its series has")
    for name in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
        if name not in result_labels(tree, exports):
            problems.append(f"{where}: legend {{{{{name}}}}} names a label the result does not have")
    return problems


def structure_problems(dashboard: dict) -> list[str]:
    problems = []
    ids = [p["id"] for p in dashboard["panels"]]
    if len(ids) != len(set(ids)):
        problems.append(f"panel ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    for panel in dashboard["panels"]:
        where = f"panel {panel['id']} {panel.get('title')!r}"
        pos = panel["gridPos"]
        if pos["x"] + pos["w"] > 24:
            problems.append(f"{where}: wider than the grid")
        if panel["type"] == "row":  # a heading: no query of its own
            continue
        if panel.get("datasource") != DATASOURCE:
            problems.append(f"{where}: datasource is not the ${{datasource}} variable")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{where}: no targets")
        ref_ids = [t.get("refId") for t in targets]
        if len(ref_ids) != len(set(ref_ids)):
            problems.append(f"{where}: refIds repeat")
        for target in targets:
            if target.get("datasource") != DATASOURCE or not target.get("expr"):
                problems.append(f"{where} {target.get('refId')}: no expr or not on ${{datasource}}")
    return problems


def dashboard_problems(dashboard: dict, exports: Series) -> list[str]:
    return structure_problems(dashboard) + [
        problem for where, expr, legend in queries(dashboard) for problem in query_problems(where, expr, legend, exports)]


def used_series(dashboard: dict) -> set[str]:
    return {node.name for _, expr, _ in queries(dashboard) for node in walk(parse(expr))
            if isinstance(node, promql_parser.VectorSelector)}


# --- tests -----------------------------------------------------------------------------------------


def test_the_dashboard_is_an_importable_grafana_dashboard() -> None:
    dashboard = load()
    assert dashboard["uid"] == "loraplex-overview" and dashboard["title"]
    assert dashboard["id"] is None  # provisioned or imported: Grafana assigns it
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["type"] == "query" and variables["namespace"]["datasource"] == DATASOURCE
    assert variables["namespace"]["current"]["value"] == "loraplex"  # the kustomization's namespace
    assert {p["type"] for p in dashboard["panels"]} == {"row", "stat", "timeseries"}
    assert structure_problems(dashboard) == []


def test_every_query_reads_series_and_labels_a_process_exports(exports) -> None:
    assert dashboard_problems(load(), exports) == []


def test_the_dashboard_shows_each_process(exports) -> None:
    used = used_series(load())
    assert REQUIRED <= used, sorted(REQUIRED - used)
    assert REQUIRED <= exports.keys(), sorted(REQUIRED - exports.keys())


def plant(dashboard: dict, title: str, change) -> dict:
    planted = copy.deepcopy(dashboard)
    [panel] = [p for p in planted["panels"] if p["title"] == title]
    change(panel)
    return planted


def set_expr(expr: str, legend: str = ""):
    def change(panel: dict) -> None:
        panel["targets"][0]["expr"] = expr
        panel["targets"][0]["legendFormat"] = legend
    return change


@pytest.mark.parametrize(("change", "expected"), [
    (set_expr('sum(vllm:num_requests_runing{namespace="$namespace"})'),
     "vllm:num_requests_runing is exported by no process"),
    (set_expr('sum(rate(loraplex_gateway_requests{namespace="$namespace"}[$__rate_interval]))'),
     "loraplex_gateway_requests is exported by no process"),  # a counter without _total
    (set_expr('sum by (tenant) (vllm:num_requests_waiting{namespace="$namespace"})', "{{tenant}}"),
     "sum by/without 'tenant', a label none of its series has"),
    (set_expr('sum by (pod) (vllm:num_requests_waiting{namespace="$namespace"})', "{{adapter}}"),
     "legend {{adapter}} names a label the result does not have"),
    (set_expr('sum(celery_queue_length{namespace="$namespace", queue="celery"})'),
     "celery_queue_length has no label 'queue'"),
    (set_expr("sum(loraplex:ready)"), 'loraplex:ready is not scoped to namespace="$namespace"'),
    (set_expr('sum(rate(vllm:prompt_tokens_total{namespace="$namespace"}[$__rate_interval])'), "not PromQL"),
    (lambda panel: panel.pop("datasource"), "datasource is not the ${datasource} variable"),
    (lambda panel: panel.update(targets=[]), "no targets"),
])
def test_a_planted_mistake_is_reported(exports, change, expected) -> None:
    dashboard = load()
    assert dashboard_problems(dashboard, exports) == []

    problems = dashboard_problems(plant(dashboard, "Requests running", change), exports)

    assert len(problems) == 1 and expected in problems[0], problems


def test_repeated_panel_ids_are_reported() -> None:
    dashboard = load()
    dashboard["panels"][3]["id"] = dashboard["panels"][2]["id"]
    assert structure_problems(dashboard) == [f"panel ids repeat: [{dashboard['panels'][2]['id']}]"]
