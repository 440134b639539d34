"""Where a loaded adapter's memory lives and when it is (re)read, as a user of the engine sees it:
on a CPU an adapter in a device slot is held once (the slot), and gets its own host copy back
when it leaves the slot; a request for an adapter evicted from host memory starts its reload as
it is queued; a reload that fails (the file went bad, or now holds other weights) finishes the
request with an error instead of leaving it waiting; a weights file that changes between the
checks and the read is refused. One device slot, a tiny fp32 checkpoint, PEFT-written adapters;
every block read into or copied out to comes from a pool that reuses them (host_memory), as a
full-size adapter's do."""

from __future__ import annotations

import gc
import shutil
import threading
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from inference.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams
from inference.layers.linear import apply_plan
from inference.layers.matmul_plan import native_plan
from inference.lora import adapter as adapter_module
from inference.lora import host_memory
from inference.lora import manager as manager_module
from inference.lora.adapter import load_adapter
from inference.lora.errors import AdapterError
from inference.lora.request import LoRARequest
from inference.lora.slots import LoRASlots
from inference.models.config import LlamaConfig
from inference.models.llama import LlamaForCausalLM
from kernels import cpu_fused
from protocol.adapter_format import WEIGHTS_FILE
from tests.inference.lora.peft_adapters import (
    BASE_DIR,
    tiny_config,
    write_base_and_adapters,
    write_peft_adapter,
)
from tests.inference.lora.test_engine_adapters import truncate

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 3, 99, 42, 7]


