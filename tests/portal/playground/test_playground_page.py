"""The playground page: login required, other tenants 404, the model picker lists what
/v1/models lists for the tenant, and model output can never become markup (the template
escapes, the script only ever sets text)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from portal.adapters.models import Adapter, AdapterVersion
from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create
from tests.portal.playground.conftest import BASE

JS = Path(__file__).resolve().parents[3] / "static" / "playground" / "playground.js"


@pytest.fixture
def acme(live_worker, django_user_model):
    tenant = tenant_create(slug="acme", name="<b>Acme</b> & Co")
    user = django_user_model.objects.create_user(username="ada", password="x")
    membership_create(tenant=tenant, user=user, role=Membership.Role.MEMBER)
    return tenant, user


def test_login_required_and_other_tenants_404(acme, client, django_user_model):
    tenant, user = acme
    response = client.get("/t/acme/playground/")
    assert response.status_code == 302 and "login" in response["location"]
    tenant_create(slug="globex", name="Globex")
    client.force_login(user)
    assert client.get("/t/globex/playground/").status_code == 404
    assert client.get("/t/nope/playground/").status_code == 404
    assert client.get("/t/acme/playground/").status_code == 200


def test_model_picker_lists_the_tenants_servable_models(acme, client):
    tenant, user = acme
    bot = Adapter.objects.create(tenant=tenant, name="bot")
    AdapterVersion.objects.create(adapter=bot, number=1, source_path="/nowhere")
    draft = Adapter.objects.create(tenant=tenant, name="draft")
    AdapterVersion.objects.create(adapter=draft, number=1, status=AdapterVersion.Status.VALIDATING)
    secret = Adapter.objects.create(tenant=tenant_create(slug="globex", name="Globex"), name="secret")
    AdapterVersion.objects.create(adapter=secret, number=1, source_path="/nowhere")
    client.force_login(user)
    html = client.get("/t/acme/playground/").content.decode()
    picker = re.search(r'<select id="pg-model".*?</select>', html, re.S).group(0)
    options = re.findall(r'<option value="([^"]*)">', picker)
    assert options == [BASE, "acme/bot", "acme/bot@v1"]
    # side by side: two "compare with" pickers of the same models, empty ("—") by default
    for n in (2, 3):
        compare = re.search(rf'<select id="pg-model-{n}".*?</select>', html, re.S).group(0)
        assert re.findall(r'<option value="([^"]*)">', compare) == ["", BASE, "acme/bot", "acme/bot@v1"]
    assert 'id="pg-model-4"' not in html
    assert re.search(r'<div id="pg-columns" class="pg-columns single">\s*<div class="pg-column" data-column="0">', html)
    # the optional structured-output boxes, and the tool choices the consumer takes
    assert 'id="pg-schema"' in html and 'id="pg-tools"' in html
    tool_choice = re.search(r'<select id="pg-tool-choice".*?</select>', html, re.S).group(0)
    assert re.findall(r'<option value="([^"]*)">', tool_choice) == ["required", "none"]
    assert 'data-ws-path="/ws/t/acme/playground/"' in html
    assert "playground/playground.js" in html


def test_text_is_never_interpreted_as_html(acme, client):
    tenant, user = acme
    client.force_login(user)
    html = client.get("/t/acme/playground/").content.decode()
    assert "<b>Acme</b>" not in html and "&lt;b&gt;Acme&lt;/b&gt; &amp; Co" in html
    source = JS.read_text()
    assert "textContent" in source
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in source, sink
    # the streamed delta is appended to a string and shown with textContent
    assert "current.node.textContent = current.text" in source


def test_viewers_see_a_disabled_playground(acme, client, django_user_model):
    tenant, _ = acme
    viewer = django_user_model.objects.create_user(username="vic", password="x")
    membership_create(tenant=tenant, user=viewer, role=Membership.Role.VIEWER)
    client.force_login(viewer)
    html = client.get("/t/acme/playground/").content.decode()
    assert re.search(r'<button id="pg-send"[^>]*\sdisabled>', html)
    assert "Viewers can look but not run generations." in html
