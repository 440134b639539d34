"""Fleet routing at scale, simulated: affinity with bounded load vs random vs round-robin.

    .venv/bin/python bench/fleet_sim.py [--requests 100000] [--adapters 10000] [--workers 16]
        [--max-loras 4] [--max-cpu-loras 16] [--max-load 64] [--load-factor 1.25] [--capacity 64]
        [--hold 5] [--utilisation 0.7] [--poll-every 10] [--zipf 1.0] [--seed 0] [--gateways 2]
        [--quick]

No model and no network: the real routing function (portal.fleet.selectors.rank_workers, over
unsaved InferenceWorker rows, so Django is set up but no database is touched), the gateway's real
in-flight ledger (portal.fleet.inflight.InflightLedger, on the simulation's clock) and the real
adapter cache (inference.lora.cache.AdapterCache, one per worker, sized like the engine's
defaults in inference.config.EngineConfig) replay one trace per adapter population.

The model, stated:
- Trace: Poisson arrivals; each request names one adapter drawn from Zipf(1.0) over the
  population. Every request occupies its worker for `--hold` seconds (default 5 s: a
  200-token answer at 40 tokens/s); the arrival rate keeps the fleet at `--utilisation` (0.7)
  of workers x `--capacity` (64) requests in flight, so about 45 per worker. Routing's bound is
  relative: a worker is passed by at `--load-factor` (settings.FLEET_LOAD_FACTOR, 1.25) x the
  fleet's mean load (about 56 here), capped at `--max-load` (settings.FLEET_MAX_LOAD, 64).
- Routing (affinity): a request reaches one of `--gateways` web processes at random (2: the
  replicas of deploy/k8s/base/web.yaml); it asks rank_workers for the order, with its own
  in-flight snapshot, and takes the first worker that is still up (a worker gone since the last
  poll refuses the connection and the gateway moves on). What the rows say comes from a poll
  every `--poll-every` seconds (10 s, the beat schedule of portal.fleet.tasks): in-flight
  requests as num_running, and the adapters in the cache's device or host tier as
  resident_adapters. Between polls the rows are stale, as in production, and each gateway
  corrects the polled loads by its own requests since (portal.fleet.selectors.worker_load).
  "affinity/live" is the same function over rows refreshed at every request. Random and
  round-robin ignore the rows and pick among the workers that are up.
- Residency: a request needs its adapter in a device slot for its step. Before the step the
  cache's tier of the adapter decides the count: device (already in a slot), host (in host
  memory: copied into a slot) or a load (from disk, into the host tier, then a slot). The
  slot is acquired and released at once (slots are shared per step, not held for the whole
  answer), so the engine's queueing behind busy slots is not modelled. Loads run inline (a
  synchronous executor), so the cache never reports "loading".
- Churn: at 25% of the trace one worker leaves, at 40% another leaves, at 60% a new worker
  joins and at 75% the first one comes back with cold caches. A leaving worker finishes what
  it holds; routing learns of both joins and leaves at the next poll.
- Imbalance: max / mean of requests per worker per second up (with a fixed fleet, max/mean of
  requests per worker).

Two populations: `--adapters` (10,000 by default: the hot set is far larger than the fleet's
slots) and one of workers x max_loras adapters, whose hot set (the fewest adapters that take
90% of the requests) fits in the fleet's slots, even the churn's smallest fleet's. Goals:
affinity's device-tier hit rate >= 3x random's, >= 90% where the hot set fits the slots, and
imbalance <= 1.25; the last line names the goals missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402

from inference.config import EngineConfig  # noqa: E402
from inference.lora.cache import AdapterCache, Tier  # noqa: E402
from portal.fleet.inflight import InflightLedger, InflightSnapshot  # noqa: E402
from portal.fleet.models import InferenceWorker  # noqa: E402
from portal.fleet.selectors import rank_workers  # noqa: E402

# "affinity/live": the same routing function over rows that are never stale (in-flight counted
# at each request, residency updated after each), what the gateway would see if it counted its own
# requests in flight between polls: the gap to "affinity" is what the 10 s poll costs.
POLICIES = ("affinity", "affinity/live", "random", "round-robin")
SCENARIOS = ("steady", "churn")
ADAPTER_NBYTES = 8 * 1024 * 1024  # what an adapter says it weighs; nothing is allocated
HOT_SET_SHARE = 0.9  # the hot set: the fewest adapters that take this share of the requests


@dataclass(frozen=True)
class SimConfig:
    requests: int = 100_000
    adapters: int = 10_000
    workers: int = 16
    max_loras: int = EngineConfig.max_loras
    max_cpu_loras: int = EngineConfig.max_cpu_loras
    max_load: int = settings.FLEET_MAX_LOAD  # routing's hard cap
    load_factor: float = settings.FLEET_LOAD_FACTOR  # routing's relative bound: c x the mean load
    capacity: int = settings.FLEET_MAX_LOAD  # requests in flight a worker counts as fully used
    hold: float = 5.0
    utilisation: float = 0.7
    poll_every: float = 10.0
    zipf: float = 1.0
    seed: int = 0
    gateways: int = 2  # web processes, each counting its own requests in flight


@dataclass(frozen=True)
class Trace:
    arrivals: np.ndarray  # (requests,) seconds, increasing
    adapters: np.ndarray  # (requests,) adapter index, 0 = the most popular
    population: int
    hot_set: int  # adapters taking HOT_SET_SHARE of this trace's requests


@dataclass
class Result:
    policy: str
    scenario: str
    population: int
    hot_set: int
    fleet_slots: int  # device slots of the smallest fleet during the run
    requests: int = 0
    routed: int = 0
    device_hits: int = 0
    host_hits: int = 0
    loads: int = 0
    cache_loads: int = 0  # the caches' own count of loads, summed over workers
    retries: int = 0  # requests first routed to a worker that had gone (affinity only)
    imbalance: float = 0.0
    per_worker: dict[str, int] = field(default_factory=dict)

    @property
    def device_pct(self) -> float:
        return 100.0 * self.device_hits / max(self.requests, 1)

    @property
    def host_pct(self) -> float:
        return 100.0 * self.host_hits / max(self.requests, 1)

    @property
    def loads_per_1k(self) -> float:
        return 1000.0 * self.loads / max(self.requests, 1)


class InlineExecutor(Executor):
    """Runs each load at once on the caller's thread: the simulation has no clock to wait on."""

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as error:  # the cache records a failed load on its entry
            future.set_exception(error)
        return future


