"""Pooled host blocks for adapter weights (inference/lora/host_memory.py): a block is handed out
again only once nothing can read or write it, only for a close size, free blocks are kept within
a bound, and tensors carved from one block never overlap. Adapters loaded through reused blocks
keep the file's values."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from inference.lora import host_memory
from inference.lora.adapter import load_adapter
from inference.lora.host_memory import BlockPool, HostArena
from protocol.adapter_format import WEIGHTS_FILE
from tests.inference.lora.peft_adapters import tiny_config, write_peft_adapter

MiB = 1 << 20
HOLDERS = {
    "tensor": lambda block: torch.frombuffer(block, dtype=torch.float32),
    "numpy array": lambda block: np.frombuffer(block, dtype=np.uint8),
    "memoryview": memoryview,
    "tensor view": lambda block: torch.frombuffer(block, dtype=torch.bfloat16)[10:20].view(2, 5),
}


def address(block) -> int:
    return torch.frombuffer(block, dtype=torch.uint8, count=1).data_ptr()


@pytest.mark.parametrize("holder", HOLDERS)
def test_a_block_is_handed_out_again_only_once_nothing_refers_to_it(holder: str):
    pool = BlockPool(spares=False)
    block = pool.take(3 * MiB)
    first = address(block)
    held = HOLDERS[holder](block)
    del block
    other = pool.take(3 * MiB)
    assert address(other) != first, f"a block a {holder} still refers to was handed out again"
    del other, held
    gc.collect()
    assert address(pool.take(3 * MiB)) == first


def test_a_free_block_serves_a_close_size_only():
    pool = BlockPool(spares=False)
    small_at = address(pool.take(3 * MiB))  # dropped at once: free
    big_at = address(pool.take(40 * MiB))  # the free 4 MiB block is too small for it
    assert big_at != small_at
    assert address(pool.take(3 * MiB)) == small_at  # not the 40 MiB one
    assert address(pool.take(30 * MiB)) == big_at
    assert address(pool.take(10 * MiB)) not in (small_at, big_at)  # one too small, one far larger


def test_free_blocks_beyond_the_bound_go_back_to_the_os():
    pool = BlockPool(max_idle=2, spares=False)
    held = [pool.take(size * MiB) for size in (4, 8, 20, 50)]  # no one of them serves another
    big = pool.take(200 * MiB)
    del held
    assert pool.idle_bytes() == 12 * MiB  # the first two kept, the others dropped as it looked
    assert pool.idle_bytes() == 12 * MiB
    small = pool.take(3 * MiB)  # the 4 MiB one
    del big
    assert pool.idle_bytes() == 8 * MiB + 200 * MiB
    del small
    assert pool.idle_bytes() == 8 * MiB + 200 * MiB  # still two: the 4 MiB one dropped


def test_a_pool_that_grows_faults_in_a_spare_of_the_size_it_handed_out():
    pool = BlockPool()
    held = pool.take(5 * MiB)
    deadline = time.monotonic() + 10
    while pool.idle_bytes() < len(held):
        assert time.monotonic() < deadline, "the pool made no spare block"
        time.sleep(0.01)
    spare = pool.take(5 * MiB)
    assert address(spare) != address(held)
    assert pool.idle_bytes() == 0  # the spare was the free block


def test_small_requests_are_fresh_bytearrays():
    pool = BlockPool(min_bytes=MiB)
    small = pool.take(1000)
    assert isinstance(small, bytearray) and len(small) == 1000
    assert pool.idle_bytes() == 0


def test_an_arena_carves_aligned_tensors_that_never_overlap():
    shapes = [((3, 5), torch.bfloat16), ((7,), torch.float32), ((2, 9), torch.float16)]
    arena = HostArena(HostArena.nbytes_for(shapes), pool=BlockPool(min_bytes=0, spares=False))
    tensors = [arena.empty(shape, dtype) for shape, dtype in shapes]
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % host_memory.ALIGN == 0
        t.copy_(torch.arange(t.numel()).view(t.shape))
    for t in tensors:  # nothing written after it overwrote it
        assert torch.equal(t.float(), torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    assert arena.empty((0, 4), torch.float32).shape == (0, 4)


def test_an_arena_copies_exactly_and_refuses_more_than_it_was_sized_for():
    source = torch.randn(4, 6).to(torch.bfloat16)
    arena = HostArena(HostArena.nbytes_for([((6, 4), torch.float32)]), pool=BlockPool(min_bytes=0))
    copy = arena.copy(source.T, torch.float32)  # a strided source, another dtype
    assert copy.is_contiguous() and torch.equal(copy, source.T.float())
    with pytest.raises(ValueError, match="cannot hold"):
        arena.empty((1,), torch.float32)


def as_stored(path: Path, adapter) -> dict[str, torch.Tensor]:
    """(layer, module, "a"|"b") -> the file's tensor, B with the adapter's scale folded in."""
    raw = load_file(path / WEIGHTS_FILE)
    out = {}
    for (layer, module), w in adapter.weights.items():
        prefix = next(k for k in raw if f".layers.{layer}." in k and f".{module}.lora_A" in k)[: -len(".lora_A.weight")]
        b = raw[f"{prefix}.lora_B.weight"]
        out[layer, module, "a"] = raw[f"{prefix}.lora_A.weight"]
        out[layer, module, "b"] = (b.float() * w.scale).to(b.dtype)
    return out


def assert_as_stored(path: Path, adapter) -> None:
    expected = as_stored(path, adapter)
    for (layer, module), w in adapter.weights.items():
        assert torch.equal(w.a, expected[layer, module, "a"]), (layer, module)
        assert torch.equal(w.b, expected[layer, module, "b"]), (layer, module)


def test_adapters_loaded_through_reused_blocks_keep_the_files_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pool = BlockPool(min_bytes=0, spares=False)  # the tiny adapters are far under 1 MiB
    monkeypatch.setattr(host_memory, "BLOCKS", pool)
    paths = [tmp_path / f"adapter-{seed}" for seed in range(3)]
    for seed, path in enumerate(paths):
        write_peft_adapter(path, seed=seed + 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    cfg = tiny_config()
    first = load_adapter(paths[0], "first", cfg, max_lora_rank=8)
    second = load_adapter(paths[1], "second", cfg, max_lora_rank=8)  # the first's block is in use
    assert_as_stored(paths[0], first)
    assert_as_stored(paths[1], second)
    first_at = {key: w.a.data_ptr() for key, w in first.weights.items()}
    del first
    gc.collect()
    third = load_adapter(paths[2], "third", cfg, max_lora_rank=8)
    assert {key: w.a.data_ptr() for key, w in third.weights.items()} == first_at  # the first's block
    assert_as_stored(paths[2], third)
    assert_as_stored(paths[1], second)
