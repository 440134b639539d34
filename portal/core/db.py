"""Database steps called from async code (the gateway, the playground)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from asgiref.sync import sync_to_async
from django.db import connection


def db_sync_to_async(fn: Callable, *, thread_sensitive: bool = True):
    """sync_to_async for a step that uses the database and hands its connection back when done
    (to the pool in the web process), so a long stream holds no connection between steps.
    Inside a transaction (a caller's atomic block) the connection is left alone."""

    @functools.wraps(fn)
    def step(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            if not connection.in_atomic_block:
                connection.close_if_unusable_or_obsolete()

    return sync_to_async(step, thread_sensitive=thread_sensitive)
