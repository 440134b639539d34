"""Routing: adapter affinity with bounded load over rendezvous hashing. rank_workers is pure
(unsaved rows); route_candidates and base_model_name read the database."""

import hashlib
import math
from datetime import UTC, datetime

import hypothesis
import pytest
from hypothesis import given
from hypothesis import strategies as st

from portal.fleet.inflight import InflightLedger
from portal.fleet.models import InferenceWorker
from portal.fleet.selectors import (
    LOAD_FLOOR,
    WorkerTarget,
    base_model_name,
    load_bound,
    rank_workers,
    rendezvous_score,
    route_candidates,
    worker_load,
)


def worker(i: int, *, running: int = 0, waiting: int = 0, adapters: dict | None = None, **fields) -> InferenceWorker:
    return InferenceWorker(pk=i, url=f"http://w{i}:8001", name=f"w{i}", healthy=True, num_running=running,
                           num_waiting=waiting, resident_adapters=adapters or {}, **fields)


def urls(targets: list[WorkerTarget]) -> list[str]:
    return [t.url for t in targets]


def hash_order(key: str, workers: list[InferenceWorker]) -> list[str]:
    """The rendezvous order, computed here independently of the selector."""
    return sorted((w.url for w in workers), key=lambda u: hashlib.sha256((key + u).encode()).hexdigest(), reverse=True)


def test_without_affinity_the_order_is_rendezvous_by_adapter_name():
    fleet = [worker(i) for i in range(5)]

    for key in ("lora-a", "lora-b", "lora-c"):
        assert urls(rank_workers(fleet, lora_name=key, max_load=10)) == hash_order(key, fleet)
    assert urls(rank_workers(fleet, lora_name=None, max_load=10)) == hash_order("base", fleet)
    assert rendezvous_score("k", "http://x") == hashlib.sha256(b"khttp://x").digest()


def test_the_order_does_not_depend_on_the_row_order():
    fleet = [worker(i) for i in range(6)]

    assert rank_workers(fleet, lora_name="x", max_load=10) == rank_workers(fleet[::-1], lora_name="x", max_load=10)


def test_workers_holding_the_adapter_come_first_device_slots_first_then_least_loaded():
    fleet = [
        worker(0, running=1),
        worker(1, running=5, waiting=2, adapters={"lora-a": "device"}),
        worker(2, running=2, adapters={"lora-a": "host"}),
        worker(3, adapters={"lora-a": "disk", "lora-b": "device"}),  # evicted to disk: not resident
        worker(4, adapters={"lora-a": "failed"}),
        worker(5, running=3, adapters={"lora-a": "loading"}),
        worker(6, running=1, adapters={"lora-a": "host"}),
        worker(7, running=4, adapters={"lora-a": "device"}),
    ]

    ranked = urls(rank_workers(fleet, lora_name="lora-a", max_load=10))

    # In a slot (least loaded first), then in host memory (copied into a slot, evicting another
    # adapter there), then loading; under the floor of the bound, load alone never reorders tiers.
    assert ranked[:5] == ["http://w7:8001", "http://w1:8001", "http://w6:8001", "http://w2:8001", "http://w5:8001"]
    rest = [w for w in fleet if w.url not in ranked[:5]]
    assert ranked[5:] == hash_order("lora-a", rest)


def test_equally_loaded_affine_workers_break_ties_by_rendezvous_order():
    fleet = [worker(i, running=1, adapters={"lora-a": "device"}) for i in range(4)]

    assert urls(rank_workers(fleet, lora_name="lora-a", max_load=10)) == hash_order("lora-a", fleet)


def test_the_base_model_has_no_affinity():
    fleet = [worker(0, adapters={"base": "device"}), worker(1), worker(2)]

    assert urls(rank_workers(fleet, lora_name=None, max_load=10)) == hash_order("base", fleet)


