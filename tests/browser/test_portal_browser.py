"""The tenant portal in a real browser (Debian chromium via Playwright) against the live ASGI app
and a real inference worker (SmolLM2-135M on CPU). One member journey: log in, create a key,
upload an adapter and watch it become ready, chat with it in the playground (tokens stream, Stop
aborts, markup stays text), see an invalid upload's reason, call the gateway with the key, find
every request on the usage page, its chart, the export, the overview and the bill; then a staff
user sees the traffic on the dashboards. Every page visited is saved, in order, under
tests/browser/artifacts/."""

from __future__ import annotations

import csv
import io
import re

import httpx
import pytest

from portal.adapters.validation import SMOLLM2_135M
from portal.fleet.services import fleet_poll
from tests.browser.conftest import log_in, make_user, new_page, off_loop, shot, wait_until
from tests.portal.adapters.peft_files import peft_config, write_peft

pytestmark = pytest.mark.slow


def _wait_for_status(page, number: int, status: str, timeout_s: float = 60) -> None:
    """The page polls the status API and reloads when a version settles."""
    page.wait_for_selector(f"#version-{number}[data-status={status}]", timeout=timeout_s * 1000)


def _wait_for_playground(page, condition: str, timeout_s: float = 60) -> None:
    """Wait until #pg-status's text satisfies a JS expression over `s`."""
    page.wait_for_function(f"(() => {{ const s = document.getElementById('pg-status').textContent; return {condition}; }})()",
                           timeout=timeout_s * 1000)


def _cells(page, table: str, row_text: str) -> list[str]:
    return [cell.strip() for cell in page.locator(f"{table} tbody tr", has_text=row_text).first.locator("td").all_inner_texts()]


LAST_ANSWER = "(() => { const t = document.querySelectorAll('.pg-msg.assistant .text'); return t[t.length - 1]; })()"
XSS = "<img src=x onerror=alert(1)>"


def _playground(page, live, worker) -> None:
    """The adapter in the playground: tokens stream, Stop ends the generation, a short turn
    finishes with its stats, and what the user typed stays text. Two ledger rows."""
    page.goto(f"{live.url}/t/acme/playground/")
    _wait_for_playground(page, "s === 'connected'")
    assert "acme/support-bot" in page.locator("#pg-model option").all_inner_texts()
    page.select_option("#pg-model", "acme/support-bot")
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max-tokens", "200")
    page.fill("#pg-input", "Count from 1 to 100, one number per line.")
    page.click("#pg-send")
    answer = page.locator(".pg-msg.assistant .text").last
    stop, send = page.locator("#pg-stop"), page.locator("#pg-send")
    seen = [""]
    for _ in range(3):  # the answer grows while Stop is enabled: tokens stream in
        page.wait_for_function(f"n => {LAST_ANSWER}.textContent.length > n", arg=len(seen[-1]))
        assert stop.is_enabled() and send.is_disabled()
        seen.append(answer.text_content())
    assert all(len(a) < len(b) and b.startswith(a) for a, b in zip(seen, seen[1:], strict=False)), seen
    assert page.inner_text("#pg-status") == "generating…"
    shot(page, "10-playground-streaming")

    stop.click()
    _wait_for_playground(page, "s === 'stopped'")
    stopped_at = answer.text_content()
    assert stopped_at.startswith(seen[-1])
    page.wait_for_timeout(300)
    assert answer.text_content() == stopped_at  # nothing arrives after Stop
    assert stop.is_disabled() and send.is_enabled()
    # The worker aborted the request too (200 tokens on this CPU would take many seconds more).
    wait_until(lambda: worker.metric("vllm:num_requests_running") == 0
               and worker.metric("vllm:num_requests_waiting") == 0, timeout_s=5)
    shot(page, "11-playground-stopped")

    page.fill("#pg-max-tokens", "6")
    page.fill("#pg-input", f"Say hi {XSS}")
    page.click("#pg-send")
    _wait_for_playground(page, "s.startsWith('done')")
    stats = page.inner_text("#pg-stats")
    assert "time to first token" in stats and "tokens/s" in stats, stats
    assert answer.text_content().strip()
    # What the user typed is shown as text, never parsed: no <img>, no alert.
    assert page.locator(".pg-msg.user .text").last.text_content() == f"Say hi {XSS}"
    assert page.locator("#pg-log img").count() == 0
    assert page.locator(".pg-msg.assistant").count() == 2 and page.locator(".pg-msg.error").count() == 0
    shot(page, "12-playground-done")
    assert page.dialogs == []


