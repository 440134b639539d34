from datetime import UTC, datetime
from itertools import count

import pytest

from portal.usage.services import usage_record_create

_ids = count()


@pytest.fixture
def record(tenant):
    """record(created_at=..., **fields) writes one ledger row for `tenant` with a fresh request id."""

    def make(*, created_at: datetime = datetime(2025, 3, 10, 12, tzinfo=UTC), **fields):
        fields.setdefault("tenant", tenant)
        fields.setdefault("model", "acme/bot")
        fields.setdefault("request_id", f"req-{next(_ids)}")
        return usage_record_create(created_at=created_at, finished_at=created_at, **fields)

    return make
