"""When a leader compacts an etcd it does not run (coordinator/core/compaction.py):
table tests of the plan and of the option's validation."""

from __future__ import annotations

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.compaction import MIN_RETENTION_POLLS, Sample, plan, retention_error
from phalanx.timings import ConfigError, Timings

S = Sample


@pytest.mark.parametrize("samples, now, compacted, keep, target", [
    # nothing old enough yet: keep everything, compact nothing
    ((S(0, 10), S(5, 20)), 9.0, 0, (S(0, 10), S(5, 20)), None),
    # exactly the retention old counts
    ((S(0, 10), S(5, 20)), 10.0, 0, (S(0, 10), S(5, 20)), 10),
    # the newest old-enough sample is the target; older ones are dropped
    ((S(0, 10), S(5, 20), S(12, 30)), 15.0, 0, (S(5, 20), S(12, 30)), 20),
    # already compacted at or past it: nothing to do (the samples still shrink)
    ((S(0, 10), S(5, 20), S(12, 30)), 15.0, 20, (S(5, 20), S(12, 30)), None),
    ((S(0, 10), S(5, 20), S(12, 30)), 15.0, 25, (S(5, 20), S(12, 30)), None),
    # no samples at all
    ((), 100.0, 0, (), None),
])
def test_plan(samples, now, compacted, keep, target) -> None:
    assert plan(samples, now, 10.0, compacted) == (keep, target)


def test_a_later_plan_never_goes_back() -> None:
    """Feeding samples one by one: each target is past the last."""
    samples: tuple[Sample, ...] = ()
    compacted, targets = 0, []
    for t in range(40):
        samples, target = plan(samples + (S(float(t), 100 + 3 * t),), float(t), 10.0, compacted)
        if target is not None:
            assert target > compacted
            compacted = target
            targets.append(target)
    assert targets == sorted(targets) and targets[-1] == 100 + 3 * 29 and len(samples) <= 11


@pytest.mark.parametrize("retention, poll, ok", [
    (0.0, 15.0, True),
    (MIN_RETENTION_POLLS * 15.0, 15.0, True),
    (MIN_RETENTION_POLLS * 15.0 - 1, 15.0, False),
    (5.0, 0.5, True),
    (4.9, 0.5, False),
    (float("nan"), 0.5, False),
])
def test_retention_needs_enough_readings(retention, poll, ok) -> None:
    assert (retention_error(retention, poll) is None) == ok


def test_config_names_the_field() -> None:
    base = dict(cluster="c", az="a", coordinator_id="c0", etcd=("127.0.0.1:2379",))
    CoordinatorConfig(**base, etcd_compact_retention_s=600.0).validate()
    for bad in (-1.0, 60.0, "x"):
        with pytest.raises(ConfigError, match="etcd_compact_retention_s"):
            CoordinatorConfig(**base, timings=Timings(), etcd_compact_retention_s=bad).validate()
