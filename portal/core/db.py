"""Database steps called from async code (the gateway, the playground, streamed exports).

Under ASGI a request's sync steps run on a thread of its own, and Django keeps a connection per
thread until the request ends. With the web process's pool (DATABASE_POOL_SIZE) that meant a
request held a pooled connection from its first database step to its last byte, while its
ledger write (on another thread) needed a second one: a burst of requests could take every
connection and then wait on each other until the pool's timeout. So every step hands its
connection back the moment it returns: one request holds at most one connection, never across
an await, and a long stream holds none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from asgiref.sync import sync_to_async
from django.db import connection


def db_sync_to_async(fn: Callable, *, thread_sensitive: bool = True):
    """sync_to_async for a step that uses the database and returns its connection when done (to
    the pool in the web process; closed without one). Inside a transaction (a caller's atomic
    block, e.g. a sync view calling into async code) the connection is the caller's: left alone."""

    @functools.wraps(fn)
    def step(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            if not connection.in_atomic_block:
                connection.close()

    return sync_to_async(step, thread_sensitive=thread_sensitive)