@pytest.fixture(autouse=True)
def pooled_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny adapters through the block pool too (it serves blocks of 1 MiB and more)."""
    monkeypatch.setattr(host_memory, "BLOCKS", host_memory.BlockPool(min_bytes=0))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base_and_adapters(tmp_path_factory.mktemp("adapter_memory"), "abc", 50, r=4, lora_alpha=8,
                                   target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip


def one_slot_engine(root: Path, max_cpu_loras: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(root / BASE_DIR), dtype="float32", max_loras=1,
                                  max_cpu_loras=max_cpu_loras, max_lora_rank=8, kv_cache_memory="4MiB",
                                  max_num_seqs=4), progress=False)  # fmt: skip


@pytest.fixture
def engine(root: Path):
    """One device slot and room for one adapter in host memory: a second adapter's load
    evicts the first from host memory once the first has left its slot."""
    engine = one_slot_engine(root, max_cpu_loras=1)
    yield engine
    engine.shutdown()


def run(engine: LLMEngine, lora=None):
    request_id = engine.add_request(PROMPT, GREEDY, lora=lora)
    return engine.run_until_done([request_id])[request_id]


def evict_from_host_memory(engine: LLMEngine, root: Path) -> None:
    """a (the last adapter run) leaves its slot for b, then host memory for c (room for one)."""
    engine.add_adapter("b", root / "b")
    run(engine, "b")
    engine.add_adapter("c", root / "c")


def tier(engine: LLMEngine, name: str) -> str:
    return next(i.tier for i in engine.list_adapters() if i.name == name)


def test_a_resident_adapter_is_held_once_and_gets_its_host_copy_back_when_it_leaves_its_slot(
    root: Path,
) -> None:
    engine = one_slot_engine(root, max_cpu_loras=2)
    try:
        held_once_then_copied_back(engine, root)
    finally:
        engine.shutdown()


def held_once_then_copied_back(engine: LLMEngine, root: Path) -> None:
    info = engine.add_adapter("a", root / "a")
    assert engine.memory_stats()["host_adapters"] == info.nbytes  # in host memory only
    first = run(engine, "a").token_ids
    assert tier(engine, "a") == "device"
    assert engine.memory_stats()["host_adapters"] == 0  # the slot is its only copy
    assert engine.memory_stats()["adapter_buffers"] > 0  # its read buffer, kept for the next load
    engine.add_adapter("b", root / "b")
    b_tokens = run(engine, "b").token_ids  # takes the one slot: a leaves it for host memory
    assert (tier(engine, "a"), tier(engine, "b")) == ("host", "device")
    assert engine.memory_stats()["host_adapters"] == info.nbytes  # a's own copy again, b shared
    # a's values survived leaving the slot that b overwrote; b's are b's.
    assert run(engine, "a").token_ids == first
    assert run(engine, "b").token_ids == b_tokens != first


def test_a_loaded_adapter_hands_its_host_copy_to_its_slot_when_the_engine_goes_idle(engine, root: Path) -> None:
    """Not on the request's own first token, nor on the next request's: the server's engine
    thread does it once it runs out of requests."""
    info = engine.add_adapter("a", root / "a")
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    request_id = engine.add_request(PROMPT, one_token, lora="a")
    first = engine.run_until_done([request_id])[request_id].token_ids  # one step: the first token is the last
    assert engine.memory_stats()["host_adapters"] == info.nbytes  # still held twice
    engine.do_idle_work()
    assert engine.memory_stats()["host_adapters"] == 0  # the slot is its only copy
    engine.do_idle_work()  # nothing left to do: nothing changes
    assert engine.memory_stats()["host_adapters"] == 0
    again = engine.add_request(PROMPT, one_token, lora="a")
    assert engine.run_until_done([again])[again].token_ids == first  # the slot serves the same


async def test_the_servers_engine_thread_does_the_idle_work_between_requests(root: Path) -> None:
    import asyncio

    from inference.server.async_engine import AsyncEngine

    server = AsyncEngine(lambda: one_slot_engine(root, max_cpu_loras=1))
    server.start()
    try:
        await asyncio.wait_for(asyncio.to_thread(server.ready.wait, 60), 65)
        info = await asyncio.to_thread(server.engine.add_adapter, "a", root / "a")  # before any request
        stream = await server.add([{"prompt": PROMPT, "params": SamplingParams(max_tokens=1, temperature=0.0),
                                    "lora": "a"}])  # fmt: skip
        outputs = [o async for o in server.outputs(stream)]
        assert outputs[-1].finished and len(outputs[-1].token_ids) == 1
        for _ in range(200):  # the thread goes idle right after the last step: within moments
            if server.engine.memory_stats()["host_adapters"] == 0:
                break
            await asyncio.sleep(0.01)
        assert server.engine.memory_stats()["host_adapters"] == 0 < info.nbytes
    finally:
        server.shutdown()
        server.engine.shutdown()


def test_the_slot_a_cold_adapter_will_take_is_copied_out_while_it_loads(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing else to run, the engine copies the resident adapter that will lose its slot
    back to host memory while the cold one loads, not after; that adapter keeps serving from
    its slot meanwhile, and both answer as they did afterwards."""
    loading, release = threading.Event(), threading.Event()

    def held_load(path, *args, **kwargs):
        if Path(path).name == "b":
            loading.set()
            assert release.wait(10)
        return load_adapter(path, *args, **kwargs)

    monkeypatch.setattr(manager_module, "load_adapter", held_load)
    engine = one_slot_engine(root, max_cpu_loras=2)
    try:
        a_info = engine.add_adapter("a", root / "a")
        first = run(engine, "a").token_ids
        assert engine.memory_stats()["host_adapters"] == 0  # a: its slot is its only copy
        b_request = engine.add_request(PROMPT, GREEDY, lora=LoRARequest("b", root / "b"))
        assert loading.wait(10)
        engine.step()  # nothing can run: waits briefly for b's load
        assert tier(engine, "a") == "device"
        assert engine.memory_stats()["host_adapters"] == a_info.nbytes  # a's copy made already
        assert run(engine, "a").token_ids == first  # still served from its slot
        release.set()
        b_tokens = engine.run_until_done([b_request])[b_request].token_ids
        assert (tier(engine, "a"), tier(engine, "b")) == ("host", "device")
        assert engine.memory_stats()["host_adapters"] == a_info.nbytes  # copied once, b shared
        assert run(engine, "a").token_ids == first
        assert run(engine, "b").token_ids == b_tokens != first
    finally:
        release.set()
        engine.shutdown()


def test_a_request_for_an_adapter_evicted_from_host_memory_starts_its_reload_when_queued(
    engine: LLMEngine, root: Path
) -> None:
    engine.add_adapter("a", root / "a")
    expected = run(engine, "a").token_ids
    evict_from_host_memory(engine, root)
    assert tier(engine, "a") == "disk"
    request_id = engine.add_request(PROMPT, GREEDY, lora="a")
    assert tier(engine, "a") in ("loading", "host")  # before any engine step
    out = engine.run_until_done([request_id])[request_id]
    assert out.adapter_tier == "disk" and out.token_ids == expected


