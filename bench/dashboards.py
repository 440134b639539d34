"""Operator dashboards on a month of data: every dashboard's JSON timed through its view.

    .venv/bin/python bench/dashboards.py [--rows 2000000] [--tenants 50] [--days 30] [--workers 8]
        [--runs 5] [--database-url postgres://postgres@127.0.0.1:5432/loraplex_bench] [--keep] [--quick]

1. Creates its own PostgreSQL database (dropped at the end unless --keep), migrates it, and
   writes `rows` ledger rows spread over the last `days` days for `tenants` tenants (skewed:
   a few busy tenants), 2 adapters x 2 versions per tenant plus the base model, 8 workers,
   about 20% cold adapter loads, 3.5% errors (429 / 502 / 400) and 10% upstream retries, with
   one INSERT ... SELECT over generate_series (no ORM objects).
2. Writes a month of fleet history for `workers` workers the way a month of polls leaves it
   before the fold runs: raw polls (every 10 s) for the last 24 h, minute rows from 14 days to
   24 h ago, hour rows from `days` to 14 days ago (SQL again), then runs the fold
   (portal.fleet.history.history_fold) as the beat would: raw -> minute -> hour.
3. Runs the usage roll-ups as the first beat would (minute rows for the 3 days kept, hour and
   day rows for the month), then one steady-state run after 200 new rows (the every-minute cost).
4. Times each dashboard's JSON endpoint (portal/dashboards/urls.py) THROUGH ITS VIEW: a
   django.test.Client signed in as a staff user GETs /dashboards/api/<name>.json for every range
   (15m, 1h, 6h, 24h, 7d, 30d), latency unfiltered / one tenant / tenant + adapter, billing for
   this month and last month; median and max of `runs` (middleware, session, auth and the JSON
   encoding included, as a browser would wait for them).

Goal (issue 20): every dashboard JSON <= 300 ms on PostgreSQL. Printed, not asserted; the CPU
is named.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL_MS = 300.0
RANGES = ("15m", "1h", "6h", "24h", "7d", "30d")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--database-url", default="postgres://postgres@127.0.0.1:5432/loraplex_bench")
    parser.add_argument("--keep", action="store_true", help="keep the database (and reuse its rows next time)")
    parser.add_argument("--quick", action="store_true", help="100,000 rows, 3 runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.runs = 100_000, 3
    if args.rows < 1 or args.tenants < 1 or args.days < 1 or args.workers < 1 or args.runs < 1:
        parser.error("--rows, --tenants, --days, --workers and --runs must be at least 1")
    return args


def create_database(url: str) -> bool:
    """CREATE DATABASE for url's name unless it exists; True when created."""
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return False
        conn.execute(f'CREATE DATABASE "{name}"')
    return True


