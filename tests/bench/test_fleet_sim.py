"""bench/fleet_sim.py at small sizes: the facts that hold on any machine. The real routing
function and the real adapter cache run underneath; nothing here times anything."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fleet_sim.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("fleet_sim", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


fleet_sim = load_bench()

# Small enough for a couple of seconds on one core: 8 workers, two gateway processes, the
# relative bound at 1.25x the mean load (about 64 here: utilisation 0.8 of 64 each, the cap).
CONFIG = fleet_sim.SimConfig(requests=6_000, adapters=600, workers=8, utilisation=0.8, seed=3)


@pytest.fixture(scope="module")
def results():
    trace = fleet_sim.make_trace(CONFIG, CONFIG.adapters)
    return {(scenario, policy): fleet_sim.simulate(CONFIG, trace, policy=policy, scenario=scenario)
            for scenario in fleet_sim.SCENARIOS for policy in fleet_sim.POLICIES}


@pytest.mark.parametrize("scenario", fleet_sim.SCENARIOS)
def test_affinity_finds_adapters_in_device_slots_more_often_than_random_or_round_robin(results, scenario):
    for affinity in ("affinity", "affinity/live"):
        device = results[(scenario, affinity)].device_pct
        assert device > results[(scenario, "random")].device_pct
        assert device > results[(scenario, "round-robin")].device_pct
        assert results[(scenario, affinity)].loads < results[(scenario, "random")].loads


@pytest.mark.parametrize("scenario", fleet_sim.SCENARIOS)
def test_the_bound_keeps_every_worker_within_1_25_of_the_mean(results, scenario):
    # "affinity": rows up to 10 s old, corrected by each gateway's own requests since the poll.
    for affinity in ("affinity", "affinity/live"):
        assert results[(scenario, affinity)].imbalance <= 1.25


def test_at_half_load_the_relative_bound_not_the_cap_spreads_a_hot_adapter():
    """16 adapters over 8 workers at half of 64 each: the cap (64) is twice the mean load, so a
    hot adapter piles onto its holders until c x the mean stops it."""
    config = fleet_sim.SimConfig(requests=6_000, adapters=16, workers=8, utilisation=0.5, seed=3)
    trace = fleet_sim.make_trace(config, config.adapters)

    bounded = fleet_sim.simulate(config, trace, policy="affinity", scenario="steady")
    capped = fleet_sim.simulate(dataclasses.replace(config, load_factor=100.0), trace,
                                policy="affinity", scenario="steady")

    assert bounded.imbalance <= 1.25 < capped.imbalance


@pytest.mark.parametrize("scenario", fleet_sim.SCENARIOS)
def test_every_request_is_routed_and_counted_once_by_the_real_cache(results, scenario):
    for policy in fleet_sim.POLICIES:
        r = results[(scenario, policy)]
        assert r.requests == r.routed == CONFIG.requests
        assert r.device_hits + r.host_hits + r.loads == CONFIG.requests
        assert r.loads == r.cache_loads  # the AdapterCache loaded exactly what was counted as a load


def test_workers_leaving_and_joining_get_and_lose_traffic(results):
    churn = results[("churn", "affinity")].per_worker
    steady = results[("steady", "affinity")].per_worker
    assert len(steady) == CONFIG.workers
    # Two leave, one new joins, one comes back as a fresh process: every one of them served requests.
    assert len(churn) == CONFIG.workers + 2
    assert all(served > 0 for served in churn.values())
    assert results[("churn", "affinity")].retries > 0  # stale rows sent some to a gone worker, which moved on


@pytest.mark.parametrize("adapters", [16, 32])  # 32: as many adapters as the fleet has slots
def test_a_hot_set_that_fits_the_slots_is_mostly_served_from_them(adapters):
    config = fleet_sim.SimConfig(requests=6_000, adapters=adapters, workers=8, seed=3)
    trace = fleet_sim.make_trace(config, config.adapters)
    assert trace.hot_set <= config.workers * config.max_loras

    result = fleet_sim.simulate(config, trace, policy="affinity", scenario="steady")
    randomly = fleet_sim.simulate(config, trace, policy="random", scenario="steady")

    assert result.device_pct > 85.0
    assert result.device_pct > 2 * randomly.device_pct


def test_the_report_prints_a_row_per_policy_and_scenario_and_the_goals(capsys):
    config = fleet_sim.parse_args(["--quick", "--requests", "2000", "--adapters", "200", "--workers", "4"])
    results = fleet_sim.run(config)
    fleet_sim.print_report(config, results, 0.0)

    out = capsys.readouterr().out
    assert len(results) == 2 * len(fleet_sim.SCENARIOS) * len(fleet_sim.POLICIES)  # two populations
    for policy in fleet_sim.POLICIES:
        assert out.count(f" {policy} ") >= len(fleet_sim.SCENARIOS)
    assert "device hit / random's" in out and "<= 1.25" in out
    assert "2 gateway(s)" in out and "load factor 1.25" in out
    assert out.count("goals: all met") + out.count("goals missed") == 1


@pytest.mark.parametrize(("argv", "named"), [
    (["--max-loras", "8", "--max-cpu-loras", "4"], "--max-cpu-loras"),
    (["--load-factor", "0.9"], "--load-factor"),
    (["--gateways", "0"], "--gateways"),
])
def test_bad_sizes_are_refused_with_a_message(capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        fleet_sim.parse_args(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_the_verdicts_name_a_missed_goal(capsys):
    config = fleet_sim.SimConfig(requests=100, adapters=8, workers=2)
    results = [fleet_sim.Result(policy=policy, scenario="steady", population=8, hot_set=4, fleet_slots=8,
                                requests=100, device_hits=hits, imbalance=1.5 if policy == "affinity" else 1.0)
               for policy, hits in (("affinity", 95), ("affinity/live", 20), ("random", 10), ("round-robin", 10))]

    fleet_sim.print_report(config, results, 0.0)

    last = capsys.readouterr().out.splitlines()[-2]
    assert last == ("goals missed (3): 8 adapters steady affinity: imbalance; "
                    "8 adapters steady affinity/live: 3x random; 8 adapters steady affinity/live: >= 90% device")
