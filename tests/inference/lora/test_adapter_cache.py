"""The two-tier adapter cache over opaque adapters: LRU order, pinning, load-before-evict,
one load for concurrent requests of a cold adapter, failures that leave residents alone."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from inference.lora.cache import AdapterCache, Tier


@dataclass(frozen=True)
class FakeAdapter:
    id: str
    nbytes: int = 100


class Loader:
    """Loads `FakeAdapter(source)`; sources starting with 'bad' fail like a rejected adapter."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate: threading.Event | None = None

    def __call__(self, source: str) -> FakeAdapter:
        self.calls.append(source)
        if self.gate is not None:
            assert self.gate.wait(5)
        if source.startswith("bad"):
            raise ValueError(f"adapter {source!r}: NaN in lora_B")
        return FakeAdapter(source)


class Slots:
    """Records what the device tier holds, as the LoRA layers would."""

    def __init__(self) -> None:
        self.content: dict[int, str] = {}

    def activate(self, slot: int, adapter: FakeAdapter) -> None:
        self.content[slot] = adapter.id

    def deactivate(self, slot: int) -> None:
        del self.content[slot]


def make_cache(max_loras=2, max_cpu_loras=3):
    loader, slots = Loader(), Slots()
    cache = AdapterCache(
        max_loras=max_loras, max_cpu_loras=max_cpu_loras, load=loader,
        on_activate=slots.activate, on_deactivate=slots.deactivate,
    )
    return cache, loader, slots


def load(cache: AdapterCache, *ids: str) -> None:
    for i in ids:
        cache.register(i, i)
        cache.prefetch(i).result(timeout=5)


def test_cold_adapter_loads_in_the_background_then_takes_a_slot():
    cache, loader, slots = make_cache()
    cache.register("a", "a")
    assert cache.acquire("a") is None  # miss: load started, caller waits
    assert cache.stats.misses == 1
    cache.entries["a"].future.result(timeout=5)
    assert cache.tier("a") is Tier.HOST
    slot = cache.acquire("a")
    assert slot is not None and slots.content[slot] == "a" and cache.tier("a") is Tier.DEVICE
    assert cache.stats.hits["host"] == 1
    assert cache.acquire("a") == slot and cache.stats.hits["device"] == 1
    assert loader.calls == ["a"]


def test_device_slots_evict_the_least_recently_used_idle_adapter():
    cache, _, slots = make_cache(max_loras=2, max_cpu_loras=4)
    load(cache, "a", "b", "c")
    sa, sb = cache.acquire("a"), cache.acquire("b")
    cache.release(sa)
    cache.release(sb)
    cache.release(cache.acquire("a"))  # a used more recently than b
    sc = cache.acquire("c")
    assert sc == sb and slots.content == {sa: "a", sb: "c"}
    assert cache.stats.evictions["device"] == 1
    assert cache.tier("b") is Tier.HOST  # still in the host tier


def test_next_victim_names_the_slot_the_next_cold_adapter_would_take_without_taking_it():
    cache, _, slots = make_cache(max_loras=2, max_cpu_loras=5)
    load(cache, "a", "b", "c", "d")
    sa = cache.acquire("a")
    assert cache.next_victim() is None  # a slot is still free
    sb = cache.acquire("b")
    assert cache.next_victim() is None  # both slots held by running requests
    cache.release(sb)
    cache.release(sa)
    cache.release(cache.acquire("a"))  # a used more recently than b
    assert cache.next_victim() == sb
    assert slots.content == {sa: "a", sb: "b"} and cache.stats.evictions["device"] == 0  # only named
    cache.pin("b")
    assert cache.next_victim() == sa  # a pinned adapter keeps its slot
    assert cache.acquire("c") == sa  # what it named is what was taken
    assert cache.next_victim() is None  # c runs in it, b is pinned