def _usage_rows(tenant_slug: str) -> int:
    from portal.usage.models import UsageRecord

    return UsageRecord.objects.filter(tenant__slug=tenant_slug).count()


def test_member_journey_key_upload_ready_playground_usage(live, worker, browser, page, tmp_path):
    make_user("mia", {"acme": "owner", "globex": "member"})
    page.goto(f"{live.url}/login/")
    shot(page, "01-login")
    page.fill("#id_username", "mia")
    page.fill("#id_password", "wrong password")
    page.click("button[type=submit]")
    assert "correct username and password" in page.inner_text(".form-errors")
    page.fill("#id_password", "browser-test-pass-1")
    page.click("button[type=submit]")
    page.wait_for_url(f"{live.url}/t/")
    assert "Acme Inc" in page.inner_text("main") and "Globex Inc" in page.inner_text("main")
    shot(page, "02-tenant-picker")

    page.click(".tenant-list >> text=Acme Inc")
    page.wait_for_url(f"{live.url}/t/acme/")
    assert page.inner_text("#stat-requests") == "0"
    shot(page, "03-overview-empty")
    # Switching tenant with the header's select.
    page.select_option("#tenant-switch", label="Globex Inc")
    page.wait_for_url(f"{live.url}/t/globex/")
    shot(page, "04-overview-switched")
    page.goto(f"{live.url}/t/acme/keys/")

    # API key: the secret is shown once.
    page.fill("#id_name", "")
    page.click("text=Create key")
    assert "This field is required." in page.inner_text(".field.has-error")
    shot(page, "05-keys-inline-error")
    page.fill("#id_name", "browser <key>")
    page.click("text=Create key")
    secret = page.inner_text("#new-key-secret").strip()
    assert secret.startswith("sk-")
    shot(page, "06-keys-secret-once")
    page.goto(f"{live.url}/t/acme/keys/")
    assert secret not in page.content() and "browser <key>" in page.inner_text("table")
    shot(page, "07-keys-list")

    # Adapter: create, upload a valid version with the progress bar, watch it become ready.
    page.goto(f"{live.url}/t/acme/adapters/")
    shot(page, "08-adapters-empty")
    page.fill("#id_name", "support-bot")
    page.fill("#id_description", "Answers <b>support</b> questions")
    page.click("text=Create adapter")
    page.wait_for_url(f"{live.url}/t/acme/adapters/support-bot/")
    good = write_peft(tmp_path / "good", SMOLLM2_135M)
    page.set_input_files("#id_files", [str(good / "adapter_config.json"), str(good / "adapter_model.safetensors")])
    page.click("#upload-form button[type=submit]")
    page.wait_for_selector("#upload-progress:not([hidden])")
    _wait_for_status(page, 1, "ready")
    assert "serving" in page.inner_text("#version-1")
    assert page.locator("#upload-error").is_hidden()
    shot(page, "09-adapter-ready")

    # Chat with it in the playground: stream, stop, a short turn that finishes.
    _playground(page, live, worker)

    # An invalid upload (rank over the fleet's maximum) shows its reason.
    page.goto(f"{live.url}/t/acme/adapters/support-bot/")
    bad = write_peft(tmp_path / "bad", SMOLLM2_135M, config=peft_config(r=32), rank=32)
    page.set_input_files("#id_files", [str(bad / "adapter_config.json"), str(bad / "adapter_model.safetensors")])
    page.click("#upload-form button[type=submit]")
    _wait_for_status(page, 2, "rejected")
    reasons = page.inner_text("#version-2 .reasons")
    assert re.search(r"rank", reasons), reasons
    shot(page, "13-adapter-rejected-reason")

    # Refused at once by the API (not a PEFT pair): the reason shows under the form, as text.
    notes = tmp_path / "notes.txt"
    notes.write_text("<b>not an adapter</b>")
    page.set_input_files("#id_files", [str(notes)])
    page.click("#upload-form button[type=submit]")
    page.wait_for_selector("#upload-error:not([hidden])")
    assert page.inner_text("#upload-error").strip()
    assert page.locator("#upload-error b").count() == 0
    shot(page, "14-upload-refused")

    # The new key works through the gateway on the real worker: the base and the adapter.
    with httpx.Client(base_url=f"{live.url}/v1", headers={"Authorization": f"Bearer {secret}"}, timeout=120) as api:
        models = api.get("/models").json()["data"]
        base = models[0]["id"]
        reply = api.post("/chat/completions", json={
            "model": base, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        tuned = api.post("/chat/completions", json={
            "model": "acme/support-bot", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})
        assert tuned.status_code == 200, tuned.text

    # The usage page counts the playground's requests like the API's: 2 + 2. The stopped one is
    # a request (no error) but not a completed one (the client left before the end).
    wait_until(lambda: _usage_rows("acme") == 4)
    page.goto(f"{live.url}/t/acme/usage/")
    page.wait_for_selector("#chart-daily[data-ready='1']")
    page.wait_for_selector("#chart-models[data-ready='1']")
    assert _cells(page, "#usage-by-model", "acme/support-bot")[1:3] == ["3", "0"]  # requests, errors
    assert _cells(page, "#usage-by-model", base)[1:3] == ["1", "0"]
    daily = page.evaluate("""() => { const d = document.getElementById('chart-daily').chart.data.datasets;
                                     return [d[2].data.slice(-1)[0], d[3].data.slice(-1)[0]]; }""")
    assert daily == [4, 0]  # requests, errors today
    labels = page.evaluate("document.getElementById('chart-models').chart.data.labels")
    assert sorted(labels) == sorted([base, "acme/support-bot"])
    assert "Over 3 completed requests" in page.inner_text("main")
    shot(page, "15-usage-with-chart")
    # The export has one row per request; the stopped one: client disconnected, no error.
    href = page.get_attribute("text=Every request in this period (CSV)", "href")
    export = page.request.get(f"{live.url}{href}")
    assert export.ok
    rows = list(csv.DictReader(io.StringIO(export.text())))
    assert len(rows) == 4
    playground = [row for row in rows if not row["api_key"]]
    assert [row["model"] for row in playground] == ["acme/support-bot"] * 2
    stopped, finished = playground
    assert stopped["client_disconnected"] == "true" and stopped["status_code"] == "200" and not stopped["error"]
    assert 0 < int(stopped["completion_tokens"]) < 200 and not stopped["finish_reason"]
    assert finished["client_disconnected"] == "false" and finished["finish_reason"] in ("length", "stop")
    assert 0 < int(finished["completion_tokens"]) <= 6
    assert all(row["stream"] == "true" for row in playground)

    page.goto(f"{live.url}/t/acme/")
    assert page.inner_text("#stat-requests") == "4"
    shot(page, "16-overview")
    page.goto(f"{live.url}/t/acme/billing/")
    statement = page.inner_text("#statement")
    assert base in statement and "acme/support-bot" in statement
    assert page.inner_text("#statement tfoot th.num >> nth=0") == "4"
    shot(page, "17-billing")
    assert page.js_errors == [] and page.dialogs == []

    # Staff see the traffic on the dashboards (their own browser context).
    make_user("sam", {}, staff=True)
    staff = new_page(browser)
    try:
        log_in(staff, live, "sam")
        _dashboards(staff, live, worker)
    finally:
        staff.context.close()


# (name, path, distinct JSON URLs its charts read, charts): the fleet page's 3 snapshot charts
# share fleet.json, its 5 history charts fleet-history.json; the latency page's 5 share one.
DASHBOARDS = [("fleet", "", 2, 8), ("tenants", "tenants/", 1, 1), ("latency", "latency/", 1, 5),
              ("errors", "errors/", 1, 1), ("objectives", "objectives/", 1, 1), ("adapters", "adapters/", 1, 1),
              ("billing", "billing/", 1, 1)]
CHART_SUM = """([kind, label]) => { const c = Chart.getChart(document.querySelector(`canvas[data-chart="${kind}"]`));
  const d = c.data.datasets.find(d => d.label === label); return d ? d.data.reduce((a, b) => a + (b || 0), 0) : 0; }"""


def _dashboards(staff, live, worker) -> None:
    """Every dashboard on the last 15 minutes (a live range): its charts drew from its JSON; then
    a new ledger row shows up on the latency and errors pages without a reload."""
    from portal.dashboards import views

    off_loop(fleet_poll)  # what beat does every 10 s: the page shows the worker as last polled
    json_requests: list[str] = []
    staff.on("request", lambda r: json_requests.append(r.url) if ".json" in r.url else None)
    for number, (name, path, sources, charts) in enumerate(DASHBOARDS, start=1):
        json_requests.clear()
        staff.goto(f"{live.url}/dashboards/{path}" + ("" if name == "billing" else "?range=15m"))
        staff.wait_for_load_state("networkidle")
        assert staff.locator("p.bad").count() == 0, name  # a chart that failed to load says so
        assert staff.locator("canvas[data-chart]").count() == charts, name
        assert staff.evaluate("[...document.querySelectorAll('canvas[data-chart]')].every(c => Chart.getChart(c))"), name
        assert len(set(json_requests)) == sources, (name, json_requests)
        assert staff.locator("#dash-live").count() == (name != "billing"), name
        if name == "fleet":
            row = staff.locator("tbody tr", has_text=worker.url)
            assert row.count() == 1 and "unhealthy" not in row.inner_text()
            assert row.locator(".ok", has_text=re.compile(r"^healthy$")).count() == 1
            # The adapter cache saw this journey's adapter requests (2 playground turns, 1 API call).
            cache = re.search(r"of (\d+) adapter requests found the adapter in memory", staff.inner_text("#fleet-cache"))
            assert cache and int(cache[1]) >= 3, staff.inner_text("#fleet-cache")
            assert "% warm" in row.inner_text()
            # The poll above is in the history: the running-requests chart has a point, and the
            # worker's first poll is a health change, drawn as a marker and listed.
            assert staff.evaluate("Chart.getChart(document.querySelector('canvas[data-chart=history-requests]'))"
                                  ".data.datasets[0].data.some(v => v !== null)")
            assert "healthy" in staff.inner_text("#fleet-events")
        if name == "latency":
            assert int(staff.inner_text("#latency-requests")) >= 3
        shot(staff, f"18-dash-{number}-{name}")

    # Live: the pages fetch their JSON again while open (every 2 s here instead of 10).
    views.REFRESH_S = 2
    try:
        for page_name, kind, label, row in (("latency", "latency-cold", "cold requests", {"adapter_tier": "disk"}),
                                            ("errors", "errors", "429 rate_limit_exceeded",
                                             {"status_code": 429, "error": "rate limit", "error_code": "rate_limit_exceeded",
                                              "time_to_first_token_ms": None})):
            staff.goto(f"{live.url}/dashboards/{page_name}/?range=15m")
            staff.wait_for_load_state("networkidle")
            staff.evaluate("window.notReloaded = true")
            stamp = staff.inner_text("#dash-updated")
            before = staff.evaluate(CHART_SUM, [kind, label])
            off_loop(_ledger_row, **row)
            staff.wait_for_function("s => document.getElementById('dash-updated').textContent !== s", arg=stamp,
                                    timeout=15_000)
            staff.wait_for_function(f"([k, l, n]) => ({CHART_SUM})([k, l]) > n", arg=[kind, label, before],
                                    timeout=15_000)
            assert staff.evaluate("window.notReloaded === true")
            # An "empty" note the new row contradicts is gone (the tables stay as of the page load).
            assert all(note.is_hidden() for note in staff.locator("p.empty[data-hide-when]").all())
            if page_name == "latency":
                assert int(staff.inner_text("#latency-cold")) >= 1
            shot(staff, f"18-dash-{8 if page_name == 'latency' else 9}-{page_name}-live")
    finally:
        views.REFRESH_S = 10
    assert staff.js_errors == [] and staff.dialogs == []


def _ledger_row(**fields) -> None:
    """A completed request of acme's adapter, as the gateway records it (unless fields say otherwise)."""
    import uuid

    from portal.tenants.models import Tenant
    from portal.usage.services import usage_record_create

    values = {"model": "acme/support-bot", "prompt_tokens": 5, "completion_tokens": 3, "time_to_first_token_ms": 2400.0,
              "inter_token_ms": 20.0, "queue_ms": 3.0, "latency_ms": 2500.0, "finish_reason": "length", **fields}
    usage_record_create(request_id=f"live_{uuid.uuid4().hex}", tenant=Tenant.objects.get(slug="acme"), **values)


def test_member_of_a_gets_404_on_b(live, page):
    make_user("ann", {"acme": "member"})
    make_user("bob", {"globex": "owner"})
    log_in(page, live, "ann")
    for path in ("/t/globex/", "/t/globex/keys/", "/t/globex/adapters/", "/t/globex/usage/", "/t/globex/billing/"):
        response = page.goto(f"{live.url}{path}")
        assert response.status == 404, path
        assert "Globex" not in page.content()
    shot(page, "23-other-tenant-404")


def test_viewer_cannot_create_keys(live, page):
    make_user("vic", {"acme": "viewer"})
    log_in(page, live, "vic")
    page.goto(f"{live.url}/t/acme/keys/")
    assert page.locator("text=Create key").count() == 0
    assert "not create or revoke" in page.inner_text(".note")
    shot(page, "24-viewer-keys")
    # Even a hand-made POST (with a valid CSRF token) is refused with a message.
    with page.expect_navigation():
        page.evaluate("""() => {
            const form = document.createElement('form');
            form.method = 'post'; form.action = location.pathname;
            const token = document.querySelector('input[name=csrfmiddlewaretoken]').cloneNode();
            const name = document.createElement('input'); name.name = 'name'; name.value = 'sneaky';
            form.append(token, name); document.body.append(form); form.submit();
        }""")
    assert "read-only" in page.inner_text("main")
    shot(page, "25-viewer-403")
    from portal.keys.models import ApiKey

    assert not off_loop(lambda: ApiKey.objects.filter(name="sneaky").exists())


WEATHER_TOOLS = ('[{"name": "get_weather", "parameters": {"type": "object", "properties": '
                 '{"city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": false}}]')


def test_playground_structured_boxes(live, page):
    """A typo in the JSON schema box is said next to the boxes and nothing is sent (the message
    stays in the input); a tools list with tool_choice "required" shows the answer's tool call."""
    make_user("ann", {"acme": "member"})
    log_in(page, live, "ann")
    page.goto(f"{live.url}/t/acme/playground/")
    _wait_for_playground(page, "s === 'connected'")
    page.click("#pg-structured summary")
    page.fill("#pg-schema", '{"type": "object", "properties": ')
    page.fill("#pg-input", "What is the weather in Paris?")
    page.click("#pg-send")
    _wait_for_playground(page, "s === 'not sent'")
    assert "The JSON schema is not valid JSON" in page.inner_text("#pg-box-error")
    assert page.locator("#pg-log .pg-msg").count() == 0
    assert page.input_value("#pg-input") == "What is the weather in Paris?"
    shot(page, "26-playground-schema-typo")

    page.fill("#pg-schema", "")
    page.fill("#pg-tools", WEATHER_TOOLS)
    page.select_option("#pg-tool-choice", "required")
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max-tokens", "48")
    page.click("#pg-send")
    _wait_for_playground(page, "s.startsWith('done')", timeout_s=180)
    assert page.locator("#pg-box-error").is_hidden()
    calls = page.locator(".pg-msg.tool .text").all_inner_texts()
    assert len(calls) == 1 and calls[0].startswith("get_weather(") and '"city"' in calls[0], calls
    assert page.locator(".pg-msg.error").count() == 0
    shot(page, "27-playground-tool-call")
    assert page.js_errors == [] and page.dialogs == []

    from portal.usage.models import UsageRecord

    rows = off_loop(lambda: list(UsageRecord.objects.filter(tenant__slug="acme").values_list(
        "constrained", "finish_reason")))
    assert rows == [("tools", "tool_calls")]


def _column(page, index: int, inner: str = ""):
    return page.locator(f"#pg-columns .pg-column[data-column='{index}'] {inner}".strip())


EVALUATION_SET = (b'{"name": "any answer", "prompt": "Say hi", "check": "regex", "expected": "\\\\S", "max_tokens": 4}\n'
                  b'{"name": "never", "prompt": "Say hi", "check": "exact", "expected": "zzz never this", "max_tokens": 4}\n')


def test_rollout_journey_v2_canary_side_by_side_rollback(live, worker, page, tmp_path, monkeypatch):
    """Issue 18's journey: upload v2 next to a serving v1 and an evaluation set, see v2's
    evaluation beside v1's, give v2 a canary weight, compare v1, v2 and the base side by side in
    the playground (Stop on one column, a thumbs up on an answer), then v2 breaks (its stored
    weights damaged, so the worker refuses it): its requests fail, the canary guard (what beat
    runs) moves its weight to 0 and the adapter page shows the banner."""
    import shutil
    from pathlib import Path

    from portal.adapters.models import Adapter
    from tests.inference.server.server_process import ROOT
    from tests.portal.gateway.conftest import ADMIN_TOKEN

    make_user("rita", {"acme": "owner"})
    log_in(page, live, "rita")
    page.goto(f"{live.url}/t/acme/adapters/")
    page.fill("#id_name", "support-bot")
    page.click("text=Create adapter")
    page.wait_for_url(f"{live.url}/t/acme/adapters/support-bot/")
    # The evaluation run a version's readiness starts is run here, as the Celery worker would,
    # not eagerly inside the upload request: the worker fetches the version from this portal.
    runs: list[int] = []
    monkeypatch.setattr("portal.evals.services.enqueue_on_commit", lambda task, run_id: runs.append(run_id))
    for number, seed in ((1, 0), (2, 7)):  # two versions that answer differently
        files = write_peft(tmp_path / f"v{number}", SMOLLM2_135M, seed=seed)
        page.set_input_files("#id_files", [str(files / "adapter_config.json"), str(files / "adapter_model.safetensors")])
        page.click("#upload-form button[type=submit]")
        _wait_for_status(page, number, "ready")
        if number == 1:  # v1 serves; the evaluation set applies from v2 on
            page.goto(f"{live.url}/t/acme/adapters/support-bot/evaluation/")
            cases = tmp_path / "cases.jsonl"
            cases.write_bytes(EVALUATION_SET)
            page.set_input_files("#id_file", str(cases))
            page.click("text=Upload set")
            assert "2 cases (2 with a check)" in page.inner_text("#evaluation-set")
            page.goto(f"{live.url}/t/acme/adapters/support-bot/")
    shot(page, "30-rollout-1-v2-ready")

    from portal.evals.services import evaluation_run_execute

    assert len(runs) == 1
    off_loop(evaluation_run_execute, run_id=runs[0])
    page.goto(f"{live.url}/t/acme/adapters/support-bot/versions/2/")
    assert "Completed" in page.inner_text("#run-status")
    rates = page.inner_text("#pass-rates")
    assert "v2 (this version)" in rates and "v1 (serving)" in rates and rates.count("1/2 (50%)") == 2, rates
    shot(page, "30-rollout-2-evaluation")
    page.goto(f"{live.url}/t/acme/adapters/support-bot/")

    # Canary: v1 keeps 90% of acme/support-bot's traffic, v2 gets 10%.
    page.fill("#id_weight_1", "90")
    page.fill("#id_weight_2", "10")
    page.click("text=Save weights")
    page.wait_for_selector("#comparison-table")
    assert [page.locator(f"#compare-v{n} td").nth(1).inner_text() for n in (1, 2)] == ["90", "10"]
    shot(page, "30-rollout-3-canary-weight")

    # Side by side: one prompt to v1, v2 and the base; Stop the base's column only.
    page.goto(f"{live.url}/t/acme/playground/")
    _wait_for_playground(page, "s === 'connected'")
    base = next(m for m in page.locator("#pg-model option").all_inner_texts() if "/" not in m)
    page.select_option("#pg-model", "acme/support-bot@v1")
    page.select_option("#pg-model-2", "acme/support-bot@v2")
    page.select_option("#pg-model-3", base)
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max-tokens", "12")
    page.fill("#pg-input", "Count from 1 to 100, one number per line.")
    page.click("#pg-send")
    assert page.locator("#pg-columns .pg-column").count() == 3
    assert [_column(page, i, ".pg-col-model").inner_text() for i in range(3)] == [
        "acme/support-bot@v1", "acme/support-bot@v2", base]
    page.wait_for_function("document.querySelector(\"#pg-columns .pg-column[data-column='2'] .pg-msg.assistant .text\")"
                           ".textContent.length > 0")
    _column(page, 2, ".pg-col-stop").click()
    _wait_for_playground(page, "s === 'done'", timeout_s=120)  # every column ended
    assert [_column(page, i, ".pg-col-status").inner_text() for i in range(3)] == [
        "done (max tokens reached)", "done (max tokens reached)", "stopped"]
    answers = [_column(page, i, ".pg-msg.assistant .text").inner_text() for i in range(3)]
    assert all(answers) and answers[0] != answers[1], answers
    for i in (0, 1):
        stats = _column(page, i, ".pg-col-stats").inner_text()
        assert "time to first token" in stats and "tokens/s" in stats, stats
    assert page.locator(".pg-msg.error").count() == 0
    _column(page, 1, ".pg-thumb.up").click()  # v2's answer is the better one
    _wait_for_playground(page, "s === 'feedback recorded'")
    assert _column(page, 1, ".pg-thumb.up").get_attribute("aria-pressed") == "true"
    shot(page, "30-rollout-4-side-by-side")

    from portal.rollouts.models import Feedback
    from portal.usage.models import UsageRecord

    rows = off_loop(lambda: sorted(UsageRecord.objects.filter(tenant__slug="acme").values_list(
        "model", "client_disconnected")))
    assert rows == [("acme/support-bot@v1", False), ("acme/support-bot@v2", False), (base, True)]
    assert off_loop(lambda: list(Feedback.objects.values_list("adapter_version__number", "rating", "source"))) == [
        (2, "up", "playground")]

    # v2 breaks: its stored weights are damaged, and the worker drops its copy (as a restarted
    # worker with an empty adapter cache would have none): it must fetch them again, and refuses
    # them. The guard judges after 5 canary requests.
    page.goto(f"{live.url}/t/acme/adapters/support-bot/")
    page.fill("#id_min_requests", "5")
    page.click("text=Save guard")
    page.wait_for_selector("#canary-guard")

    def break_v2():
        from django.core.files.storage import storages

        from portal.fleet.client import WorkerClient
        from portal.keys.services import api_key_create

        v2 = Adapter.objects.get(tenant__slug="acme", name="support-bot").versions.get(number=2)
        with storages["default"].open(f"{v2.storage_dir}/adapter_model.safetensors", "wb") as stored:
            stored.write(b"\x00 not a safetensors header" * 8)
        with WorkerClient(admin_token=ADMIN_TOKEN) as client:
            assert client.unload_adapter(worker.url, v2.worker_name).ok
        shutil.rmtree(Path(worker.env.get("INFERENCE_ADAPTER_CACHE_DIR") or ROOT / "var/adapter-cache") / v2.worker_name)
        return api_key_create(tenant=v2.adapter.tenant, name="canary traffic")[1]

    secret = off_loop(break_v2)
    with httpx.Client(base_url=f"{live.url}/v1", headers={"Authorization": f"Bearer {secret}"}, timeout=120) as api:
        for _ in range(5):
            reply = api.post("/chat/completions", json={
                "model": "acme/support-bot@v2", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2})
            assert reply.status_code >= 400, reply.text
    failures = off_loop(lambda: list(UsageRecord.objects.filter(adapter_version__number=2, status_code__gte=400)
                                     .values_list("status_code", "error_code")))
    assert failures == [(400, "adapter_load_failed")] * 5, failures  # the worker refuses the damaged file
    from portal.rollouts.services import canary_guard_check

    deployment_id = off_loop(lambda: Adapter.objects.get(tenant__slug="acme", name="support-bot").deployment.pk)
    assert off_loop(canary_guard_check, deployment_id=deployment_id) == [2]
    page.reload()
    banner = page.inner_text("#canary-rollback-banner")
    assert "rolled back v2" in banner and "5 errors" in banner, banner
    # v2's weight is 0 now; its requests (1 answer, 5 failures) and the thumbs up stay on the page
    assert [page.locator("#compare-v2 td").nth(i).inner_text() for i in (1, 2, 8)] == ["0", "6", "1 / 0"]
    shot(page, "30-rollout-5-rollback-banner")
    assert page.js_errors == [] and page.dialogs == []
