import subprocess
import sys

import pytest

from inference.config import ROOT, ConfigError, EngineConfig, parse_memory
from inference.models.fetch import default_model_path


def test_defaults_without_environment():
    config = EngineConfig.from_env({})
    assert config.dtype == "bfloat16" and config.device == "cpu"
    assert config.kv_cache_memory == 1 << 30
    assert config.model_path == default_model_path()


def test_environment_is_read_and_flags_win():
    env = {
        "INFERENCE_DTYPE": "float32",
        "INFERENCE_MAX_NUM_SEQS": "8",
        "INFERENCE_KV_CACHE_MEMORY": "512MiB",
        "INFERENCE_ENABLE_CHUNKED_PREFILL": "off",
    }
    config = EngineConfig.from_env(env, max_num_seqs=4, dtype=None)
    assert config.dtype == "float32"  # None flag = not given
    assert config.max_num_seqs == 4
    assert config.kv_cache_memory == 512 * 2**20
    assert config.enable_chunked_prefill is False


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1GiB", 2**30), ("512MiB", 2**29), ("2gb", 2 * 10**9), ("1048576", 2**20), ("0.3", 0.3), (2**30, 2**30)],
)
def test_memory_sizes(value, expected):
    assert parse_memory("kv", value) == expected


@pytest.mark.parametrize("value", ["lots", "1TiBB", "0.99", "0.0", "10", "-1GiB"])
def test_bad_memory_sizes_name_the_variable(value):
    with pytest.raises(ConfigError, match="^INFERENCE_KV_CACHE_MEMORY: "):
        EngineConfig.from_env({"INFERENCE_KV_CACHE_MEMORY": value})


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"INFERENCE_DTYPE": "float64"}, "INFERENCE_DTYPE"),
        ({"INFERENCE_DEVICE": "tpu"}, "INFERENCE_DEVICE"),
        ({"INFERENCE_MAX_NUM_SEQS": "abc"}, "INFERENCE_MAX_NUM_SEQS"),
        ({"INFERENCE_MAX_NUM_SEQS": "0"}, "INFERENCE_MAX_NUM_SEQS"),
        ({"INFERENCE_BLOCK_SIZE": "0"}, "INFERENCE_BLOCK_SIZE"),
        ({"INFERENCE_ENABLE_CHUNKED_PREFILL": "maybe"}, "INFERENCE_ENABLE_CHUNKED_PREFILL"),
    ],
)
def test_bad_environment_values_name_the_variable(env, variable):
    with pytest.raises(ConfigError, match=f"^{variable}: "):
        EngineConfig.from_env(env)


def test_bad_flag_values_name_the_field():
    with pytest.raises(ConfigError, match="^max_num_batched_tokens: "):
        EngineConfig(max_num_batched_tokens=4)


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--max-tokens", "-1"], {}, "max_tokens"),
        ([], {"INFERENCE_DTYPE": "float64"}, "INFERENCE_DTYPE"),
        (["--model", "/nonexistent/model.gguf"], {}, "does not exist"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, env, needle):
    result = subprocess.run(
        [sys.executable, "-m", "inference", "generate", "--prompt", "hi", *args],
        capture_output=True, text=True, cwd=ROOT, env={**_base_env(), **env}, timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_")}
