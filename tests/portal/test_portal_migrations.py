"""Migrations on the real PostgreSQL of the test run: they apply, reverse, and match the models."""

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor


def test_the_suite_runs_on_postgresql(db):
    assert connection.vendor == "postgresql", (
        "run the suite with DATABASE_URL=postgres://... (the test command sets it)"
    )


def test_every_migration_is_applied(db):
    executor = MigrationExecutor(connection)

    assert executor.migration_plan(executor.loader.graph.leaf_nodes()) == []
    applied = {(app, name) for app, name in executor.loader.applied_migrations}
    assert ("tenants", "0001_initial") in applied and ("keys", "0001_initial") in applied


def test_models_and_migrations_agree(db):
    out = StringIO()

    call_command("makemigrations", "--check", "--dry-run", stdout=out)  # exits 1 on drift

    assert "No changes detected" in out.getvalue()


@pytest.mark.django_db(transaction=True)
def test_portal_migrations_reverse_and_reapply():
    tables_before = set(connection.introspection.table_names())

    call_command("migrate", "tenants", "zero", verbosity=0)  # takes keys down with it
    tables_down = set(connection.introspection.table_names())
    call_command("migrate", verbosity=0)

    assert {"tenants_tenant", "tenants_membership", "keys_apikey"} <= tables_before
    assert not {"tenants_tenant", "tenants_membership", "keys_apikey"} & tables_down
    assert set(connection.introspection.table_names()) == tables_before