@dataclass(frozen=True)
class SimAdapter:
    id: str
    nbytes: int = ADAPTER_NBYTES


def adapter_name(index: int) -> str:
    return f"adapter-{index:05d}"


def make_trace(config: SimConfig, population: int) -> Trace:
    rng = np.random.default_rng([config.seed, population])
    weights = 1.0 / np.arange(1, population + 1) ** config.zipf
    cdf = np.cumsum(weights) / weights.sum()
    adapters = np.minimum(np.searchsorted(cdf, rng.random(config.requests), side="right"), population - 1)
    rate = config.utilisation * config.workers * config.capacity / config.hold  # requests per second
    arrivals = np.cumsum(rng.exponential(1.0 / rate, config.requests))
    counts = np.sort(np.bincount(adapters, minlength=population))[::-1]
    hot_set = int(np.searchsorted(np.cumsum(counts), HOT_SET_SHARE * config.requests) + 1)
    return Trace(arrivals=arrivals, adapters=adapters, population=population, hot_set=hot_set)


class Worker:
    """One simulated inference worker: its adapter cache, its in-flight requests, its row."""

    def __init__(self, index: int, config: SimConfig, now: float) -> None:
        self.url = f"http://inference-{index}:8001"
        self.cache = AdapterCache(
            max_loras=config.max_loras, max_cpu_loras=config.max_cpu_loras,
            load=lambda source: SimAdapter(source), executor=InlineExecutor(),
        )
        self.in_flight = 0
        self.served = 0
        self.up_since = now
        self.up_seconds = 0.0
        self.row = InferenceWorker(pk=index, url=self.url, name=f"inference-{index}", enabled=True, healthy=True)

    def poll(self, now: float) -> None:
        """What worker_poll would write on the row: load and the adapters in memory."""
        slots = self.cache.slots
        self.row.last_polled_at = datetime.fromtimestamp(now, UTC)
        self.row.num_running = self.in_flight
        self.row.num_waiting = 0
        self.row.resident_adapters = {
            **{name: str(Tier.HOST) for name in self.cache.host},
            **{name: str(Tier.DEVICE) for name in slots if name is not None},
        }

    def serve(self, name: str, result: Result) -> None:
        """One request's step: count the tier the adapter is found in, then take a slot."""
        cache = self.cache
        cache.register(name, name)
        tier = cache.tier(name)
        if tier is Tier.DEVICE:
            result.device_hits += 1
        elif tier is Tier.HOST:
            result.host_hits += 1
        else:
            result.loads += 1
        slot = cache.acquire(name)
        if slot is None:  # it was on disk: acquire started the (inline) load; now it is in host memory
            slot = cache.acquire(name)
        if slot is None:
            raise RuntimeError(f"{self.url}: no slot for {name} although nothing holds one")
        cache.release(slot)
        self.served += 1
        self.in_flight += 1