@pytest.mark.parametrize("reloaded", [False, True], ids=["first-load", "reload"])
@pytest.mark.parametrize("how", ["added", "requested by path"])
def test_an_adapter_evicted_from_host_memory_leaves_memory(
    engine: LLMEngine, root: Path, how: str, reloaded: bool
) -> None:
    """max_cpu_loras bounds what adapters hold: once evicted from host memory nothing keeps
    an adapter's weights (a finished load's future would), whether it was added by name or
    requested by path, loaded the first time or reloaded after an earlier eviction."""
    lora = "a" if how == "added" else LoRARequest("a", root / "a")
    if how == "added":
        engine.add_adapter("a", root / "a")
    run(engine, lora)
    if reloaded:
        evict_from_host_memory(engine, root)
        engine.remove_adapter("c")
        run(engine, "a")  # reloaded from disk by its name
    [a_id] = [i.id for i in engine.list_adapters() if i.name == "a"]
    held = weakref.ref(engine.adapters.cache.host[a_id])
    engine.add_adapter("b", root / "b")
    run(engine, "b")  # a leaves its slot: its own host copy
    engine.add_adapter("c", root / "c")  # room for one in host memory: a goes
    assert tier(engine, "a") == "disk"
    gc.collect()
    assert held() is None, f"evicted, yet held by {[type(r).__name__ for r in gc.get_referrers(held())]}"
    assert run(engine, "a").token_ids  # and it still serves, read again


@pytest.mark.parametrize("spoil", ["truncated", "other_weights"])
def test_a_reload_that_fails_finishes_the_request_with_an_error(
    engine: LLMEngine, root: Path, tmp_path: Path, spoil: str
) -> None:
    path = tmp_path / "a"
    shutil.copytree(root / "a", path)
    engine.add_adapter("a", path)
    run(engine, "a")
    evict_from_host_memory(engine, root)
    if spoil == "truncated":
        truncate(path)
    else:  # valid weights, but not the ones this name was added with: its id no longer matches
        shutil.copy(root / "c" / WEIGHTS_FILE, path / WEIGHTS_FILE)
    out = run(engine, "a")  # returns: the request does not wait for an adapter that cannot load
    assert out.finish_reason == "error" and out.token_ids == []
    assert ("corrupt or truncated" if spoil == "truncated" else "expected") in out.error
    assert run(engine, "b").finish_reason == "length"  # the others keep serving