def test_base_model_conversations_follow_their_prompt_start_and_spread_over_the_fleet():
    fleet = [worker(i) for i in range(8)]
    first = {key: urls(rank_workers(fleet, lora_name=None, max_load=10, prefix_key=key))[0]
             for key in (f"system-prompt-{n}" for n in range(64))}

    assert first["system-prompt-0"] == hash_order("base:system-prompt-0", fleet)[0]
    assert urls(rank_workers(fleet, lora_name=None, max_load=10, prefix_key="system-prompt-0"))[0] == \
        first["system-prompt-0"]  # the next turn of that conversation: the same worker, its KV cached
    assert len(set(first.values())) >= 6  # 64 system prompts use the fleet, not one "base" worker
    # An adapter's requests follow the adapter, whatever the prompt.
    assert urls(rank_workers(fleet, lora_name="lora-a", max_load=10, prefix_key="system-prompt-0")) == \
        hash_order("lora-a", fleet)


def test_an_adapters_conversation_keeps_to_one_of_its_holders_within_the_bound():
    holders = {f"http://w{i}:8001" for i in range(4)}
    fleet = [worker(i, running=i, adapters={"lora-a": "device"} if i < 4 else {}) for i in range(6)]

    chosen = {key: urls(rank_workers(fleet, lora_name="lora-a", max_load=64, prefix_key=key))[0]
              for key in (f"chat-{n}" for n in range(40))}

    assert set(chosen.values()) == holders  # conversations spread over the holders, not the least loaded
    assert chosen["chat-7"] == sorted(holders, key=lambda u: hashlib.sha256(f"lora-a:chat-7{u}".encode()).hexdigest(),
                                      reverse=True)[0]
    assert urls(rank_workers(fleet, lora_name="lora-a", max_load=64, prefix_key="chat-7"))[0] == chosen["chat-7"]
    # Its holder at the bound: the conversation moves to another holder, never to a cold worker first.
    hot = int(chosen["chat-7"].split("w")[1].split(":")[0])
    loaded = [worker(i, running=40 if i == hot else 0, adapters={"lora-a": "device"} if i < 4 else {})
              for i in range(6)]
    ranked = urls(rank_workers(loaded, lora_name="lora-a", max_load=64, prefix_key="chat-7"))
    assert ranked[0] in holders - {chosen["chat-7"]} and ranked[-1] == chosen["chat-7"]


def test_a_conversations_worker_is_passed_by_at_the_bound_like_any_other():
    fleet = [worker(i) for i in range(4)]
    home = hash_order("base:chat-1", fleet)[0]
    busy = [worker(i, running=40 if f"http://w{i}:8001" == home else 0) for i in range(4)]

    assert urls(rank_workers(busy, lora_name=None, max_load=64, prefix_key="chat-1"))[-1] == home


def test_the_hard_cap_an_overloaded_holder_spills_to_the_rendezvous_order():
    fleet = [worker(i, running=9) for i in range(4)]  # busy enough that the relative bound is over 10
    holder = fleet[1]
    holder.resident_adapters = {"lora-a": "device"}
    holder.num_running, holder.num_waiting = 6, 4  # load 10: at max_load

    ranked = urls(rank_workers(fleet, lora_name="lora-a", max_load=10))

    others = [w for w in fleet if w is not holder]
    assert ranked == [*hash_order("lora-a", others), holder.url]  # a last resort, still listed

    holder.num_waiting = 3  # load 9: under the bound, affinity wins again
    assert urls(rank_workers(fleet, lora_name="lora-a", max_load=10))[0] == holder.url


def test_overloaded_workers_go_last_even_without_affinity():
    fleet = [worker(i) for i in range(5)]
    first = hash_order("lora-z", fleet)[0]
    next(w for w in fleet if w.url == first).num_running = 50

    ranked = urls(rank_workers(fleet, lora_name="lora-z", max_load=10))

    assert ranked[-1] == first
    assert ranked[:-1] == [u for u in hash_order("lora-z", fleet) if u != first]


# ------------------------------------------------------------ the relative bound


@hypothesis.settings(max_examples=400, deadline=None)
@given(loads=st.lists(st.integers(0, 300), min_size=1, max_size=24), factor=st.floats(1.0, 3.0),
       max_load=st.integers(1, 400), holders=st.sets(st.integers(0, 23)), tiers=st.sampled_from(["device", "host"]))