def drop_database(url: str) -> None:
    import psycopg
    from django.db import connections

    connections.close_all()
    parts = urlsplit(url)
    with psycopg.connect(urlunsplit(parts._replace(path="/postgres")), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{parts.path.lstrip("/")}"')


def generate(*, rows: int, tenants: int, days: int) -> float:
    """Tenants, adapters, versions and `rows` ledger rows; seconds spent on the ledger rows."""
    from django.db import connection

    from portal.adapters.models import Adapter, AdapterVersion
    from portal.tenants.models import Tenant
    from portal.usage.models import UsageRecord

    plans = ["free", "team", "enterprise"]
    made = Tenant.objects.bulk_create([Tenant(slug=f"tenant-{i:02d}", name=f"Tenant {i}", plan=plans[i % 3])
                                       for i in range(tenants)])
    targets = []  # (tenant id, version id or None, model id)
    for tenant in made:
        targets.append((tenant.pk, None, "SmolLM2-135M-Instruct"))
        for name in ("support", "sql"):
            adapter = Adapter.objects.create(tenant=tenant, name=name)
            for number in (1, 2):
                version = AdapterVersion.objects.create(adapter=adapter, number=number)
                targets.append((tenant.pk, version.pk, f"{tenant.slug}/{name}"))
    table = UsageRecord._meta.db_table
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("CREATE TEMP TABLE bench_targets (i int PRIMARY KEY, tenant_id int, version_id int, model text)")
        cursor.executemany("INSERT INTO bench_targets VALUES (%s, %s, %s, %s)",
                           [(i, *target) for i, target in enumerate(targets)])
        # Skewed traffic: target index ~ n * u^2 puts most rows on the first tenants' models.
        cursor.execute(f"""
            INSERT INTO {table} (request_id, completion_id, tenant_id, api_key_id, model, adapter_version_id, worker_url, stream,
                prompt_tokens, completion_tokens, cached_prompt_tokens, constrained, adapter_tier,
                time_to_first_token_ms, inter_token_ms, queue_ms, latency_ms, finish_reason, error, error_code,
                status_code, client_disconnected, upstream_attempts, created_at, finished_at, recorded_at)
            SELECT 'bench-' || s.g, '', t.tenant_id, NULL, t.model, t.version_id,
                'http://worker-' || (s.g %% 8) || ':8001', s.r3 < 0.7,
                (20 + s.r4 * 800)::int, (s.r5 * 300)::int, 0, '', s.tier,
                CASE WHEN s.status = 200 THEN 40 + 600 * s.r4 ^ 3 + CASE WHEN s.tier IN ('host', 'disk')
                     THEN 1500 + 1500 * s.r5 ELSE 0 END END,
                CASE WHEN s.status = 200 THEN 8 + 30 * s.r3 END,
                5 + 200 * s.r2 ^ 4,
                200 + 8000 * s.r5 * s.r3,
                CASE WHEN s.status = 200 THEN 'stop' ELSE '' END,
                CASE WHEN s.status = 200 THEN '' ELSE 'failed' END,
                CASE s.status WHEN 429 THEN (CASE WHEN s.r2 < 0.5 THEN 'rate_limit_exceeded' ELSE 'insufficient_quota' END)
                     WHEN 502 THEN 'upstream_error' WHEN 400 THEN 'invalid_request_error' ELSE '' END,
                s.status, s.r2 < 0.01, CASE WHEN s.r3 < 0.1 THEN 2 ELSE 1 END,
                s.at, s.at + interval '2 seconds', s.at + interval '3 seconds'
            FROM (SELECT g, r1, r2, r3, r4, r5, at,
                         CASE WHEN r1 < 0.02 THEN 429 WHEN r1 < 0.03 THEN 502 WHEN r1 < 0.035 THEN 400 ELSE 200 END AS status,
                         CASE WHEN version_id IS NULL THEN '' WHEN r2 < 0.8 THEN 'device' WHEN r2 < 0.95 THEN 'host'
                              ELSE 'disk' END AS tier, i
                  FROM (SELECT g, random() AS r1, random() AS r2, random() AS r3, random() AS r4, random() AS r5,
                               now() - random() * make_interval(days => %s) AS at,
                               floor(%s * random() ^ 2)::int AS i
                        FROM generate_series(1, %s) AS g) AS u
                  JOIN bench_targets USING (i)) AS s
            JOIN bench_targets t ON t.i = s.i
        """, [days, len(targets), rows])
        cursor.execute(f"ANALYZE {table}")
    return time.perf_counter() - started


def generate_fleet(*, workers: int, days: int, now) -> float:
    """`workers` InferenceWorker rows as the last poll left them, and their history as a month
    of polls leaves it before the fold: raw polls every 10 s over the last 24 h (0.5% of them
    unhealthy), minute rows from 14 days to 24 h ago, hour rows from `days` to 14 days ago, and
    a health change a day per worker. Seconds spent."""
    from django.db import connection

    from portal.fleet.history import MINUTE_KEEP, RAW_KEEP
    from portal.fleet.models import COUNTERS, GAUGES, InferenceWorker, WorkerEvent, WorkerSample

    made = InferenceWorker.objects.bulk_create([InferenceWorker(
        url=f"http://worker-{i}:8001", name=f"worker-{i}", healthy=True, base_model="SmolLM2-135M-Instruct",
        last_polled_at=now, last_seen_at=now, num_running=3 + i % 5, num_waiting=i % 3, kv_cache_usage=0.1 * (i % 9),
        resident_adapters={f"tenant-{t:02d}/support@v{v}": ("device", "host", "disk")[(t + v + i) % 3]
                           for t in range(25) for v in (1, 2)},
        memory={"base_weights": 269_000_000, "kv_cache": 67_108_864, "adapter_slots": 4_194_304 * 8,
                "host_adapters": 2_097_152 * 16},
        cache_stats={"hits": {"device": 90_000 + i, "host": 10_000}, "misses": 4_000, "loads": 4_000,
                     "load_failures": 3, "evictions": {"device": 3_500, "host": 900}, "prefix_queries": 400_000,
                     "prefix_hits": 300_000}) for i in range(workers)])
    ids = [worker.pk for worker in made]
    table = WorkerSample._meta.db_table
    # Gauges wander with the time of day; counters grow with time (per worker), as cache_stats do.
    gauges = {"num_running": "2 + 6 * w.load", "num_waiting": "floor(4 * w.load * w.load)",
              "kv_cache_usage": "0.2 + 0.6 * w.load", "adapters_device": "8", "adapters_host": "16",
              "adapters_loading": "floor(2 * w.load)", "adapters_disk": "26", "adapters_failed": "0",
              "memory_base_weights": "269000000", "memory_kv_cache": "67108864",
              "memory_adapter_slots": "33554432", "memory_host_adapters": "33554432"}
    assert set(gauges) == set(GAUGES), "bench/dashboards.py: a fleet gauge is missing"
    counters = {"loads": 0.02, "load_failures": 0.0001, "misses": 0.02, "hits_device": 2.0, "hits_host": 0.2,
                "evictions_device": 0.015, "evictions_host": 0.004}
    assert set(counters) == set(COUNTERS), "bench/dashboards.py: a fleet counter is missing"
    columns = ["worker_id", "at", "resolution", "polls", "samples", "healthy", "state", *gauges,
               *(f"{g}_max" for g in gauges), *counters]

    def insert(resolution: str, step_s: int, since, until, polls: int, unhealthy: float) -> None:
        ok = f"w.r >= {unhealthy}"
        values = [
            "w.worker_id", "w.at", f"'{resolution}'", str(polls), f"CASE WHEN {ok} THEN {polls} ELSE 0 END", ok,
            f"CASE WHEN {ok} THEN 'healthy' ELSE 'unhealthy' END",
            *(f"CASE WHEN {ok} THEN {expr} END" for expr in gauges.values()),
            *(f"CASE WHEN {ok} THEN ({expr}) * 1.3 END" for expr in gauges.values()),
            *(f"CASE WHEN {ok} THEN floor(extract(epoch FROM w.at - %(since_month)s) * {rate} * (1 + w.worker_id %% 3))"
              f"::bigint END" for rate in counters.values()),
        ]
        with connection.cursor() as cursor:
            cursor.execute(f"""
                INSERT INTO {table} ({', '.join(columns)})
                SELECT {', '.join(values)}
                FROM (SELECT worker_id, at, random() AS r,
                             0.5 + 0.45 * sin(extract(epoch FROM at) / 86400 * 2 * pi() + worker_id) AS load
                      FROM unnest(%(ids)s::int[]) AS worker_id,
                           generate_series(%(since)s::timestamptz, %(until)s::timestamptz - interval '1 microsecond',
                                           make_interval(secs => %(step)s)) AS at) AS w""",
                {"ids": ids, "since": since, "until": until, "step": step_s, "since_month": now - timedelta(days=days)})

    def floor(moment, width: timedelta):
        return moment - (moment - EPOCH) % width

    started = time.perf_counter()
    hour, minute = timedelta(hours=1), timedelta(minutes=1)
    raw_from = floor(now - RAW_KEEP, minute)
    minute_from = floor(now - MINUTE_KEEP, hour)
    month_from = floor(now - timedelta(days=days), hour)
    if month_from < minute_from:
        insert("hour", 3600, month_from, minute_from, 360, 0.001)
    insert("minute", 60, max(minute_from, month_from), raw_from, 6, 0.002)
    insert("raw", 10, raw_from, now, 1, 0.005)
    WorkerEvent.objects.bulk_create([
        WorkerEvent(worker_id=pk, worker_name=f"worker-{i}", kind=kind,
                    at=now - timedelta(days=day, hours=i + 1) + (timedelta(minutes=5) if kind == "healthy" else timedelta()),
                    detail="GET /ready: ConnectError" if kind == "unhealthy" else "serves SmolLM2-135M-Instruct")
        for i, pk in enumerate(ids) for day in range(days) for kind in ("unhealthy", "healthy")])
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")
    return time.perf_counter() - started


def timed(client, url: str, runs: int) -> tuple[list[float], dict]:
    """GET url `runs` times: wall times in ms, and the last answer's JSON (after one warm-up)."""
    response = client.get(url)
    if response.status_code != 200:
        raise SystemExit(f"GET {url}: {response.status_code} {response.content[:300]!r}")
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        response = client.get(url)
        body = response.content
        times.append((time.perf_counter() - started) * 1000)
    return times, json.loads(body)


def served_from(path: str, data: dict) -> str:
    """What a JSON says it was read from (the roll-up granularity, the fleet resolution), else
    the reads behind it (documented in the README)."""
    if "source" in data:
        return data["source"]
    if "resolution" in data:
        return f"history:{data['resolution']}"
    return {"fleet.json": "worker rows", "billing.json": "roll-ups + ledger",
            "errors.json": "roll-ups + ledger", "objectives.json": "roll-ups + ledger",
            "tenants.json": "roll-ups + ledger", "adapters.json": "roll-ups + ledger"}.get(path.rsplit("/", 1)[-1], "-")


def points(data: dict) -> int:
    for key in ("buckets", "tenants", "adapters", "workers"):
        if isinstance(data.get(key), list):
            return len(data[key])
    return 0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["DATABASE_URL"] = args.database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    created = create_database(args.database_url)
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection
    from django.db.models import Count
    from django.test import Client
    from django.test.utils import setup_test_environment
    from django.urls import reverse
    from django.utils import timezone

    from bench.machine import cpu_name
    from portal.fleet.history import history_fold
    from portal.fleet.models import WorkerSample
    from portal.tenants.models import Tenant
    from portal.usage.models import RollupWatermark, UsageErrorRollup, UsageRecord, UsageRollup
    from portal.usage.periods import utc_today
    from portal.usage.rollups import usage_rollup_refresh

    setup_test_environment()  # the test client's host ("testserver") is allowed
    reverse("dashboards:fleet-json")  # imports every URLconf now: a broken one fails before the data is made
    try:
        call_command("migrate", verbosity=0)
        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            server = cursor.fetchone()[0]
        print(f"CPU: {cpu_name()} ({os.cpu_count()} cores), PostgreSQL {server}")
        now = timezone.now()
        if UsageRecord.objects.exists():
            print(f"reusing {UsageRecord.objects.count():,} ledger rows and "
                  f"{WorkerSample.objects.count():,} fleet history rows in {args.database_url}")
        else:
            seconds = generate(rows=args.rows, tenants=args.tenants, days=args.days)
            print(f"generated {args.rows:,} ledger rows over {args.days} days for {args.tenants} tenants "
                  f"in {seconds:.1f} s")
            seconds = generate_fleet(workers=args.workers, days=args.days, now=now)
            counts = dict(WorkerSample.objects.values_list("resolution").annotate(n=Count("id")).order_by())
            print(f"generated fleet history for {args.workers} workers in {seconds:.1f} s: "
                  + ", ".join(f"{counts.get(r, 0):,} {r}" for r in ("raw", "minute", "hour")))
            started = time.perf_counter()
            folded = history_fold(now=now)
            counts = dict(WorkerSample.objects.values_list("resolution").annotate(n=Count("id")).order_by())
            print(f"fleet fold, first run: {time.perf_counter() - started:.1f} s ({folded['minute']:,} minute rows, "
                  f"{folded['hour']:,} hour rows written); now " + ", ".join(
                      f"{counts.get(r, 0):,} {r}" for r in ("raw", "minute", "hour")))
        UsageRollup.objects.all().delete()
        UsageErrorRollup.objects.all().delete()
        RollupWatermark.objects.all().delete()
        now = timezone.now()
        for granularity in ("minute", "hour", "day"):
            started = time.perf_counter()
            (result,) = usage_rollup_refresh(now=now, granularities=[granularity])
            print(f"roll-up, first run, {granularity:>6}: {time.perf_counter() - started:6.1f} s, "
                  f"{result.buckets:,} buckets, {result.rows:,} rows")
        # Steady state: 200 rows arrive during the minute, then the every-minute run.
        with connection.cursor() as cursor:
            cursor.execute(f"""INSERT INTO {UsageRecord._meta.db_table} (request_id, completion_id, tenant_id, model,
                worker_url, stream, prompt_tokens, completion_tokens, cached_prompt_tokens, constrained, adapter_tier,
                time_to_first_token_ms, latency_ms, finish_reason, error, error_code, status_code,
                client_disconnected, upstream_attempts, created_at, finished_at, recorded_at)
                SELECT 'bench-new-' || g || '-' || %s, '', (SELECT min(id) FROM {Tenant._meta.db_table}), 'm', '', false, 10, 10, 0,
                '', '', 100 + g, 300, 'stop', '', '', 200, false, 1, now() - interval '20 seconds', now(), now()
                FROM generate_series(1, 200) g""", [now.timestamp()])
        started = time.perf_counter()
        steady = usage_rollup_refresh()
        print(f"roll-up, steady-state run (200 new rows): {time.perf_counter() - started:.2f} s "
              f"({', '.join(f'{r.granularity} {r.buckets} bucket(s)' for r in steady)})")
        started = time.perf_counter()
        history_fold(now=timezone.now())
        print(f"fleet fold, steady-state run: {time.perf_counter() - started:.2f} s")

        busiest = (UsageRecord.objects.values("tenant__slug").order_by().annotate(n=Count("id"))
                   .order_by("-n").first()["tenant__slug"])
        tenant_id = Tenant.objects.get(slug=busiest).pk
        busiest_model = (UsageRecord.objects.filter(tenant_id=tenant_id, adapter_version__isnull=False)
                         .values_list("model", flat=True).first())
        print(f"filters: tenant {busiest}, model {busiest_model}\n")

        staff, _ = get_user_model().objects.get_or_create(username="bench-staff", defaults={"is_staff": True})
        client = Client()
        client.force_login(staff)
        today = utc_today(timezone.now())
        last_month = (today.replace(day=1) - timedelta(days=1)).strftime("%Y-%m")
        api = "/dashboards/api/"
        cases: list[tuple[str, str]] = [("fleet", f"{api}fleet.json")]
        for name in RANGES:
            cases.append((f"fleet history {name}", f"{api}fleet-history.json?range={name}"))
        for name in RANGES:
            cases.append((f"tenants {name}", f"{api}tenants.json?range={name}"))
        for name in RANGES:
            cases.append((f"latency {name}", f"{api}latency.json?range={name}"))
        for name in RANGES:
            cases.append((f"latency {name} tenant", f"{api}latency.json?range={name}&tenant={busiest}"))
        for name in RANGES:
            cases.append((f"latency {name} tenant+model",
                          f"{api}latency.json?range={name}&tenant={busiest}&model={quote(busiest_model)}"))
        for name in RANGES:
            cases.append((f"errors {name}", f"{api}errors.json?range={name}"))
        cases.append(("errors 30d tenant", f"{api}errors.json?range=30d&tenant={busiest}"))
        for name in RANGES:
            cases.append((f"objectives {name}", f"{api}objectives.json?range={name}"))
        for name in RANGES:
            cases.append((f"adapters {name}", f"{api}adapters.json?range={name}"))
        cases.append((f"billing {today:%Y-%m} (this month)", f"{api}billing.json?month={today:%Y-%m}"))
        cases.append((f"billing {last_month}", f"{api}billing.json?month={last_month}"))

        print(f"| Dashboard JSON | Served from | Bucket | Points | Median ms | Max ms | <= {GOAL_MS:.0f} ms |")
        print("|---|---|---|---|---|---|---|")
        slow = 0
        for label, url in cases:
            times, data = timed(client, url, args.runs)
            median = statistics.median(times)
            slow += median > GOAL_MS
            bucket = data.get("bucket") or (data.get("range") or {}).get("bucket", "-")
            print(f"| {label} | {served_from(url.split('?')[0], data)} | {bucket} | {points(data)} "
                  f"| {median:.0f} | {max(times):.0f} | {'yes' if median <= GOAL_MS else 'NO'} |", flush=True)
        print(f"\n{len(cases) - slow} of {len(cases)} dashboard JSONs within {GOAL_MS:.0f} ms (median of {args.runs}).")
    finally:
        if not args.keep and created:
            drop_database(args.database_url)


if __name__ == "__main__":
    main()
