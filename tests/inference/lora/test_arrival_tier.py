"""Each request's output says where its adapter was when it arrived (RequestOutput.adapter_tier):
"disk" for the first use of an adapter (or one evicted from host memory), "host" for one copied
into a device slot for it, "device" when it was already in a slot, "" for the base model; and
how long it queued. One device slot and two adapters used in turn, on a tiny fp32 checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams
from inference.lora.request import LoRARequest
from tests.inference.lora.peft_adapters import BASE_DIR, write_base_and_adapters

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 3, 99, 42, 7]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base_and_adapters(tmp_path_factory.mktemp("arrival_tier"), "abc", 30, r=4, lora_alpha=8,
                                   target_modules=["q_proj", "v_proj"])


def one_slot_engine(root: Path, *, max_cpu_loras: int = 4) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(root / BASE_DIR), dtype="float32", max_loras=1,
                                  max_cpu_loras=max_cpu_loras, max_lora_rank=8, kv_cache_memory="4MiB",
                                  max_num_seqs=4), progress=False)


def run(engine: LLMEngine, lora=None):
    request_id = engine.add_request(PROMPT, GREEDY, lora=lora)
    out = engine.run_until_done([request_id])[request_id]
    assert out.finish_reason == "length", out.error
    return out


def test_one_slot_two_adapters_in_turn(root: Path) -> None:
    engine = one_slot_engine(root)
    try:
        # First use of an adapter named by its path: read from disk for this request.
        assert run(engine, LoRARequest("a", root / "a")).adapter_tier == "disk"
        assert run(engine, "a").adapter_tier == "device"  # the same adapter again: warm
        engine.add_adapter("b", root / "b")  # loaded into host memory beforehand
        tiers = [run(engine, name).adapter_tier for name in ("b", "a", "b", "b", "a")]
        assert tiers == ["host", "host", "host", "device", "host"]
        base = run(engine)
        assert base.adapter_tier == ""  # the base model has no adapter to find
    finally:
        engine.shutdown()


def test_an_adapter_evicted_from_host_memory_is_disk_again(root: Path) -> None:
    engine = one_slot_engine(root, max_cpu_loras=1)  # room for one adapter in host memory
    try:
        for name in ("a", "b"):
            engine.add_adapter(name, root / name)  # b's load evicts a from host memory
        assert run(engine, "a").adapter_tier == "disk"
        assert run(engine, "a").adapter_tier == "device"
    finally:
        engine.shutdown()


def test_queue_time_is_reported_and_bounded_by_the_first_token(root: Path) -> None:
    engine = one_slot_engine(root)
    try:
        out = run(engine, LoRARequest("c", root / "c"))
        # It waited for c's load in the queue: scheduled only once c was in a slot.
        assert out.queue_time is not None and 0 <= out.queue_time <= out.time_to_first_token <= out.latency
    finally:
        engine.shutdown()
