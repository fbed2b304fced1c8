from __future__ import annotations

import dataclasses

import pytest

from coordinator.config import ConfigError, CoordinatorConfig, Timings, timings_from_mapping


def test_defaults_and_fast_profile_are_valid() -> None:
    Timings().validate()
    Timings.fast().validate()


@pytest.mark.parametrize(
    "changes,rule",
    [
        ({"lease_ttl_s": 1}, "lease_ttl_s must be a whole number"),
        ({"lease_ttl_s": 2.5}, "lease_ttl_s must be a whole number"),
        ({"keepalive_interval_s": 2.0}, "2*keepalive_interval_s + etcd_timeout_s"),
        ({"step_down_margin_s": 6.0}, "step_down_margin_s must be below lease_ttl_s"),
        ({"fence_after_s": 7.0}, "fence_after_s must exceed lease_ttl_s + reconnect_budget_s"),
        ({"node_not_ready_after_s": 1.5}, "node_not_ready_after_s must be at least two heartbeat"),
        ({"stop_grace_s": 20.0}, "stop_grace_s must end before"),
        ({"prepare_timeout_s": 1.0}, "prepare_timeout_s must be at least two etcd round trips"),
        ({"heartbeat_interval_s": -1.0}, "heartbeat_interval_s must be a positive number"),
        ({"vote_timeout_s": 10.0}, "vote_timeout_s must be below prepare_timeout_s"),
        ({"owner_adopt_after_s": 5.0}, "owner_adopt_after_s must exceed lease_ttl_s"),
        ({"owner_adopt_after_s": 0.0}, "owner_adopt_after_s must be a positive number"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_each_timing_rule_fails_fast_naming_itself(changes: dict, rule: str) -> None:
    with pytest.raises(ConfigError, match=rule.replace("*", r"\*").replace("+", r"\+")):
        dataclasses.replace(Timings(), **changes).validate()


def test_unknown_timing_fields_are_named() -> None:
    with pytest.raises(ConfigError, match="fence_afterr"):
        timings_from_mapping({"fence_afterr": 3})


def test_coordinator_config_names_bad_fields() -> None:
    with pytest.raises(ConfigError, match="az must be non-empty"):
        CoordinatorConfig(cluster="c", az="", coordinator_id="x", etcd=("e:1",)).validate()
    with pytest.raises(ConfigError, match="etcd must name"):
        CoordinatorConfig(cluster="c", az="a", coordinator_id="x", etcd=()).validate()