def test_the_chosen_worker_is_at_most_at_the_bound_whenever_some_worker_is_under_it(loads, factor, max_load,
                                                                                    holders, tiers):
    fleet = [worker(i, running=load, adapters={"lora-a": tiers} if i in holders else None)
             for i, load in enumerate(loads)]
    bound = load_bound(loads, load_factor=factor, max_load=max_load)
    chosen = rank_workers(fleet, lora_name="lora-a", max_load=max_load, load_factor=factor)[0]

    assert bound <= max_load
    assert bound <= max(math.ceil(factor * (sum(loads) + 1) / len(loads)), LOAD_FLOOR)
    # Some worker is under the bound unless every one is at the cap (c >= 1: the bound is over the mean) ...
    assert any(load < bound for load in loads) == (min(loads) < max_load)
    if min(loads) < max_load:  # ... and then the request goes to one under it: after it, at most at the bound
        assert loads[chosen.id] + 1 <= bound


def test_a_hot_adapter_spreads_once_its_holder_passes_1_25_times_the_mean():
    """Every request for one adapter, held by one worker, placed one at a time with nothing
    finishing: the holder keeps them up to the floor, then no worker goes past the bound."""
    fleet = [worker(i) for i in range(16)]
    holder = fleet[5]
    holder.resident_adapters = {"lora-a": "device"}
    by_url = {w.url: w for w in fleet}

    firsts = []
    for _ in range(800):
        target = rank_workers(fleet, lora_name="lora-a", max_load=64, load_factor=1.25)[0]
        by_url[target.url].num_running += 1
        firsts.append(target.url)

    assert firsts[:LOAD_FLOOR] == [holder.url] * LOAD_FLOOR  # few in flight: affinity wins
    loads = [w.load for w in fleet]
    assert max(loads) <= math.ceil(1.25 * sum(loads) / len(loads))
    assert holder.load == max(loads)  # it stays at the bound, the rest go down its rendezvous order


def test_under_the_floor_a_loaded_holder_still_comes_first():
    fleet = [worker(i) for i in range(16)]
    fleet[3].resident_adapters = {"lora-a": "device"}
    fleet[3].num_running = LOAD_FLOOR - 1  # the relative bound alone would be ceil(1.25 * 8 / 16) = 1

    assert rank_workers(fleet, lora_name="lora-a", max_load=64, load_factor=1.25)[0].url == fleet[3].url
    fleet[3].num_running = LOAD_FLOOR
    assert rank_workers(fleet, lora_name="lora-a", max_load=64, load_factor=1.25)[-1].url == fleet[3].url


def test_the_floor_never_lifts_the_bound_over_the_hard_cap():
    assert load_bound([0, 0, 1], load_factor=1.25, max_load=2) == 2
    assert load_bound([0, 0, 1], load_factor=1.25, max_load=100) == LOAD_FLOOR
    assert load_bound([60, 60, 60], load_factor=1.25, max_load=100) == math.ceil(1.25 * 181 / 3)
    assert load_bound([], load_factor=1.25, max_load=100) == LOAD_FLOOR


# ------------------------------------------------------------ loads between polls


def polled(i: int, at: float, load: int, **fields) -> InferenceWorker:
    return worker(i, running=load, last_polled_at=datetime.fromtimestamp(at, UTC), **fields)


def test_between_polls_a_workers_load_is_the_polled_one_plus_this_process_changes_since():
    clock = [99.0]
    ledger = InflightLedger(clock=lambda: clock[0])
    a = polled(0, at=100.0, load=30)
    for _ in range(20):  # in flight at the poll: counted in its 30
        ledger.started(a.url)
    clock[0] = 104.0
    for _ in range(12):  # finished since
        ledger.finished(a.url)
    ledger.started(a.url)  # one more sent since

    snap = ledger.snapshot()

    assert worker_load(a, snap) == 30 - 12 + 1
    assert worker_load(a, dict(snap)) == 30  # own counts alone: the larger of the two
    assert worker_load(worker(1, running=3), snap) == 3  # never polled: nothing to correct
    b = polled(2, at=50.0, load=2)
    for _ in range(5):
        ledger.started(b.url)
    assert worker_load(b, ledger.snapshot()) == 7  # the whole own count came after its poll


