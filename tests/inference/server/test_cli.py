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


LONG_TOKEN = "x" * 32


@pytest.mark.parametrize(("env", "args", "needle"), [
    ({"INFERENCE_ENV": "staging"}, [], "INFERENCE_ENV: expected one of development, production"),
    ({"INFERENCE_ENV": "production"}, [], "INFERENCE_ADMIN_TOKEN: INFERENCE_ENV=production needs an admin token"),
    ({"INFERENCE_ENV": "production", "INFERENCE_ADMIN_TOKEN": "x" * 31}, [],
     "INFERENCE_ADMIN_TOKEN: INFERENCE_ENV=production needs at least 32 characters, got 31"),
    ({}, ["--portal-origins", "http://portal:8000/internal/"], "--portal-origins: expected origins"),
    ({"INFERENCE_ADAPTER_MAX_BYTES": "lots"}, [], "INFERENCE_ADAPTER_MAX_BYTES: expected a number"),
])
def test_unsafe_or_bad_access_settings_are_one_line_and_exit_2(env, args, needle, smollm2_path):
    """Production never starts with open adapter routes; origins must be plain scheme://host[:port]."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_")} | env
    result = subprocess.run([sys.executable, "-m", "inference", "serve", "--model", str(smollm2_path), *args],
                            capture_output=True, text=True, cwd=ROOT, env=environ, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("config error: ") and needle in lines[0], result.stderr


@pytest.mark.parametrize(("env", "flags", "message"), [
    ({"INFERENCE_ENV": "production", "INFERENCE_ADMIN_TOKEN": "   "}, {}, "INFERENCE_ADMIN_TOKEN: .*needs an admin token"),
    ({"INFERENCE_ENV": "Production", "INFERENCE_ADMIN_TOKEN": LONG_TOKEN}, {"admin_token": "short"},
     "--admin-token: INFERENCE_ENV=production needs at least 32 characters, got 5"),
    ({"INFERENCE_PORTAL_ORIGINS": "http://portal:8000,ftp://portal"}, {},
     "INFERENCE_PORTAL_ORIGINS: 'ftp://portal': only http"),
    ({"INFERENCE_PORTAL_ORIGINS": "http://web:8000"}, {"portal_origins": "http://user@portal"},
     "--portal-origins: expected origins"),
    ({}, {"portal_origins": "http://portal:99999"}, "--portal-origins: 'http://portal:99999': port 99999"),
])
def test_access_config_names_the_setting_it_refuses(env, flags, message):
    from inference.config import AccessConfig, ConfigError

    with pytest.raises(ConfigError, match=message):
        AccessConfig.from_env(env, **flags)


def test_access_config_reads_the_environment_and_flags_win():
    from inference.config import AccessConfig

    assert AccessConfig.from_env({}) == AccessConfig("development", None, ())
    prod = AccessConfig.from_env({"INFERENCE_ENV": "production", "INFERENCE_ADMIN_TOKEN": f" {LONG_TOKEN} ",
                                  "INFERENCE_PORTAL_ORIGINS": "http://web:8000"})
    assert prod == AccessConfig("production", LONG_TOKEN, ("http://web:8000",))
    flags = AccessConfig.from_env({"INFERENCE_ADMIN_TOKEN": "from-env", "INFERENCE_PORTAL_ORIGINS": "http://web:8000"},
                                  admin_token="from-flag", portal_origins="https://Portal.example")
    assert flags.admin_token == "from-flag" and flags.portal_origins == ("https://portal.example:443",)


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
