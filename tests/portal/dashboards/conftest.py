import pytest


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix):
    # Our own test database: other suites may be running at the same time on this machine
    # (the same name as tests/portal/playground, so both directories can run in one session).
    from django.conf import settings

    from tests.xdist_isolation import database_suffix

    database = settings.DATABASES["default"]
    database.setdefault("TEST", {})["NAME"] = f"test_{database['NAME']}_playground{database_suffix()}"
