import pytest

from portal.tenants.models import Tenant
from portal.tenants.services import tenant_create


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    # PBKDF2's deliberate slowness (about 0.5 s a hash here) buys nothing in tests.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user(username="ada", password="correct horse battery")


@pytest.fixture
def tenant(db) -> Tenant:
    return tenant_create(slug="acme", name="Acme Corp")
