"""CSV exports: a monthly statement and the raw ledger, for staff and the tenant's members.

Anyone else gets the same 404 whether or not the tenant exists.
"""

from __future__ import annotations

import csv
from collections.abc import AsyncIterator, Iterable, Iterator
from datetime import date

from django.contrib.auth.decorators import login_required
from django.core.handlers.asgi import ASGIRequest
from django.db.models import Q
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    StreamingHttpResponse,
)
from django.views.decorators.http import require_GET

from portal.core.db import db_sync_to_async
from portal.core.exceptions import InvalidInput
from portal.tenants.models import Tenant
from portal.tenants.selectors import membership_get, tenant_get_by_slug
from portal.usage.billing import statement_csv_rows, statement_for
from portal.usage.models import UsageRecord
from portal.usage.selectors import usage_record_list

RECORDS_CSV_HEADER = [
    "request_id",
    "created_at",
    "finished_at",
    "model",
    "adapter_version",
    "api_key",
    "worker_url",
    "stream",
    "prompt_tokens",
    "completion_tokens",
    "cached_prompt_tokens",
    "constrained",
    "time_to_first_token_ms",
    "latency_ms",
    "finish_reason",
    "status_code",
    "error",
    "client_disconnected",
]
RECORDS_PAGE_SIZE = 1000


class _Echo:
    """A file-like object whose write returns what it was given (csv.writer → one line)."""

    def write(self, value: str) -> str:
        return value


def _cell(value):
    # Spreadsheets run cells that start with these as formulas; model ids and error texts
    # come from outside, so a leading quote keeps them text.
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def _csv_lines(rows: Iterable[list]) -> Iterator[str]:
    writer = csv.writer(_Echo())
    for row in rows:
        yield writer.writerow([_cell(value) for value in row])


def _tenant_for(request: HttpRequest, tenant_slug: str) -> Tenant:
    """The tenant if the user is staff or one of its members; 404 otherwise, exists or not."""
    tenant = tenant_get_by_slug(slug=tenant_slug)
    if tenant is None or not (request.user.is_staff or membership_get(tenant=tenant, user=request.user)):
        raise Http404("No such tenant.")
    return tenant


def _csv_filename(response: HttpResponse, filename: str) -> HttpResponse:
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["Cache-Control"] = "private, no-store"
    return response


@require_GET
@login_required
def statement_csv(request: HttpRequest, tenant_slug: str, year: str, month: str) -> HttpResponse:
    tenant = _tenant_for(request, tenant_slug)
    try:
        statement = statement_for(tenant=tenant, year=int(year), month=int(month))
    except InvalidInput:
        raise Http404("No such month.") from None
    response = HttpResponse("".join(_csv_lines(statement_csv_rows(statement))), content_type="text/csv")
    return _csv_filename(response, f"{tenant.slug}-statement-{statement.period}.csv")


@require_GET
@login_required
def records_csv(request: HttpRequest, tenant_slug: str) -> HttpResponse:
    """The raw ledger, oldest first; ?start=YYYY-MM-DD&end=YYYY-MM-DD (UTC days, included)."""
    tenant = _tenant_for(request, tenant_slug)
    try:
        bounds = {name: _date_param(request, name) for name in ("start", "end")}
        records = usage_record_list(tenant=tenant, **bounds)
    except InvalidInput as error:
        return HttpResponseBadRequest(f"{error}\n", content_type="text/plain")
    # Stream from keyset-paged queries so no export holds the whole ledger in memory; under
    # ASGI the iterator must be async or Django buffers it all before sending a byte.
    staff = request.user.is_staff
    if isinstance(request, ASGIRequest):
        content = _records_csv_async(records, staff=staff)
    else:
        content = _csv_lines(_records_rows(_records_pages(records), staff=staff))
    response = StreamingHttpResponse(content, content_type="text/csv")
    return _csv_filename(response, f"{tenant.slug}-usage-records.csv")


def _date_param(request: HttpRequest, name: str) -> date | None:
    value = request.GET.get(name)
    if not value:
        return None
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise InvalidInput(name, f"not a date (YYYY-MM-DD): {value!r}") from None


def _records_page(records, after_key) -> list[UsageRecord]:
    page = records.select_related("api_key", "adapter_version__adapter__tenant")
    if after_key is not None:
        created_at, pk = after_key
        page = page.filter(Q(created_at__gt=created_at) | Q(created_at=created_at, id__gt=pk))
    return list(page.order_by("created_at", "id")[:RECORDS_PAGE_SIZE])


def _records_pages(records) -> Iterator[list[UsageRecord]]:
    after_key = None
    while True:
        page = _records_page(records, after_key)
        if not page:
            return
        yield page
        after_key = (page[-1].created_at, page[-1].pk)


def _records_rows(pages: Iterable[list[UsageRecord]], *, staff: bool) -> Iterator[list]:
    yield RECORDS_CSV_HEADER
    for page in pages:
        for record in page:
            yield _record_row(record, staff=staff)


async def _records_csv_async(records, *, staff: bool) -> AsyncIterator[str]:
    for line in _csv_lines([RECORDS_CSV_HEADER]):
        yield line
    after_key = None
    while True:
        page = await db_sync_to_async(_records_page)(records, after_key)
        if not page:
            return
        for line in _csv_lines(_record_row(record, staff=staff) for record in page):
            yield line
        after_key = (page[-1].created_at, page[-1].pk)


def _record_row(record: UsageRecord, *, staff: bool) -> list:
    """One CSV row. worker_url is an internal address: only staff see it; a tenant's members get
    the column empty (the same header for everyone, so their scripts read either file)."""
    return [
        record.request_id,
        record.created_at.isoformat(),
        record.finished_at.isoformat(),
        record.model,
        record.adapter_version.public_id if record.adapter_version else "",
        record.api_key.display_prefix if record.api_key else "",
        record.worker_url if staff else "",
        str(record.stream).lower(),
        record.prompt_tokens,
        record.completion_tokens,
        record.cached_prompt_tokens,
        record.constrained,
        "" if record.time_to_first_token_ms is None else record.time_to_first_token_ms,
        record.latency_ms,
        record.finish_reason,
        record.status_code,
        record.error,
        str(record.client_disconnected).lower(),
    ]