def test_a_weights_file_that_changes_after_the_checks_is_refused(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "a"
    shutil.copytree(root / "a", path)
    checked = adapter_module.v.check_adapter

    def check_then_swap(name: str, directory: Path, config: LlamaConfig, **kwargs):
        check = checked(name, directory, config, **kwargs)
        write_peft_adapter(tmp_path / "r2", seed=1, r=2, lora_alpha=8, target_modules=["q_proj"])
        shutil.copy(tmp_path / "r2" / WEIGHTS_FILE, directory / WEIGHTS_FILE)  # another layout
        return check

    monkeypatch.setattr(adapter_module.v, "check_adapter", check_then_swap)
    with pytest.raises(AdapterError, match="changed while it was being loaded"):
        load_adapter(path, "a", tiny_config(), max_lora_rank=8)


def test_a_header_rewritten_in_place_after_the_checks_is_refused(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same length, other meaning (a tensor's dtype): the header is not the bytes judged, and
    read again it says something else."""
    path = tmp_path / "a"
    shutil.copytree(root / "a", path)
    checked = adapter_module.v.check_adapter

    def check_then_patch(name: str, directory: Path, config: LlamaConfig, **kwargs):
        check = checked(name, directory, config, **kwargs)
        raw = (directory / WEIGHTS_FILE).read_bytes()
        assert b'"dtype":"F32"' in raw
        (directory / WEIGHTS_FILE).write_bytes(raw.replace(b'"dtype":"F32"', b'"dtype":"I32"', 1))
        return check

    monkeypatch.setattr(adapter_module.v, "check_adapter", check_then_patch)
    with pytest.raises(AdapterError, match="changed while it was being loaded"):
        load_adapter(path, "a", tiny_config(), max_lora_rank=8)


@pytest.fixture(scope="module")
def root_all(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every projection adapted, k at a rank of its own: projections at one rank (o, gate/up,
    down: copied out whole) beside a mixed-rank one (q/k/v: module by module)."""
    return write_base_and_adapters(
        tmp_path_factory.mktemp("adapter_memory_all"), "ab", 70, r=4, lora_alpha=8, rank_pattern={"k_proj": 2},
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )  # fmt: skip


@pytest.mark.parametrize("targets", ["q, v and down at rank 4", "all seven, mixed ranks"])
@pytest.mark.parametrize(
    ("adapter_dtype", "stack_dtype", "kernel"),
    [
        (torch.float32, torch.float32, "torch"),
        (torch.bfloat16, torch.bfloat16, "torch"),
        (torch.bfloat16, torch.float32, "torch"),
        (torch.bfloat16, torch.bfloat16, "fused"),  # stacks paired where this CPU's build pairs rows
    ],
    ids=["fp32", "bf16", "bf16-in-fp32-stacks", "bf16-fused"],
)
def test_slot_sharing_frees_the_host_copy_and_gives_back_the_same_values(
    request: pytest.FixtureRequest, targets: str, adapter_dtype: torch.dtype, stack_dtype: torch.dtype, kernel: str
) -> None:
    root = request.getfixturevalue("root" if targets.startswith("q, v") else "root_all")
    config = tiny_config()
    model = LlamaForCausalLM(config)
    if kernel == "fused":
        if cpu_fused.fused_op() is None:
            pytest.skip(f"the fused kernel cannot be built here: {cpu_fused.unavailable_reason()}")
        apply_plan(model, replace(native_plan(stack_dtype), lora_kernel=kernel))
    slots = LoRASlots(model, max_loras=2, max_rank=8, dtype=stack_dtype, device=torch.device("cpu"))
    paired = kernel == "fused" and cpu_fused.pairs_bf16()
    assert all(projection.rows_are_views is not paired for _, projection in slots.projections)
    adapter = load_adapter(root / "a", "a", config, max_lora_rank=8, dtype=adapter_dtype)
    original = {key: (w.a.clone(), w.b.clone()) for key, w in adapter.weights.items()}
    slots.activate(1, adapter)
    slots.share(1, adapter)
    # No memory of its own left: views of the stacks, or one-element placeholders.
    stacks = {p.lora_a[i].untyped_storage().data_ptr() for _, p in slots.projections for i in range(len(p.lora_a))}
    stacks |= {p.lora_b[i].untyped_storage().data_ptr() for _, p in slots.projections for i in range(len(p.lora_b))}
    for w in adapter.weights.values():
        for t in (w.a, w.b):
            assert t.untyped_storage().data_ptr() in stacks or t.untyped_storage().nbytes() == t.element_size()
    slots.unshare(1, adapter)
    slots.deactivate(1)  # zeroes the slot: the adapter must not see it
    slots.activate(1, load_adapter(root / "b", "b", config, max_lora_rank=8, dtype=adapter_dtype))
    for key, w in adapter.weights.items():
        assert w.a.dtype == adapter_dtype and torch.equal(w.a, original[key][0])
        assert torch.equal(w.b, original[key][1])
        assert w.a.untyped_storage().data_ptr() not in stacks and w.b.untyped_storage().data_ptr() not in stacks
    # What the copies hold is what the adapter holds: no slot padding, no other adapter's rows.
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for w in adapter.weights.values() for t in (w.a, w.b)}
    assert sum(held.values()) == adapter.nbytes
    # Back in a slot it computes what it did before it left.
    slots.activate(0, adapter)
    for key, w in adapter.weights.items():
        a, b = slots.slot_weights(0, key, w.rank)
        assert torch.equal(a.to(adapter_dtype), original[key][0]) and torch.equal(b.to(adapter_dtype), original[key][1])


@pytest.mark.parametrize("stack_dtype", [torch.float32, torch.bfloat16], ids=["views-of-the-slot", "placeholders"])
def test_an_adapter_in_a_slot_gives_its_block_back_to_the_pool(
    root_all: Path, stack_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held once means its block is free: the next load reads into the same memory (already
    faulted in) rather than a new block, both for the file's read buffer and for the copy an
    adapter gets when it leaves its slot and then comes back to one."""
    pool = host_memory.BlockPool(min_bytes=0, spares=False)
    monkeypatch.setattr(host_memory, "BLOCKS", pool)
    config = tiny_config()
    slots = LoRASlots(LlamaForCausalLM(config), max_loras=1, max_rank=8, dtype=stack_dtype, device=torch.device("cpu"))
    block = host_memory.HUGE_PAGE  # what each of these tiny adapters takes

    a = load_adapter(root_all / "a", "a", config, max_lora_rank=8)
    slots.activate(0, a)
    assert pool.idle_bytes() == 0  # a's read buffer is a
    slots.share(0, a)
    assert pool.idle_bytes() == block, "the slot holds a, and so does its read buffer still"
    slots.unshare(0, a)  # a leaves the slot: its own copy, in the block it read into
    assert pool.idle_bytes() == 0
    slots.deactivate(0)
    slots.activate(0, a)
    slots.share(0, a)  # back in a slot: its copy's block is free again
    assert pool.idle_bytes() == block, "the slot holds a, and so does its copy still"
    b = load_adapter(root_all / "b", "b", config, max_lora_rank=8)
    assert pool.idle_bytes() == 0, "b was read into a new block while a free one fits"
    slots.unshare(0, a)
    slots.deactivate(0)
    slots.activate(0, b)
    assert torch.equal(slots.slot_weights(0, (0, "q_proj"), 4)[0], b.get(0, "q_proj").a.to(stack_dtype))
