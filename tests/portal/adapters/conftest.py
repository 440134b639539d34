"""Fixtures for the adapter lifecycle tests: a temporary storage root, the tiny base model,
a recording stand-in for the staging helper's module, eager Celery, API clients."""

from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.test import APIClient

from portal.tenants.models import Membership
from portal.tenants.services import membership_create
from tests.portal.adapters.peft_files import TINY


@pytest.fixture(autouse=True)
def storage_root(settings, tmp_path):
    root = tmp_path / "storage"
    root.mkdir()
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(root)}},
    }
    settings.MEDIA_ROOT = str(root)
    return root


@pytest.fixture(autouse=True)
def tiny_base(monkeypatch):
    """Uploads are validated against TINY unless a test asks for the real default shapes."""
    monkeypatch.setattr("portal.adapters.selectors.base_shapes_current", lambda: TINY)
    return TINY


@pytest.fixture(autouse=True)
def staging_calls(request, monkeypatch, settings):
    """Staging to workers recorded instead of sent (these tests have no workers). The real
    module stays importable (the Celery tasks and deployments import it); only its two entry points are replaced.
    Modules marked `real_staging` stage over real HTTP to the stand-in workers they make instead
    (None here): no fleet token and no worker from settings unless the module sets its own."""
    if request.node.get_closest_marker("real_staging"):
        settings.INFERENCE_ADMIN_TOKEN = None
        settings.INFERENCE_URLS = []
        return None
    from portal.adapters import staging

    calls = {"stage": [], "unstage": []}
    monkeypatch.setattr(staging, "version_stage_enqueue", lambda *, version, **_: calls["stage"].append(version.uid))
    monkeypatch.setattr(staging, "version_unstage", lambda *, version: calls["unstage"].append(version.uid))
    return calls


@pytest.fixture(autouse=True)
def eager_celery():
    from portal.celery import app

    previous = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = previous


@pytest.fixture
def member(db, tenant, django_user_model):
    user = django_user_model.objects.create_user(username="mia", password="x")
    membership_create(tenant=tenant, user=user, role=Membership.Role.MEMBER)
    return user


@pytest.fixture
def api(member) -> APIClient:
    client = APIClient()
    client.force_login(member)
    return client


def upload(name: str, data: bytes) -> SimpleUploadedFile:
    return SimpleUploadedFile(name, data, content_type="application/octet-stream")
