"""`python -m inference serve` refuses bad flags with one line and exit status 2, before loading anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.inference.server.server_process import ROOT


@pytest.mark.parametrize(("args", "needle"), [
    (["--model", "/nonexistent/model.gguf"], "does not exist"),
    (["--kv-cache-memory", "lots"], "kv_cache_memory"),
    (["--max-loras", "4", "--max-cpu-loras", "2"], "max_cpu_loras"),
    (["--lora-modules", "noequals"], "--lora-modules"),
    (["--lora-modules", "a=/nonexistent/dir"], "not a directory"),
    (["--max-waiting-requests", "-1"], "--max-waiting-requests"),
])
def test_bad_flags_are_one_line_and_exit_2(args, needle, smollm2_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_")}
    if "--model" not in args:
        args = ["--model", str(smollm2_path), *args]
    result = subprocess.run([sys.executable, "-m", "inference", "serve", *args], capture_output=True, text=True,
                            cwd=ROOT, env=env, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("config error: ") and needle in lines[0], result.stderr


def test_successful_probes_are_left_out_of_the_access_log_and_everything_else_stays():
    import logging

    from inference.server.cli import QuietProbes

    def line(path: str, status: int) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5000", "GET", path, "1.1", status), None)

    quiet = QuietProbes()
    assert not quiet.filter(line("/ready", 200)) and not quiet.filter(line("/metrics?x=1", 200))
    assert quiet.filter(line("/ready", 503))  # a worker still loading, or dead, is worth a line
    assert quiet.filter(line("/v1/chat/completions", 200)) and quiet.filter(line("/v1/models", 200))
