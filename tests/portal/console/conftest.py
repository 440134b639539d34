"""Fixtures for the tenant portal's pages: two tenants, members with each role, a storage root,
uploads validated eagerly against the tiny base (tests/portal/adapters/peft_files.TINY)."""

from __future__ import annotations

import pytest
from django.test import Client

from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create
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
    monkeypatch.setattr("portal.adapters.selectors.base_shapes_current", lambda: TINY)
    return TINY


@pytest.fixture(autouse=True)
def no_staging(monkeypatch):
    """No inference workers here: staging is recorded, not sent."""
    calls = {"stage": [], "unstage": []}
    monkeypatch.setattr("portal.adapters.staging.version_stage_enqueue",
                        lambda *, version, **kwargs: calls["stage"].append(version.uid))
    monkeypatch.setattr("portal.adapters.staging.version_unstage",
                        lambda *, version: calls["unstage"].append(version.uid))
    monkeypatch.setattr("portal.adapters.staging.stage_targets", lambda: [])
    return calls


@pytest.fixture(autouse=True)
def eager_celery():
    from portal.celery import app

    previous = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = previous


@pytest.fixture
def other_tenant(db):
    return tenant_create(slug="globex", name="Globex")


def _member(django_user_model, tenant, username, role):
    user = django_user_model.objects.create_user(username=username, password="pw-" + username)
    membership_create(tenant=tenant, user=user, role=role)
    return user


@pytest.fixture
def member(db, tenant, django_user_model):
    return _member(django_user_model, tenant, "mia", Membership.Role.MEMBER)


@pytest.fixture
def viewer(db, tenant, django_user_model):
    return _member(django_user_model, tenant, "vic", Membership.Role.VIEWER)


@pytest.fixture
def client_for():
    def make(user) -> Client:
        client = Client(enforce_csrf_checks=False)
        client.force_login(user)
        return client

    return make


@pytest.fixture
def mia(member, client_for) -> Client:
    return client_for(member)


@pytest.fixture
def on_commit(django_capture_on_commit_callbacks):
    """Run what services enqueue on commit (validation) inside the test's transaction."""
    return django_capture_on_commit_callbacks
