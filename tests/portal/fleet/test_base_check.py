"""A worker serving a different base model than the fleet (another name, or the same name over
other shapes) is recorded unhealthy with the reason and never routed to: an adapter trained for
one base produces garbage on another. The fleet's base is the one most healthy workers serve; a
newcomer cannot take over a fleet on a tie."""

from __future__ import annotations

import logging

import pytest

from portal.fleet.models import InferenceWorker
from portal.fleet.selectors import base_model_name, route_candidates
from portal.fleet.services import fleet_poll

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fleet_settings(settings):
    settings.INFERENCE_ADMIN_TOKEN = None
    settings.INFERENCE_DISCOVERY = []


def rows() -> dict[str, InferenceWorker]:
    return {w.url: w for w in InferenceWorker.objects.all()}


def routed() -> set[str]:
    return {t.url for t in route_candidates(lora_name="lora-a")}


def test_the_odd_one_out_is_unhealthy_with_the_reason_and_not_routed(make_fake_worker, settings, caplog):
    good = [make_fake_worker(), make_fake_worker()]
    odd = make_fake_worker(base="llama-3-8b")
    settings.INFERENCE_URLS = [w.url for w in (*good, odd)]

    with caplog.at_level(logging.WARNING, logger="portal.fleet.services"):
        fleet_poll()

    found = rows()
    assert all(found[w.url].healthy for w in good)
    bad = found[odd.url]
    assert not bad.healthy and bad.base_model == "llama-3-8b"  # shown on the fleet page as what it serves
    assert bad.last_error.startswith("base model mismatch: serves 'llama-3-8b'")
    assert "the fleet serves 'smollm2'" in bad.last_error and bad.last_error.endswith("not routed")
    assert bad.resident_adapters == {} and bad.num_running == 0
    assert routed() == {w.url for w in good}
    assert base_model_name() == "smollm2"
    assert any(odd.url in r.getMessage() and "mismatch" in r.getMessage() for r in caplog.records)


def test_the_same_name_over_other_shapes_is_a_mismatch_too(make_fake_worker, settings):
    good = [make_fake_worker(), make_fake_worker()]
    odd = make_fake_worker(hidden_size=1024)  # another checkpoint behind one --served-model-name
    settings.INFERENCE_URLS = [w.url for w in (*good, odd)]

    fleet_poll()

    bad = rows()[odd.url]
    assert not bad.healthy and "hidden_size=1024" in bad.last_error and "hidden_size=576" in bad.last_error
    assert routed() == {w.url for w in good}


def test_on_a_tie_the_worker_already_serving_keeps_the_fleet(make_fake_worker, settings):
    incumbent = make_fake_worker()
    settings.INFERENCE_URLS = [incumbent.url]
    fleet_poll()
    newcomer = make_fake_worker(base="qwen2.5-0.5b")
    settings.INFERENCE_URLS = [newcomer.url, incumbent.url]

    fleet_poll()
    fleet_poll()  # and it stays that way: the newcomer's rejection does not flip the vote

    found = rows()
    assert found[incumbent.url].healthy and not found[newcomer.url].healthy
    assert routed() == {incumbent.url}


def test_once_the_odd_worker_is_fixed_it_rejoins(make_fake_worker, settings):
    good = make_fake_worker()
    odd = make_fake_worker(base="other")
    settings.INFERENCE_URLS = [good.url, odd.url]
    fleet_poll()
    assert routed() == {good.url}

    odd.base = "smollm2"  # redeployed with the fleet's model
    fleet_poll()

    assert rows()[odd.url].healthy and rows()[odd.url].last_error == ""
    assert routed() == {good.url, odd.url}