def test_a_slot_in_use_is_never_evicted():
    cache, _, _ = make_cache(max_loras=2, max_cpu_loras=4)
    load(cache, "a", "b", "c")
    cache.acquire("a")
    cache.acquire("b")
    assert cache.acquire("c") is None  # both slots busy: c waits
    assert cache.tier("c") is Tier.HOST


def test_host_tier_is_lru_and_keeps_slot_residents():
    cache, loader, _ = make_cache(max_loras=1, max_cpu_loras=2)
    load(cache, "a")
    cache.acquire("a")  # a is in the slot
    load(cache, "b", "c")  # host holds 2: b is evicted for c, never a (in a slot)
    assert set(cache.host) == {"a", "c"} and cache.stats.evictions["host"] == 1
    assert cache.tier("b") is Tier.DISK
    load(cache, "b")  # reloads from disk
    assert loader.calls.count("b") == 2


def test_pinned_adapters_are_never_evicted_and_pins_are_bounded():
    cache, _, _ = make_cache(max_loras=2, max_cpu_loras=3)
    load(cache, "a")
    cache.pin("a")
    with pytest.raises(ValueError, match="max_loras - 1"):
        load(cache, "b")
        cache.pin("b")
    cache.release(cache.acquire("a"))
    load(cache, "c", "d")  # the host tier evicts b, never pinned a
    assert "a" in cache.host and "b" not in cache.host
    sc = cache.acquire("c")
    cache.release(sc)
    assert cache.acquire("d") == sc  # c's slot is reused, a's pinned slot is not
    assert cache.tier("a") is Tier.DEVICE
    cache.unpin("a")
    cache.pin("c")  # the bound counts current pins only


def test_failed_load_leaves_both_tiers_untouched():
    cache, _, slots = make_cache(max_loras=1, max_cpu_loras=1)
    load(cache, "good")
    slot = cache.acquire("good")
    cache.release(slot)
    cache.register("bad1", "bad1")
    with pytest.raises(ValueError, match="NaN"):
        cache.prefetch("bad1").result(timeout=5)
    assert cache.tier("bad1") is Tier.FAILED and "NaN" in cache.entries["bad1"].error
    assert list(cache.host) == ["good"] and slots.content == {slot: "good"}
    assert cache.stats.evictions == {"device": 0, "host": 0} and cache.stats.load_failures == 1
    assert cache.acquire("good") == slot


def test_concurrent_requests_for_one_cold_adapter_load_it_once():
    cache, loader, _ = make_cache()
    loader.gate = threading.Event()
    cache.register("a", "a")
    futures = []
    threads = [threading.Thread(target=lambda: futures.append(cache.prefetch("a"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.tier("a") is Tier.LOADING
    loader.gate.set()
    assert len({id(f) for f in futures}) == 1  # all of them wait on the one load
    futures[0].result(timeout=5)
    assert cache.tier("a") is Tier.HOST and cache.host["a"] == FakeAdapter("a")
    assert loader.calls == ["a"] and cache.stats.loads == 1


def test_remove_refuses_while_in_use_and_forgets_afterwards():
    cache, _, slots = make_cache()
    load(cache, "a")
    slot = cache.acquire("a")
    with pytest.raises(RuntimeError, match="in use"):
        cache.remove("a")
    cache.release(slot)
    cache.remove("a")
    assert "a" not in cache.entries and slots.content == {} and "a" not in cache.host


def test_describe_reports_tier_bytes_hits():
    cache, _, _ = make_cache()
    load(cache, "a")
    cache.acquire("a")
    [row] = cache.describe()
    assert row["tier"] == "device" and row["bytes"] == 100 and row["hits"] == 1
    assert row["load_seconds"] is not None and cache.host_bytes == 100


def test_bad_sizes_and_double_release_are_rejected():
    with pytest.raises(ValueError, match="max_loras"):
        make_cache(max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        make_cache(max_loras=3, max_cpu_loras=2)
    cache, _, _ = make_cache()
    load(cache, "a")
    slot = cache.acquire("a")
    cache.release(slot)
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release(slot)
