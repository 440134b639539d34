"""db_sync_to_async: a database step from async code hands its connection back when done
(to the web process's pool), except inside a caller's transaction."""

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction

from portal.core.db import db_sync_to_async


def count_users() -> int:
    return get_user_model().objects.count()


def connection_is_open() -> bool:
    return connection.connection is not None


@pytest.mark.django_db(transaction=True)
async def test_a_step_closes_its_connection_when_done():
    assert await db_sync_to_async(count_users)() == 0
    # The next step on the same thread finds no connection held over from the last one.
    assert await db_sync_to_async(connection_is_open)() is False


@pytest.mark.django_db(transaction=True)
async def test_the_connection_is_handed_back_even_when_the_step_fails():
    def failing():
        count_users()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await db_sync_to_async(failing)()
    assert await db_sync_to_async(connection_is_open)() is False


@pytest.mark.django_db
def test_inside_a_transaction_the_connection_is_left_alone():
    step = db_sync_to_async(count_users).func  # the wrapped step, run here on this thread
    with transaction.atomic():
        assert step() == 0
        assert connection.connection is not None and connection.in_atomic_block
        assert count_users() == 0  # still usable
