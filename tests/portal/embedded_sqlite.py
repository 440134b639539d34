"""Run Django code in a fresh process on the embedded SQLite database `make run` uses when
DATABASE_URL and REDIS_URL are unset: nothing imported yet, and no PostgreSQL behind it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_on_embedded_sqlite(code: str, database: Path) -> subprocess.CompletedProcess:
    """`code` after django.setup(), in its own interpreter, against the SQLite file `database`."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(DATABASE_URL=f"sqlite:///{database}", DJANGO_SETTINGS_MODULE="portal.settings")
    return subprocess.run([sys.executable, "-c", "import django; django.setup()\n" + code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
