import re
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from portal.adapters.models import AdapterVersion
from portal.adapters.staging import version_stage_enqueue as real_stage_enqueue
from portal.config import WebConfig
from portal.demo.services import DEMO_ADAPTERS
from portal.keys.models import ApiKey
from portal.keys.selectors import api_key_authenticate
from portal.tenants.models import Membership, Tenant
from tests.portal.adapters.peft_files import TINY, write_peft

pytestmark = pytest.mark.django_db
KEY_LINE = re.compile(r"^API key \(shown once\): (sk-\S+)$", re.MULTILINE)


@pytest.fixture(autouse=True)
def demo_adapters(settings, tmp_path, monkeypatch):
    """Storage in a temporary directory, small demo adapters for small base shapes, staging
    recorded instead of sent to workers (these tests have none)."""
    root = tmp_path / "storage"
    root.mkdir()
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(root)}}}
    settings.MEDIA_ROOT = str(root)
    shipped = tmp_path / "demo-adapters"
    for seed, name in enumerate(DEMO_ADAPTERS):
        write_peft(shipped / name, TINY, seed=seed)
    monkeypatch.setattr("portal.demo.services.DEMO_ADAPTERS_DIR", shipped)
    monkeypatch.setattr("portal.adapters.selectors.base_shapes_current", lambda: TINY)
    staged = []
    monkeypatch.setattr("portal.adapters.staging.version_stage_enqueue", lambda *, version: staged.append(version))
    from portal.celery import app

    eager, app.conf.task_always_eager = app.conf.task_always_eager, True
    yield staged
    app.conf.task_always_eager = eager


def bootstrap(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("bootstrap_demo", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_first_run_creates_admin_tenant_and_a_working_key(django_user_model, monkeypatch):
    monkeypatch.delenv("DEMO_ADMIN_PASSWORD", raising=False)

    out, err = bootstrap()

    admin = django_user_model.objects.get(username="admin")
    assert admin.is_staff and admin.is_superuser and admin.check_password("admin")
    assert "default password 'admin'" in err
    tenant = Tenant.objects.get(slug="demo")
    assert Membership.objects.get(tenant=tenant, user=admin).role == Membership.Role.OWNER
    plaintext = KEY_LINE.search(out).group(1)
    assert api_key_authenticate(plaintext).tenant == tenant


def test_rerunning_keeps_everything_and_prints_no_secret(django_user_model, monkeypatch):
    monkeypatch.setenv("DEMO_ADMIN_PASSWORD", "a-better-password")
    first_out, first_err = bootstrap()
    plaintext = KEY_LINE.search(first_out).group(1)
    assert "default password" not in first_err

    second_out, _ = bootstrap()

    assert KEY_LINE.search(second_out) is None
    assert f"already exists: sk-{plaintext[3:11]}…" in second_out
    assert ApiKey.objects.count() == 1
    assert Tenant.objects.count() == 1 and Membership.objects.count() == 1
    assert django_user_model.objects.get(username="admin").check_password("a-better-password")
    assert api_key_authenticate(plaintext) is not None


def test_new_key_option_forces_another_key(monkeypatch):
    first_out, _ = bootstrap()

    second_out, _ = bootstrap("--new-key")

    keys = [KEY_LINE.search(out).group(1) for out in (first_out, second_out)]
    assert keys[0] != keys[1]
    assert ApiKey.objects.filter(tenant__slug="demo").count() == 2
    assert all(api_key_authenticate(key) is not None for key in keys)


def test_a_revoked_demo_key_is_replaced(monkeypatch):
    bootstrap()
    ApiKey.objects.update(revoked_at="2020-01-01T00:00:00Z")

    out, _ = bootstrap()

    assert KEY_LINE.search(out) is not None
    assert ApiKey.objects.filter(revoked_at__isnull=True).count() == 1


def test_production_refuses_the_default_password(settings, monkeypatch):
    monkeypatch.delenv("DEMO_ADMIN_PASSWORD", raising=False)
    settings.CONFIG = WebConfig.from_env({
        "PORTAL_ENV": "production", "SECRET_KEY": "Kq8-vW2p_Lr5zN0xYc3mT7hJ4sB9dF6gA1eR-uI8oP2wQ5tZ7nM",
        "ALLOWED_HOSTS": "portal.example.com", "INFERENCE_ADMIN_TOKEN": "fleet-token-" + "7Yh2Kx9q" * 3,
        "PORTAL_INTERNAL_URL": "http://web:8000",
    })

    with pytest.raises(CommandError, match="DEMO_ADMIN_PASSWORD"):
        bootstrap()
    assert not Tenant.objects.exists()


def test_demo_adapters_go_through_upload_validation_and_staging_once(
    demo_adapters, django_capture_on_commit_callbacks, monkeypatch
):
    monkeypatch.delenv("DEMO_ADMIN_PASSWORD", raising=False)
    with django_capture_on_commit_callbacks(execute=True):
        out, _ = bootstrap()
    versions = AdapterVersion.objects.filter(adapter__tenant__slug="demo").select_related("adapter")
    assert sorted(v.adapter.name for v in versions) == sorted(DEMO_ADAPTERS)
    assert {v.status for v in versions} == {"ready"} and all(v.file_sha256 for v in versions)
    assert sorted(v.adapter.name for v in demo_adapters) == sorted(DEMO_ADAPTERS)  # staged after validation
    assert "Demo adapter demo/pirate@v1: uploaded, validating after commit." in out
    bootstrap()  # a rerun uploads nothing more
    assert AdapterVersion.objects.filter(adapter__tenant__slug="demo").count() == len(DEMO_ADAPTERS)


@pytest.mark.django_db(transaction=True)  # commits for real, as under make run
def test_without_a_worker_yet_it_says_adapters_load_on_first_use(monkeypatch, settings):
    # make run starts the inference worker after bootstrap_demo: staging finds nobody listening.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        settings.INFERENCE_URLS = [f"http://127.0.0.1:{s.getsockname()[1]}"]
    monkeypatch.setattr("portal.adapters.staging.version_stage_enqueue", real_stage_enqueue)
    monkeypatch.delenv("DEMO_ADMIN_PASSWORD", raising=False)
    out, _ = bootstrap()
    assert "Demo adapter demo/pirate@v1: ready." in out
    assert "a worker loads each one on its first request" in out
    versions = AdapterVersion.objects.filter(adapter__tenant__slug="demo")
    assert {v.status for v in versions} == {"ready"}  # a failed staging does not touch the version
