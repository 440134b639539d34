"""`python -m inference serve` refuses bad flags with one line and exit status 2, before loading anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.inference.server.server_process import ROOT


@pytest.mark.parametrize(("args", "needle"), [
    (["--model", "/nonexistent/model.gguf"], "does not exist"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory: expected bytes"),
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


# --- vLLM's conventions: `serve MODEL`, the KV cache flags, --enable-lora, --api-key ---------------
@pytest.mark.parametrize(("args", "needle"), [
    (["/some/a.gguf", "--model", "/some/b.gguf"], "--model: the model is given twice and differently"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: a fraction of free memory must be in (0, 0.95]"),
    (["--kv-cache-memory-bytes", "0.5"], "--kv-cache-memory-bytes: expected bytes"),
    (["--kv-cache-memory-bytes", "1GiB", "--gpu-memory-utilization", "0.5"],
     "--kv-cache-memory-bytes: give one of --gpu-memory-utilization, --kv-cache-memory-bytes"),
    (["--no-enable-lora", "--lora-modules", "a=/tmp"], "--lora-modules: adapters need LoRA on"),
    (["--no-enable-lora", "--max-loras", "2"], "--no-enable-lora: contradicts --max-loras 2"),
    (["--lora-modules", '{"name": "a"}'], "--lora-modules: expected {\"name\": ..., \"path\": ...}"),
    (["--api-key", "  "], "--api-key: must not be empty"),
])
def test_vllm_spelled_flags_refuse_bad_values_in_one_line(args, needle, smollm2_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_")}
    if not args[0].endswith(".gguf"):
        args = ["--model", str(smollm2_path), *args]
    result = subprocess.run([sys.executable, "-m", "inference", "serve", *args], capture_output=True, text=True,
                            cwd=ROOT, env=env, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("config error: ") and needle in lines[0], result.stderr


def _serve_args(*argv: str):
    from inference.__main__ import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_the_model_is_positional_as_in_vllm_serve_and_the_flag_still_works(smollm2_path):
    from inference.server.cli import engine_config

    gguf = str(smollm2_path)
    for argv in ([gguf], ["--model", gguf], [gguf, "--model", gguf], ["--port", "9", gguf]):
        assert engine_config(_serve_args(*argv)).model == gguf, argv


def test_vllms_kv_cache_flags_are_the_same_setting_as_ours(smollm2_path):
    from inference.server.cli import engine_config

    def kv(*argv: str) -> int | float:
        return engine_config(_serve_args(str(smollm2_path), *argv)).kv_cache_memory

    assert kv("--kv-cache-memory-bytes", "268435456") == kv("--kv-cache-memory-bytes", "256MiB") == 256 << 20
    assert kv("--kv-cache-memory", "256MiB") == 256 << 20  # our spelling stays
    assert kv("--gpu-memory-utilization", "0.3") == kv("--kv-cache-memory", "0.3") == 0.3
    assert kv() == 1 << 30


def test_the_matmul_path_flag_forces_the_plan(smollm2_path):
    from inference.server.cli import engine_config

    assert engine_config(_serve_args(str(smollm2_path))).matmul_path == "auto"
    for path in ("native", "fp32-upcast", "fp32-cached"):
        assert engine_config(_serve_args(str(smollm2_path), "--matmul-path", path)).matmul_path == path
    with pytest.raises(SystemExit):  # argparse: one usage line naming the choices, exit 2
        _serve_args(str(smollm2_path), "--matmul-path", "bf16")


@pytest.mark.parametrize(("flag", "field", "unknown"), [("--lora-kernel", "lora_kernel", "triton"),
                                                    ("--attention-kernel", "attention_kernel", "sdpa"),
                                                    ("--quant-kernel", "quant_kernel", "int4")])  # fmt: skip
def test_each_kernel_flag_forces_its_kernel(smollm2_path, flag, field, unknown):
    from inference.server.cli import engine_config

    assert getattr(engine_config(_serve_args(str(smollm2_path))), field) == "auto"
    for kernel in ("fused", "torch"):
        assert getattr(engine_config(_serve_args(str(smollm2_path), flag, kernel)), field) == kernel
    with pytest.raises(SystemExit):
        _serve_args(str(smollm2_path), flag, unknown)


def test_enable_lora_is_on_by_default_and_no_enable_lora_serves_the_base_alone(smollm2_path):
    from inference.server.cli import engine_config

    assert engine_config(_serve_args(str(smollm2_path))).max_loras == 4
    assert engine_config(_serve_args(str(smollm2_path), "--enable-lora", "--max-loras", "2")).max_loras == 2
    assert engine_config(_serve_args(str(smollm2_path), "--no-enable-lora")).max_loras == 0


def test_lora_modules_take_vllms_json_form_too(tmp_path):
    from inference.server.cli import _lora_modules

    assert _lora_modules([f"a={tmp_path}", f'{{"name": "b", "path": "{tmp_path}", "base_model_name": "x"}}']) == {
        "a": str(tmp_path), "b": str(tmp_path)}


def test_api_key_and_runtime_lora_switch_come_from_the_environment_and_flags_win():
    from inference.config import AccessConfig, ConfigError

    assert AccessConfig.from_env({}).api_key is None
    assert AccessConfig.from_env({}).allow_runtime_lora_updating is False  # vLLM's default
    assert AccessConfig.from_env({"INFERENCE_API_KEY": " k1 "}).api_key == "k1"
    assert AccessConfig.from_env({"INFERENCE_API_KEY": "k1"}, api_key="k2").api_key == "k2"
    assert AccessConfig.from_env({"INFERENCE_ALLOW_RUNTIME_LORA_UPDATING": "true"}).allow_runtime_lora_updating
    with pytest.raises(ConfigError, match="INFERENCE_ALLOW_RUNTIME_LORA_UPDATING: expected true/false"):
        AccessConfig.from_env({"INFERENCE_ALLOW_RUNTIME_LORA_UPDATING": "sometimes"})


def test_every_flag_shows_its_default_and_variable_in_help_and_the_description_is_whole():
    import argparse

    from inference.__main__ import __doc__ as main_doc
    from inference.__main__ import build_parser

    parser = build_parser()
    assert main_doc.strip() in parser.format_help()  # every line of it, not its first line cut short
    [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for command, sub in subparsers.choices.items():
        text = " ".join(sub.format_help().split())  # argparse wraps lines
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.dest == "prompt":
                continue
            assert action.help and "[default: " in action.help, f"{command} {action.option_strings}: no default"
        for variable in ("INFERENCE_MODEL", "INFERENCE_DTYPE", "INFERENCE_DEVICE", "INFERENCE_MAX_LORA_RANK"):
            assert f"env: {variable}" in text, (command, variable)
    serve_help = " ".join(subparsers.choices["serve"].format_help().split())
    for variable in ("INFERENCE_API_KEY", "INFERENCE_KV_CACHE_MEMORY", "INFERENCE_MAX_NUM_SEQS",
                     "INFERENCE_ADMIN_TOKEN", "INFERENCE_SHUTDOWN_GRACE_SECONDS", "INFERENCE_ENABLE_PREFIX_CACHING"):
        assert f"env: {variable}" in serve_help, variable
    for flag in ("--api-key", "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--enable-lora", "MODEL"):
        assert flag in serve_help, flag
    assert "INFERENCE_ALLOW_RUNTIME_LORA_UPDATING" in serve_help
