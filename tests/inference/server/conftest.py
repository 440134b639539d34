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