def test_a_worker_whose_requests_finished_since_the_poll_is_not_passed_by():
    """The poll saw the holder over the bound; half of this process's requests there have
    finished since: the holder takes the adapter's traffic again before the next poll. With the
    larger of the polled load and the own count it stayed passed by until the next poll, while
    its load drained (bench/fleet_sim.py: the fleet swung between halves, imbalance 1.3-1.6)."""
    clock = [0.0]
    ledger = InflightLedger(clock=lambda: clock[0])
    fleet = [polled(i, at=10.0, load=40) for i in range(4)]
    holder = fleet[2]
    holder.resident_adapters = {"lora-a": "device"}
    holder.num_running = 60  # over ceil(1.25 * 181 / 4) = 57
    for _ in range(60):
        ledger.started(holder.url)  # before the poll: its 60
    clock[0] = 12.0
    for _ in range(30):
        ledger.finished(holder.url)

    stale = rank_workers(fleet, lora_name="lora-a", max_load=64, load_factor=1.25, inflight=dict(ledger.snapshot()))
    fresh = rank_workers(fleet, lora_name="lora-a", max_load=64, load_factor=1.25, inflight=ledger.snapshot())

    assert stale[-1].url == holder.url  # max(60, 30)
    assert fresh[0].url == holder.url  # 60 - 30 = 30, under ceil(1.25 * 151 / 4) = 48


def test_adding_a_worker_moves_only_about_one_nth_of_the_adapters():
    adapters = [f"lora-{i:04x}" for i in range(2000)]
    fleet = [worker(i) for i in range(9)]

    def owners(workers):
        return {name: rank_workers(workers, lora_name=name, max_load=10)[0].url for name in adapters}

    before, after = owners(fleet), owners([*fleet, worker(9)])

    moved = [name for name in adapters if before[name] != after[name]]
    assert all(after[name] == "http://w9:8001" for name in moved)  # they move only to the newcomer
    assert 0.07 < len(moved) / len(adapters) < 0.13  # about 1/10
    load = {url: list(before.values()).count(url) for url in set(before.values())}
    assert len(load) == 9 and max(load.values()) < 1.35 * len(adapters) / 9  # spread evenly

    # Removing a worker moves only the adapters it owned.
    gone = fleet[4].url
    without = owners([w for w in fleet if w.url != gone])
    assert {name for name in adapters if without[name] != before[name]} == {
        name for name in adapters if before[name] == gone
    }


def test_targets_carry_url_name_and_id():
    fleet = [worker(7), InferenceWorker(pk=8, url="http://w8:8001", name="", healthy=True)]

    targets = {t.url: t for t in rank_workers(fleet, lora_name="x", max_load=10)}

    assert targets["http://w7:8001"] == WorkerTarget(url="http://w7:8001", name="w7", id=7)
    assert targets["http://w8:8001"] == WorkerTarget(url="http://w8:8001", name="w8:8001", id=8)


# ----------------------------------------------------------------------- with the database


@pytest.mark.django_db
def test_route_candidates_excludes_unhealthy_and_disabled_workers(settings):
    settings.INFERENCE_URLS = ["http://w0:8001", "http://w1:8001", "http://w2:8001"]
    InferenceWorker.objects.create(url="http://w0:8001", healthy=True, resident_adapters={"lora-a": "device"})
    InferenceWorker.objects.create(url="http://w1:8001", healthy=False, resident_adapters={"lora-a": "device"})
    InferenceWorker.objects.create(url="http://w2:8001", healthy=True, enabled=False)
    InferenceWorker.objects.create(url="http://w3:8001", healthy=True)  # added in the admin

    assert urls(route_candidates(lora_name="lora-a")) == ["http://w0:8001", "http://w3:8001"]
    assert sorted(urls(route_candidates(lora_name=None))) == ["http://w0:8001", "http://w3:8001"]


