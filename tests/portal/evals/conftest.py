"""Fixtures for the evaluation tests: a temporary storage root, eager Celery, a signed-in member."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from portal.tenants.models import Membership
from portal.tenants.services import membership_create


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
