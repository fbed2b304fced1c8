"""How long the planted-bug chaos faults hold a coordinator's etcd requests
(chaos/scenarios.py ``channel_hold_ms``): as long as the etcd channel
survives, and refused, naming the timing, for Timings under which the held
write would not land past the deadline the bug needs it to miss."""

from __future__ import annotations

import dataclasses

import pytest

from chaos.scenarios import DecisionOverwrite, StaleLeaderWrite, channel_hold_ms
from phalanx.store import KEEPALIVE_TIMEOUT_MS
from phalanx.timings import Timings


def test_the_hold_stays_inside_the_etcd_channels_keepalive_timeout() -> None:
    assert 0 < channel_hold_ms() < KEEPALIVE_TIMEOUT_MS


def test_the_chaos_clusters_timings_stage_both_held_write_bugs() -> None:
    t = Timings.fast()  # what chaos/cluster.py runs with
    assert StaleLeaderWrite.staged_hold_ms(t) == channel_hold_ms()
    assert DecisionOverwrite.staged_hold_ms(t) == channel_hold_ms()


def test_a_lease_that_outlives_the_hold_is_refused_naming_lease_ttl() -> None:
    t = dataclasses.replace(Timings.fast(), lease_ttl_s=4.0)
    with pytest.raises(ValueError, match=r"^stale-leader-write: .* into lease_ttl_s of its leader \(4s\), not past it"):
        StaleLeaderWrite.staged_hold_ms(t)
    with pytest.raises(ValueError, match=r"lease_ttl_s"):
        StaleLeaderWrite.staged_hold_ms(Timings())  # the production timings cannot stage it this way


def test_a_prepare_timeout_that_outlives_the_held_commit_is_refused_naming_it() -> None:
    t = dataclasses.replace(Timings.fast(), prepare_timeout_s=5.0)
    with pytest.raises(ValueError,
                       match=r"^decision-overwrite: .* into prepare_timeout_s of the participants \(5s\), not past it"):
        DecisionOverwrite.staged_hold_ms(t)
    # A shorter hold given on purpose is checked the same way.
    with pytest.raises(ValueError, match=r"prepare_timeout_s"):
        DecisionOverwrite.staged_hold_ms(Timings.fast(), hold_ms=1500)