def churn_events(config: SimConfig, duration: float) -> list[tuple[float, str, int]]:
    """(time, "leave" | "join", worker index) for the churn scenario."""
    n = config.workers
    if n < 3:
        return []
    return [(0.25 * duration, "leave", n - 1), (0.40 * duration, "leave", n - 2),
            (0.60 * duration, "join", n), (0.75 * duration, "join", n - 1)]


def fewest_workers(config: SimConfig, scenario: str) -> int:
    """Workers up at the low point of the scenario (churn: two gone, before one joins)."""
    return config.workers - 2 if scenario == "churn" and churn_events(config, 1.0) else config.workers


def simulate(config: SimConfig, trace: Trace, *, policy: str, scenario: str) -> Result:
    """Replay the trace through one routing policy; counts in the returned Result."""
    if policy not in POLICIES or scenario not in SCENARIOS:
        raise ValueError(f"unknown policy/scenario {policy!r}/{scenario!r}")
    rng = random.Random(config.seed)
    gateway_rng = random.Random(config.seed + 1)
    duration = float(trace.arrivals[-1])
    result = Result(policy=policy, scenario=scenario, population=trace.population, hot_set=trace.hot_set,
                    fleet_slots=fewest_workers(config, scenario) * config.max_loras)
    up: dict[int, Worker] = {i: Worker(i, config, 0.0) for i in range(config.workers)}  # taking connections
    processes: list[Worker] = list(up.values())  # every worker process that ever ran
    known: list[Worker] = []  # the rows routing sees, as of the last poll
    events = churn_events(config, duration) if scenario == "churn" else []
    completions: list[tuple[float, int, Worker, InflightLedger]] = []  # (finish time, tie-break, worker, gateway)
    clock = [0.0]
    gateways = [InflightLedger(clock=lambda: clock[0]) for _ in range(config.gateways)]  # one per web process
    next_poll = 0.0
    turn = itertools.count()
    live = policy == "affinity/live"

    for seq, (arrival, adapter) in enumerate(zip(trace.arrivals.tolist(), trace.adapters.tolist(), strict=True)):
        while completions and completions[0][0] <= arrival:
            clock[0], _, done, gateway = heapq.heappop(completions)
            done.in_flight -= 1
            gateway.finished(done.url)
        clock[0] = arrival
        while events and events[0][0] <= arrival:
            at, kind, index = events.pop(0)
            if kind == "leave":  # stops taking connections; what it holds still finishes
                gone = up.pop(index)
                gone.up_seconds += at - gone.up_since
            else:  # a fresh process: empty caches
                up[index] = Worker(index, config, at)
                processes.append(up[index])
        if live:  # loads read now (residency changes only where a request is served: below)
            known = list(up.values())
            for worker in known:
                worker.row.num_running = worker.in_flight
                worker.row.last_polled_at = datetime.fromtimestamp(arrival, UTC)
        elif arrival >= next_poll:
            known = list(up.values())
            for worker in known:
                worker.poll(arrival)
            next_poll = arrival + config.poll_every

        name = adapter_name(adapter)
        gateway = gateways[gateway_rng.randrange(config.gateways)]  # the Service spreads connections at random
        chosen = route(policy, name, known=known, up=up, rng=rng, turn=turn, config=config,
                       inflight=gateway.snapshot(), now=arrival, result=result)
        chosen.serve(name, result)
        if live:
            chosen.poll(arrival)
        result.requests += 1
        gateway.started(chosen.url)
        heapq.heappush(completions, (arrival + config.hold, seq, chosen, gateway))

    for worker in up.values():
        worker.up_seconds += duration - worker.up_since
    alive = [w for w in processes if w.up_seconds > 0]
    rates = [w.served / w.up_seconds for w in alive]
    result.imbalance = max(rates) / (sum(rates) / len(rates))
    result.per_worker = {f"{w.url}@{w.up_since:.0f}s": w.served for w in processes}
    result.routed = sum(w.served for w in processes)
    result.cache_loads = sum(w.cache.stats.loads for w in processes)
    return result


