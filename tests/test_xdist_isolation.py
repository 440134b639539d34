"""The suite's processes (make test: pytest-xdist) each get their own Redis database."""

from tests.xdist_isolation import redis_url_for


def test_each_process_gets_the_next_lower_redis_database_wrapping_at_16():
    assert redis_url_for("redis://127.0.0.1:6379/15", 0) == "redis://127.0.0.1:6379/15"
    assert redis_url_for("redis://127.0.0.1:6379/15", 1) == "redis://127.0.0.1:6379/14"
    assert redis_url_for("redis://127.0.0.1:6379/0", 1) == "redis://127.0.0.1:6379/15"


def test_credentials_and_a_url_without_a_database_survive():
    assert redis_url_for("redis://:secret@cache.lan:6380", 1) == "redis://:secret@cache.lan:6380/15"
    assert redis_url_for("rediss://user:pw@h:6379/3", 2) == "rediss://user:pw@h:6379/1"
