"""worker_poll against a real `python -m inference serve` process: a tiny random Llama (written
here with numpy, no torch in this process) with one PEFT adapter registered at start-up."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from portal.fleet.models import InferenceWorker
from portal.fleet.selectors import base_model_config, base_model_name, route_candidates
from portal.fleet.services import fleet_poll

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[3]
HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB, RANK = 64, 128, 4, 2, 2, 300, 4
TOKEN = "fleet-admin-token"
API_KEY = "workers-api-key"  # the worker runs with --api-key, as `vllm serve --api-key` would
KEYED = {"Authorization": f"Bearer {API_KEY}"}


def write_tiny_base(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=HIDDEN,
                  intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  num_hidden_layers=LAYERS, vocab_size=VOCAB, rope_theta=10000.0, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  torch_dtype="float32", hidden_act="silu")
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS

    def w(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "lm_head.weight": w(VOCAB, HIDDEN),
               "model.norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": w(INTER, HIDDEN),
            p + "mlp.up_proj.weight": w(INTER, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, INTER),
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
        }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def write_adapter(path: Path) -> Path:
    """A PEFT LoRA on q_proj and v_proj, laid out as PEFT saves it."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 8,
         "target_modules": ["q_proj", "v_proj"], "bias": "none"}))
    rng = np.random.default_rng(1)
    out = {"q_proj": HIDDEN, "v_proj": KV_HEADS * HIDDEN // HEADS}
    tensors = {}
    for i in range(LAYERS):
        for module, out_features in out.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (0.1 * rng.standard_normal((RANK, HIDDEN))).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.1 * rng.standard_normal((out_features, RANK))).astype(np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture
def real_worker(tmp_path):
    base = write_tiny_base(tmp_path / "base")
    adapter = write_adapter(tmp_path / "adapter")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_")}
    env["INFERENCE_ALLOW_RUNTIME_LORA_UPDATING"] = "true"  # as deployed: the portal stages adapters
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "inference", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--model", str(base), "--served-model-name", "tiny", "--dtype", "float32",
             "--kv-cache-memory", "4MiB", "--max-num-seqs", "4", "--max-loras", "2",
             "--lora-modules", f"fleet-ad={adapter}", "--admin-token", TOKEN, "--api-key", API_KEY],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"worker exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"worker not ready:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(15)


def test_poll_a_real_worker_then_see_it_die(real_worker, settings):
    url, proc = real_worker
    settings.INFERENCE_URLS = [url]
    settings.INFERENCE_ADMIN_TOKEN = TOKEN
    settings.INFERENCE_API_KEY = None  # the portal not told the workers' API key: refused, and says why

    [worker] = fleet_poll()
    assert not worker.healthy and "INFERENCE_API_KEY" in worker.last_error, worker.last_error

    settings.INFERENCE_API_KEY = API_KEY
    [worker] = fleet_poll()

    assert worker.healthy, worker.last_error
    assert worker.last_error == ""
    assert worker.base_model == "tiny" and base_model_name() == "tiny"
    assert (worker.num_running, worker.num_waiting) == (0, 0)
    assert 0.0 <= worker.kv_cache_usage <= 1.0
    assert "fleet-ad" in worker.resident_adapters
    assert worker.memory["base_weights"] > 0 and worker.memory["kv_cache"] > 0
    # The base's shapes, for validating uploads against what the workers serve.
    assert worker.base_config["name"] == "tiny" and worker.base_config["max_lora_rank"] >= 1
    assert base_model_config()["hidden_size"] == worker.base_config["hidden_size"] > 0

    # A request for the adapter puts it in a device slot; the next poll sees it there.
    response = httpx.post(f"{url}/v1/completions", json={"model": "fleet-ad", "prompt": "t5 t6 t7", "max_tokens": 2},
                          headers=KEYED, timeout=30)
    assert response.status_code == 200, response.text
    [worker] = fleet_poll()
    assert worker.resident_adapters == {"fleet-ad": "device"}
    assert route_candidates(lora_name="fleet-ad")[0].url == url
    # The worker's adapter-cache counters come with the poll: one request, one hit.
    first = worker.cache_stats
    assert sum(first["hits"].values()) == 1 and first["misses"] <= 1 and first["load_failures"] == 0
    httpx.post(f"{url}/v1/completions", json={"model": "fleet-ad", "prompt": "t5", "max_tokens": 1}, headers=KEYED,
               timeout=30)
    [worker] = fleet_poll()
    assert worker.cache_stats["hits"]["device"] == first["hits"].get("device", 0) + 1  # still in its slot

    proc.terminate()
    proc.wait(15)
    [worker] = fleet_poll()

    assert not worker.healthy
    assert "cannot connect" in worker.last_error
    assert InferenceWorker.objects.get(url=url).base_model == "tiny"
