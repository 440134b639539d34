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
