"""One SmolLM2 server process for the whole session (the model loads once)."""

from __future__ import annotations

import openai
import pytest

from tests.inference.server.server_process import ServerProcess, start_server

SERVED = "smollm2"
MAX_NUM_SEQS = 8
MAX_WAITING = 4


@pytest.fixture(scope="session")
def server(smollm2_path, tmp_path_factory) -> ServerProcess:
    log = tmp_path_factory.mktemp("server") / "smollm2.log"
    proc = start_server(
        ["--model", str(smollm2_path), "--served-model-name", SERVED, "alias-name", "--dtype", "float32",
         "--kv-cache-memory", "64MiB", "--max-num-seqs", str(MAX_NUM_SEQS),
         "--max-waiting-requests", str(MAX_WAITING)],
        log,
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


TINY = "tiny-base"
ADMIN_TOKEN = "test-admin-secret"
TINY_ENGINE = {"dtype": "float32", "kv_cache_memory": 4 << 20, "max_num_seqs": 32, "max_loras": 3,
               "max_cpu_loras": 5, "max_lora_rank": 16}


@pytest.fixture(scope="session")
def tiny_lora(tmp_path_factory):
    """(base checkpoint dir, {adapter name: dir}) written once per session."""
    from tests.inference.server.tiny_lora import write_adapters, write_base

    root = tmp_path_factory.mktemp("tiny_lora")
    base = write_base(root / "base")
    return base, write_adapters(base, root)


@pytest.fixture(scope="session")
def lora_server(tiny_lora, tmp_path_factory) -> ServerProcess:
    """The tiny model with 3 device slots and 5 host entries (fewer than the 8 adapters the tests
    use, so adapters move between tiers), ad0 registered at start-up, adapter routes protected."""
    base, adapters = tiny_lora
    log = tmp_path_factory.mktemp("server") / "tiny.log"
    flags = []
    for name, value in TINY_ENGINE.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    proc = start_server(
        ["--model", str(base), "--served-model-name", TINY, *flags, "--lora-modules", f"ad0={adapters['ad0']}"],
        log, env={"INFERENCE_ADMIN_TOKEN": ADMIN_TOKEN},
    )
    yield proc
    proc.stop()
