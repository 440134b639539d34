"""FLEET_LOAD_FACTOR (routing's relative bound, portal.fleet.selectors.load_bound) from the
environment: its default, a value, and every bad value named in the error."""

import pytest

from portal.config import DEFAULT_FLEET_LOAD_FACTOR, ConfigError, WebConfig


@pytest.fixture(autouse=True)
def not_the_web_process(monkeypatch):
    monkeypatch.setattr("portal.config._web_process", False)  # as tests/portal/test_web_config.py


def test_the_default_and_a_value():
    assert WebConfig.from_env({}).fleet_load_factor == DEFAULT_FLEET_LOAD_FACTOR == 1.25
    assert WebConfig.from_env({"FLEET_LOAD_FACTOR": " 1.5 "}).fleet_load_factor == 1.5
    assert WebConfig.from_env({"FLEET_LOAD_FACTOR": "1"}).fleet_load_factor == 1.0  # never above the mean + 1


@pytest.mark.parametrize(("value", "fragment"), [
    ("many", "not a number"),
    ("0.9", "must be a number >= 1"),
    ("0", "must be a number >= 1"),
    ("-2", "must be a number >= 1"),
    ("inf", "must be a number >= 1"),
    ("nan", "must be a number >= 1"),
])
def test_bad_values_are_refused_naming_the_variable(value, fragment):
    with pytest.raises(ConfigError) as caught:
        WebConfig.from_env({"FLEET_LOAD_FACTOR": value})

    assert caught.value.variable == "FLEET_LOAD_FACTOR"
    assert fragment in caught.value.message
