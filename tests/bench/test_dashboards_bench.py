"""bench/dashboards.py end to end at a tiny size (~20 s on 2 busy cores): it generates a ledger
and a fleet history in SQL, folds and rolls them up, and GETs every dashboard JSON through its
view; a row per JSON, the CPU named, and its own database dropped afterwards."""

import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import psycopg
from django.conf import settings

from tests.xdist_isolation import database_suffix

ROOT = Path(__file__).resolve().parents[2]
JSONS = ["fleet", *(f"{name} {r}" for name in ("fleet history", "tenants", "latency", "errors", "objectives",
                                                  "adapters") for r in ("15m", "1h", "6h", "24h", "7d", "30d"))]


def bench_database_url() -> tuple[str, str]:
    """A database of our own next to the test database (the bench creates and drops it)."""
    db = settings.DATABASES["default"]
    name = f"test_{db['NAME']}_dashbench{database_suffix()}"
    auth = quote(db.get("USER") or "postgres") + (f":{quote(db['PASSWORD'])}" if db.get("PASSWORD") else "")
    host = f"{db.get('HOST') or '127.0.0.1'}:{db.get('PORT') or 5432}"
    return f"postgres://{auth}@{host}/{name}", f"postgres://{auth}@{host}/postgres"


def test_tiny_run_times_every_dashboard_json_through_its_view_and_drops_its_database() -> None:
    url, admin = bench_database_url()
    out = subprocess.run([sys.executable, "bench/dashboards.py", "--rows", "3000", "--tenants", "3", "--days", "2",
                          "--workers", "2", "--runs", "1", "--database-url", url],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("CPU: ") and "PostgreSQL" in lines[0]
    assert any(line.startswith("generated 3,000 ledger rows") for line in lines)
    assert any(line.startswith("fleet fold, first run") for line in lines)
    rows = {cells[1].strip(): cells[2:] for cells in (line.split("|") for line in lines if line.startswith("| "))}
    for name in [*JSONS, "latency 30d tenant", "latency 7d tenant+model", "errors 30d tenant"]:
        assert name in rows, name
        assert float(rows[name][3]) >= 0 and rows[name][5].strip() in ("yes", "NO"), rows[name]
    assert rows["fleet history 30d"][0].strip() == "history:hour"
    assert rows["latency 30d"][0].strip() == "rollup:day"
    assert sum(1 for name in rows if name.startswith("billing ")) == 2
    assert lines[-1].endswith("(median of 1).")
    with psycopg.connect(admin) as conn:
        assert conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [url.rsplit("/", 1)[1]]).fetchone() is None
