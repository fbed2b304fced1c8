from __future__ import annotations

import dataclasses

import pytest

from coordinator.config import CoordinatorConfig

from phalanx.timings import ConfigError, Timings, timings_from_mapping


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
        ({"forward_timeout_s": 1.5}, "forward_timeout_s must be at least two etcd round trips"),
        ({"forward_timeout_s": 0.0}, "forward_timeout_s must be a positive number"),
        ({"heartbeat_interval_s": -1.0}, "heartbeat_interval_s must be a positive number"),
        ({"vote_timeout_s": 10.0}, "vote_timeout_s must be below prepare_timeout_s"),
        ({"owner_adopt_after_s": 5.0}, "owner_adopt_after_s must exceed lease_ttl_s"),
        ({"owner_adopt_after_s": 0.0}, "owner_adopt_after_s must be a positive number"),
        # 3*5 + 12 = 27 s of client retries; 12 + 2 + 10 = 24 s of holds.
        ({"gang_retention_s": 27.0}, "gang_retention_s must exceed both"),
        ({"gang_retention_s": 20.0, "lease_ttl_s": 2, "keepalive_interval_s": 0.4}, "gang_retention_s must exceed both"),
        ({"gang_retention_s": 0.0}, "gang_retention_s must be a positive number"),
        ({"node_register_grace_s": 3.5}, "node_register_grace_s must be at least reconnect_budget_s"),
        # Lost after 12 + 2 = 14 s; a new leader's grace is 60 s.
        ({"node_expire_after_s": 14.0}, "node_expire_after_s must exceed fence_after_s + replace_margin_s"),
        ({"node_expire_after_s": 60.0}, "node_expire_after_s must exceed fence_after_s + replace_margin_s"),
        ({"backfill_window_s": 0.0}, "backfill_window_s must be a positive number"),
        ({"cycle_wait_s": 1.5}, "cycle_wait_s must be at most heartbeat_interval_s"),
        ({"twophase_retry_backoff_s": 5.0}, "twophase_retry_backoff_s must be at most twophase_retry_backoff_max_s"),
        ({"twophase_store_retry_s": 5.0}, "twophase_store_retry_s must be below prepare_timeout_s - vote_timeout_s"),
        ({"owner_loss_poll_s": 30.0}, "owner_loss_poll_s must be below owner_adopt_after_s"),
        ({"store_retry_pause_s": 2.0}, "store_retry_pause_s must be at most etcd_timeout_s"),
        ({"gc_backlog_pause_s": 90.0}, "gc_backlog_pause_s must be at most"),
        ({"member_evaluate_interval_s": 0.0}, "member_evaluate_interval_s must be a positive number"),
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


def test_gang_retention_floor_is_the_larger_of_client_retries_and_holds() -> None:
    t = Timings()
    assert t.gang_retention_s == 7 * 24 * 3600
    dataclasses.replace(t, gang_retention_s=27.5).validate()  # 3*5 + 12 = 27 > 12 + 2 + 10 = 24
    slow_holds = dataclasses.replace(t, prepare_timeout_s=20.0)  # holds: 12 + 2 + 20 = 34
    with pytest.raises(ConfigError, match="gang_retention_s"):
        dataclasses.replace(slow_holds, gang_retention_s=30.0).validate()
    dataclasses.replace(slow_holds, gang_retention_s=35.0).validate()


def test_fast_profile_keeps_finished_gangs_as_long_as_the_default() -> None:
    # The chaos checker reads every acknowledged gang back after a run.
    assert Timings.fast().gang_retention_s == Timings().gang_retention_s


def test_gang_collection_sweeps_at_a_gentle_pace() -> None:
    assert Timings().gc_interval_s == 60.0
    assert dataclasses.replace(Timings.fast(), gang_retention_s=12.0).gc_interval_s == 1.2