def route(policy: str, name: str, *, known: list[Worker], up: dict[int, Worker], rng: random.Random,
          turn: Iterator[int], config: SimConfig, inflight: InflightSnapshot, now: float, result: Result) -> Worker:
    if policy == "random":
        return rng.choice(list(up.values()))
    if policy == "round-robin":
        workers = list(up.values())
        return workers[next(turn) % len(workers)]
    by_url = {w.url: w for w in known}
    bounds = dict(max_load=config.max_load, load_factor=config.load_factor)
    ranked = rank_workers([w.row for w in known], lora_name=name, inflight=inflight, **bounds)
    for position, target in enumerate(ranked):
        worker = by_url[target.url]
        if up.get(int(worker.row.pk)) is worker:
            result.retries += position > 0
            return worker
    # Every worker routing knows of has gone: the gateway would fall back to configuration;
    # here, the rendezvous order over the workers that are up (a fresh poll).
    fresh = list(up.values())
    for worker in fresh:
        worker.poll(now)
    target = rank_workers([w.row for w in fresh], lora_name=name, inflight=inflight, **bounds)[0]
    return next(w for w in fresh if w.url == target.url)


def run(config: SimConfig) -> list[Result]:
    """Every (population, scenario, policy) over one trace per population."""
    results = []
    for population in dict.fromkeys((config.adapters, config.workers * config.max_loras)):
        trace = make_trace(config, population)
        for scenario in SCENARIOS:
            for policy in POLICIES:
                results.append(simulate(config, trace, policy=policy, scenario=scenario))
    return results


@dataclass(frozen=True)
class Verdict:
    population: int
    scenario: str
    policy: str
    ratio: float  # affinity's device-tier hit rate / random's
    fits: bool  # the hot set fits in the fleet's device slots
    device_pct: float
    imbalance: float

    @property
    def ratio_ok(self) -> bool:
        return self.ratio >= 3.0

    @property
    def device_ok(self) -> bool | None:  # None: the goal does not apply
        return self.device_pct >= 90.0 if self.fits else None

    @property
    def balance_ok(self) -> bool:
        return self.imbalance <= 1.25


