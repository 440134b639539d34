"""The engine's adapter API as a user of it sees it: add / list / pin / remove, identity when a
name is re-added, bad adapters that leave resident ones serving unchanged, and the memory and
cache accounting. A tiny random fp32 checkpoint; adapters written by PEFT (peft_adapters.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams
from inference.lora.errors import AdapterError
from inference.lora.manager import AdapterNotFoundError
from inference.lora.request import LoRARequest
from tests.inference.lora.peft_adapters import BASE_DIR, write_base_and_adapters, write_peft_adapter

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 3, 99, 42, 7, 250, 11]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_base_and_adapters(tmp_path_factory.mktemp("engine_adapters"), "abcd", 10, r=8, lora_alpha=16,
                                   target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
    write_peft_adapter(root / "a_v2", seed=99, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return root


def make_engine(root: Path, **overrides) -> LLMEngine:
    config = dict(model=str(root / BASE_DIR), dtype="float32", max_loras=2, max_cpu_loras=4,
                  max_lora_rank=16, kv_cache_memory="8MiB", max_num_seqs=8)  # fmt: skip
    engine = LLMEngine(EngineConfig(**{**config, **overrides}), progress=False)
    return engine


@pytest.fixture
def engine(root: Path):
    engine = make_engine(root)
    yield engine
    engine.shutdown()


def run(engine: LLMEngine, lora=None, prompt=PROMPT) -> list[int]:
    request_id = engine.add_request(prompt, GREEDY, lora=lora)
    out = engine.run_until_done([request_id])[request_id]
    assert out.finish_reason == "length", out.error
    return out.token_ids


def test_added_adapter_is_listed_served_and_changes_the_output(engine: LLMEngine, root: Path) -> None:
    info = engine.add_adapter("a", root / "a")
    assert info.name == "a" and info.tier == "host" and info.rank == 8 and info.nbytes > 0
    assert len(info.id) == 64 and info.error is None and info.load_seconds > 0
    base, adapted = run(engine), run(engine, "a")
    assert adapted != base
    [listed] = engine.list_adapters()
    assert listed.tier == "device" and listed.hits == 1 and listed.last_used is not None
    assert engine.lora_stats()["loads"] == 1 and engine.lora_stats()["hits"]["host"] == 1
    assert run(engine, "a") == adapted  # now a device hit
    assert engine.lora_stats()["hits"]["device"] == 1


def test_unknown_adapter_name_is_refused_at_submission(engine: LLMEngine) -> None:
    with pytest.raises(AdapterNotFoundError, match="'nope' is not registered"):
        engine.add_request(PROMPT, GREEDY, lora="nope")
    assert not engine.has_unfinished_requests()


def test_readding_a_name_gives_a_new_id_and_bound_requests_keep_the_old(engine: LLMEngine, root: Path) -> None:
    old = engine.add_adapter("a", root / "a")
    old_tokens = run(engine, "a")
    early = engine.add_request(PROMPT, GREEDY, lora="a")  # bound to the old weights
    new = engine.add_adapter("a", root / "a_v2")
    assert new.id != old.id
    late = engine.add_request(PROMPT, GREEDY, lora="a")
    done = engine.run_until_done([early, late])
    assert done[early].token_ids == old_tokens
    assert done[late].token_ids != old_tokens
    engine.step()  # the old id leaves the cache once nothing uses it
    assert old.id not in engine.adapters.cache.entries
    assert [i.id for i in engine.list_adapters()] == [new.id]


def test_same_content_under_two_names_shares_one_id(engine: LLMEngine, root: Path) -> None:
    assert engine.add_adapter("a", root / "a").id == engine.add_adapter("a-copy", root / "a").id
    assert run(engine, "a") == run(engine, "a-copy")


def corrupt_nan(path: Path) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    key = sorted(k for k in tensors if "lora_A" in k)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def add_pickle(path: Path) -> None:
    (path / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")


def truncate(path: Path) -> None:
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


BAD = {
    "pickle": (add_pickle, "pickle"),
    "nan": (corrupt_nan, "nan"),
    "dora": (lambda p: edit_config(p, use_dora=True), "DoRA"),
    "modules_to_save": (lambda p: edit_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    "bias": (lambda p: edit_config(p, bias="all"), "bias"),
    "rank": (lambda p: edit_config(p, r=32), "rank"),
    "target": (lambda p: edit_config(p, target_modules=["embed_tokens"]), "embed_tokens"),
    "other_model": (lambda p: edit_config(p, base_model_name_or_path="HuggingFaceTB/SmolLM2-1.7B"), "1.7B"),
    "truncated": (truncate, "safetensors"),
    "no_config": (lambda p: (p / "adapter_config.json").unlink(), "adapter_config.json"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_is_refused_and_resident_adapters_keep_serving(
    engine: LLMEngine, root: Path, tmp_path: Path, case: str
) -> None:
    engine.add_adapter("a", root / "a")
    engine.add_adapter("b", root / "b")
    before = {"a": run(engine, "a"), "b": run(engine, "b")}
    tiers = {i.name: i.tier for i in engine.list_adapters()}
    bad = tmp_path / "bad"
    shutil.copytree(root / "c", bad)
    edit, words = BAD[case]
    edit(bad)
    with pytest.raises(AdapterError) as excinfo:
        engine.add_adapter("bad", bad)
    assert str(excinfo.value).startswith("adapter 'bad': ")
    assert words.lower() in str(excinfo.value).lower()
    # Nothing moved: same tiers, no eviction, same outputs; the bad name is not registered.
    assert {i.name: i.tier for i in engine.list_adapters()} == tiers
    assert engine.lora_stats()["evictions"] == {"device": 0, "host": 0}
    assert {"a": run(engine, "a"), "b": run(engine, "b")} == before
    assert not engine.has_adapter("bad")


def test_replacing_a_name_with_a_bad_adapter_keeps_the_good_one(engine: LLMEngine, root: Path, tmp_path: Path) -> None:
    good = engine.add_adapter("a", root / "a")
    tokens = run(engine, "a")
    bad = tmp_path / "bad"
    shutil.copytree(root / "a", bad)
    corrupt_nan(bad)
    with pytest.raises(AdapterError):
        engine.add_adapter("a", bad)
    assert [i.id for i in engine.list_adapters()] == [good.id]
    assert run(engine, "a") == tokens


def test_request_whose_adapter_fails_to_load_finishes_alone_with_an_error(engine: LLMEngine, root: Path) -> None:
    ok = engine.add_request(PROMPT, GREEDY)
    broken = engine.add_request(PROMPT, GREEDY, lora=LoRARequest("ghost", root / "does-not-exist"))
    done = engine.run_until_done([ok, broken])
    assert done[broken].finish_reason == "error" and "ghost" in done[broken].error
    assert done[broken].token_ids == []
    assert done[ok].finish_reason == "length" and len(done[ok].token_ids) == 8
    assert not engine.has_adapter("ghost")  # a failed on-the-fly load registers nothing


def test_remove_lets_running_requests_finish_and_refuses_new_ones(engine: LLMEngine, root: Path) -> None:
    info = engine.add_adapter("a", root / "a")
    expected = run(engine, "a")
    running = engine.add_request(PROMPT, GREEDY, lora="a")
    engine.step()  # admitted: it holds a's slot
    engine.remove_adapter("a")
    with pytest.raises(AdapterNotFoundError):
        engine.add_request(PROMPT, GREEDY, lora="a")
    assert engine.run_until_done([running])[running].token_ids == expected
    engine.step()
    assert engine.list_adapters() == [] and info.id not in engine.adapters.cache.entries
    assert engine.adapters.slots.ranks.tolist() == [0, 0]  # its slot was cleared
    stacks = [t for _, p in engine.adapters.slots.projections for t in p.lora_a + p.lora_b]
    assert all(t.abs().sum() == 0 for t in stacks)  # and its rows zeroed, a step after removal
    with pytest.raises(AdapterNotFoundError):
        engine.remove_adapter("a")


def test_a_slot_refilled_by_an_eviction_serves_exactly_the_new_adapter(root: Path, tmp_path: Path) -> None:
    """An eviction leaves the slot's rows for the next adapter to overwrite (no zeroing pass):
    a narrower adapter (rank 8 on q/v/down) after a wider one (rank 16 on every projection)
    must leave nothing of the wider one behind."""
    write_peft_adapter(tmp_path / "wide", seed=5, r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    fresh = make_engine(root, max_loras=1)
    try:
        expected = run(fresh, LoRARequest("a", root / "a"))
    finally:
        fresh.shutdown()
    engine = make_engine(root, max_loras=1)
    try:
        wide = run(engine, LoRARequest("wide", tmp_path / "wide"))
        assert run(engine, LoRARequest("a", root / "a")) == expected != wide
        assert engine.lora_stats()["evictions"]["device"] == 1
        assert run(engine, "wide") == wide  # the evicted one, back from the host tier, intact
    finally:
        engine.shutdown()


def test_pinned_adapter_is_never_evicted(engine: LLMEngine, root: Path) -> None:
    for name in "abcd":
        engine.add_adapter(name, root / name)
    engine.pin_adapter("a")
    with pytest.raises(ValueError, match="at most max_loras - 1 = 1"):
        engine.pin_adapter("b")
    expected = run(engine, "a")
    for name in "bcdbcd":  # two slots: a stays, the other slot cycles
        run(engine, name)
    tiers = {i.name: i.tier for i in engine.list_adapters()}
    assert tiers["a"] == "device" and [i.pinned for i in engine.list_adapters()] == [True, False, False, False]
    assert engine.lora_stats()["evictions"]["device"] >= 4
    assert run(engine, "a") == expected
    engine.pin_adapter("a", pinned=False)
    engine.pin_adapter("b")  # room again once a is unpinned


def test_host_tier_is_an_lru_and_an_evicted_adapter_reloads_from_disk(root: Path) -> None:
    engine = make_engine(root, max_loras=1, max_cpu_loras=2)
    try:
        for name in "abc":
            engine.add_adapter(name, root / name)  # the third add evicts "a" from the host
        tiers = {i.name: i.tier for i in engine.list_adapters()}
        assert tiers == {"a": "disk", "b": "host", "c": "host"}
        assert engine.lora_stats()["evictions"]["host"] == 1
        tokens = run(engine, "a")  # reloaded in the background, then served
        assert engine.lora_stats()["misses"] == 1 and engine.lora_stats()["loads"] == 4
        assert tokens == run(engine, "a")
    finally:
        engine.shutdown()


def test_one_step_never_holds_more_adapters_than_slots(engine: LLMEngine, root: Path) -> None:
    for name in "abcd":
        engine.add_adapter(name, root / name)
    ids = [engine.add_request(PROMPT, GREEDY, lora=name) for name in "abcd" for _ in range(2)]
    pending = set(ids)
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.request_id)
        in_step = {seq.adapter_slot for seq in engine.scheduler.running}
        assert len(in_step) <= 2 and -1 not in in_step


def test_memory_accounting(engine: LLMEngine, root: Path) -> None:
    before = engine.memory_stats()
    assert before["base_weights"] > 0 and before["kv_cache"] >= 8 * 2**20 * 0.9
    assert before["adapter_slots"] > 0 and before["host_adapters"] == 0
    info = engine.add_adapter("a", root / "a")
    assert engine.memory_stats()["host_adapters"] == info.nbytes
    assert engine.memory_stats()["adapter_slots"] == before["adapter_slots"]  # preallocated


def test_lora_can_be_disabled(root: Path) -> None:
    engine = make_engine(root, max_loras=0, max_cpu_loras=0)
    with pytest.raises(ValueError, match="max_loras is 0"):
        engine.add_adapter("a", root / "a")
    with pytest.raises(ValueError, match="max_loras is 0"):
        engine.add_request(PROMPT, GREEDY, lora="a")
    assert engine.memory_stats()["adapter_slots"] == 0 and engine.list_adapters() == []
    assert len(run(engine)) == 8


@pytest.mark.parametrize("name", ["", "has space", "x" * 200, BASE_DIR])
def test_bad_adapter_names(engine: LLMEngine, root: Path, name: str) -> None:
    with pytest.raises(ValueError, match="lora_name"):
        engine.add_adapter(name, root / "a")


def test_adapter_added_without_waiting(engine: LLMEngine, root: Path) -> None:
    future = engine.add_adapter("a", root / "a", wait=False)
    assert future.result(timeout=30).tier == "host"
    assert torch.equal(torch.tensor(run(engine, "a")), torch.tensor(run(engine, "a")))


def test_offline_llm_takes_an_adapter_per_prompt(root: Path) -> None:
    from inference.llm import LLM

    llm = LLM(str(root / BASE_DIR), dtype="float32", max_loras=2, max_cpu_loras=2, kv_cache_memory="8MiB")
    try:
        llm.add_adapter("a", str(root / "a"))
        with_a, base = llm.generate([PROMPT, PROMPT], GREEDY, lora=["a", None])
        assert with_a.token_ids != base.token_ids
        assert llm.generate(PROMPT, GREEDY)[0].token_ids == base.token_ids
        [by_request] = llm.generate(PROMPT, GREEDY, lora=LoRARequest("a2", root / "a"))
        assert by_request.token_ids == with_a.token_ids
        with pytest.raises(ValueError, match="lora: 1 adapters for 2 prompts"):
            llm.generate([PROMPT, PROMPT], GREEDY, lora=["a"])
        with pytest.raises(AdapterNotFoundError):
            llm.generate([PROMPT, PROMPT], GREEDY, lora=[None, "missing"])
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.engine.shutdown()