@pytest.mark.django_db
def test_route_candidates_uses_the_default_bounds_and_accepts_a_cap(settings):
    InferenceWorker.objects.create(url="http://w0:8001", healthy=True, num_running=29,
                                   resident_adapters={"lora-a": "device"})
    InferenceWorker.objects.create(url="http://w1:8001", healthy=True, num_running=20)
    InferenceWorker.objects.create(url="http://w2:8001", healthy=True, num_running=20)

    # 69 in flight: the relative bound is ceil(1.25 * 70 / 3) = 30, the cap 64.
    assert urls(route_candidates(lora_name="lora-a"))[0] == "http://w0:8001"
    assert urls(route_candidates(lora_name="lora-a", max_load=25))[-1] == "http://w0:8001"
    settings.FLEET_MAX_LOAD = 25
    assert urls(route_candidates(lora_name="lora-a"))[-1] == "http://w0:8001"
    settings.FLEET_MAX_LOAD = 64
    InferenceWorker.objects.filter(url="http://w0:8001").update(num_running=30)  # at 1.25 x the mean
    assert urls(route_candidates(lora_name="lora-a"))[-1] == "http://w0:8001"
    settings.FLEET_LOAD_FACTOR = 1.5  # ceil(1.5 * 71 / 3) = 36
    assert urls(route_candidates(lora_name="lora-a"))[0] == "http://w0:8001"


@pytest.mark.django_db
def test_nothing_healthy_yet_falls_back_to_settings_in_rendezvous_order(settings):
    settings.INFERENCE_URLS = [f"http://w{i}:8001" for i in range(4)] + ["http://w4:8001/"]
    fallback = [worker(i) for i in range(5)]

    targets = route_candidates(lora_name="lora-a")

    assert urls(targets) == hash_order("lora-a", fallback)
    assert all(t.id is None for t in targets)
    assert targets[0].name == targets[0].url.removeprefix("http://")

    # Rows polled unhealthy: still the fallback (the poll may be stale); disabled rows are left out.
    InferenceWorker.objects.create(url="http://w0:8001", healthy=False)
    InferenceWorker.objects.create(url="http://w1:8001", healthy=False, enabled=False)
    assert urls(route_candidates(lora_name="lora-a")) == hash_order("lora-a", [w for w in fallback if w.pk != 1])

    # As soon as one row is healthy, only healthy rows are candidates.
    InferenceWorker.objects.create(url="http://w9:8001", healthy=True)
    assert urls(route_candidates(lora_name="lora-a")) == ["http://w9:8001"]


@pytest.mark.django_db
def test_no_settings_and_no_rows_means_no_candidates(settings):
    settings.INFERENCE_URLS = []

    assert route_candidates(lora_name=None) == []


@pytest.mark.django_db
def test_base_model_name_prefers_healthy_workers_then_the_last_known():
    assert base_model_name() is None

    InferenceWorker.objects.create(url="http://w0:8001", healthy=False, base_model="old-base")
    assert base_model_name() == "old-base"

    InferenceWorker.objects.create(url="http://w1:8001", healthy=True, base_model="smollm2")
    InferenceWorker.objects.create(url="http://w2:8001", healthy=True, base_model="smollm2")
    InferenceWorker.objects.create(url="http://w3:8001", healthy=True, base_model="other")
    InferenceWorker.objects.create(url="http://w4:8001", healthy=True, enabled=False, base_model="other")
    InferenceWorker.objects.create(url="http://w5:8001", healthy=True, enabled=False, base_model="other")
    assert base_model_name() == "smollm2"


def test_the_gateways_own_in_flight_requests_count_between_polls():
    """A poll up to 10 s old said both holders were idle; this process has since sent 5 requests
    to one of them and 12 to a third worker: the other holder comes first, and the third is over
    the bound (bench/fleet_sim.py: stale loads piled a hot adapter onto one worker)."""
    fleet = [worker(0, adapters={"lora-a": "device"}), worker(1, adapters={"lora-a": "device"}), worker(2)]
    by_hash = urls(rank_workers(fleet, lora_name="lora-a", max_load=10))
    first, second = by_hash[0], by_hash[1]

    ranked = urls(rank_workers(fleet, lora_name="lora-a", max_load=10,
                               inflight={first: 5, "http://w2:8001": 12}))

    assert ranked == [second, first, "http://w2:8001"]


def test_a_polled_load_above_the_own_count_still_wins():
    fleet = [worker(0, running=9, adapters={"lora-a": "device"}), worker(1, adapters={"lora-a": "device"})]

    ranked = urls(rank_workers(fleet, lora_name="lora-a", max_load=10, inflight={"http://w0:8001": 1}))

    assert ranked == ["http://w1:8001", "http://w0:8001"]  # load 9 (polled) vs 0, not 1 vs 0