def verdicts(results: list[Result]) -> list[Verdict]:
    by_key = {(r.population, r.scenario, r.policy): r for r in results}
    out = []
    for (population, scenario, policy), affinity in by_key.items():
        if not policy.startswith("affinity"):
            continue
        randomly = by_key[(population, scenario, "random")]
        out.append(Verdict(population=population, scenario=scenario, policy=policy,
                           ratio=affinity.device_pct / max(randomly.device_pct, 1e-9),
                           fits=affinity.hot_set <= affinity.fleet_slots,
                           device_pct=affinity.device_pct, imbalance=affinity.imbalance))
    return out


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "NO")


def print_report(config: SimConfig, results: list[Result], seconds: float) -> None:
    print(f"{config.workers} workers x (max_loras={config.max_loras}, max_cpu_loras={config.max_cpu_loras}), "
          f"load factor {config.load_factor:g}, max_load={config.max_load}, capacity={config.capacity}, "
          f"{config.requests:,} requests per run, Zipf({config.zipf}), hold {config.hold:g} s, "
          f"utilisation {config.utilisation:.0%}, poll every {config.poll_every:g} s, {config.gateways} gateway(s), "
          f"seed {config.seed}")
    header = (f"{'adapters':>8} {'hot set':>7} {'scenario':<8} {'policy':<13} {'device %':>8} {'host %':>7} "
              f"{'loads/1k':>8} {'imbalance':>9} {'retries':>7}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.population:>8,} {r.hot_set:>7,} {r.scenario:<8} {r.policy:<13} {r.device_pct:>8.1f} "
              f"{r.host_pct:>7.1f} {r.loads_per_1k:>8.1f} {r.imbalance:>9.2f} {r.retries:>7}")
    print()
    print("hot set = fewest adapters taking 90% of the requests; fleet slots = device slots of the smallest "
          f"fleet: {config.workers * config.max_loras} steady, {fewest_workers(config, 'churn') * config.max_loras} "
          "in churn (two workers gone)")
    missed = []
    for v in verdicts(results):
        print(f"{v.population:>6,} adapters, {v.scenario:<6}, {v.policy:<13}: device hit / random's = {v.ratio:5.2f}x "
              f"(>= 3x: {_mark(v.ratio_ok)}); device {v.device_pct:.1f}% "
              f"(>= 90% where the hot set fits: {_mark(v.device_ok)}); "
              f"imbalance {v.imbalance:.2f} (<= 1.25: {_mark(v.balance_ok)})")
        missed += [f"{v.population:,} adapters {v.scenario} {v.policy}: {goal}" for goal, ok in
                   (("3x random", v.ratio_ok), (">= 90% device", v.device_ok), ("imbalance", v.balance_ok))
                   if ok is False]
    print("goals: all met" if not missed else f"goals missed ({len(missed)}): " + "; ".join(missed))
    print(f"({seconds:.1f} s)")


def parse_args(argv: list[str] | None = None) -> SimConfig:
    defaults = SimConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in fields(SimConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)),
                            default=getattr(defaults, f.name))
    parser.add_argument("--quick", action="store_true", help="20,000 requests over 2,000 adapters")
    args = parser.parse_args(argv)
    quick = args.__dict__.pop("quick")
    config = SimConfig(**vars(args))
    if quick:
        config = quick_config(config)
    if config.workers < 1 or config.adapters < 1 or config.requests < 1:
        parser.error("--workers, --adapters and --requests must be >= 1")
    if config.max_loras < 1 or config.max_cpu_loras < config.max_loras:
        parser.error("need 1 <= --max-loras <= --max-cpu-loras")
    if config.gateways < 1 or config.load_factor < 1:
        parser.error("need --gateways >= 1 and --load-factor >= 1")
    return config


def quick_config(config: SimConfig) -> SimConfig:
    return dataclasses.replace(config, requests=min(config.requests, 20_000), adapters=min(config.adapters, 2_000))


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    start = time.perf_counter()
    results = run(config)
    print_report(config, results, time.perf_counter() - start)


if __name__ == "__main__":
    main()
