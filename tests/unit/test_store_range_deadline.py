"""The deadline of an etcd range read (phalanx/store.py ``range_deadline``):
one request's deadline (the Timings' etcd_timeout_s the store is given) plus
the largest reply the client accepts at the slowest assumed rate."""

from __future__ import annotations

import pytest

from phalanx.limits import RANGE_REPLY_BYTES
from phalanx.store import RANGE_MIN_BYTES_PER_S, Store, range_deadline
from phalanx.timings import Timings


@pytest.mark.parametrize("timings", [Timings(), Timings.fast()], ids=["default", "fast"])
def test_a_store_gives_range_reads_its_request_deadline_plus_a_full_reply(timings: Timings) -> None:
    store = Store("127.0.0.1:2379", "c1", timeout=timings.etcd_timeout_s)  # not connected: nothing is sent
    assert store.range_timeout == range_deadline(timings.etcd_timeout_s)
    assert store.range_timeout == pytest.approx(timings.etcd_timeout_s + 4.0)  # 8 MiB at 2 MiB/s


def test_the_range_deadline_follows_the_request_timeout_and_the_reply_bound() -> None:
    assert range_deadline(2.0) - range_deadline(0.5) == pytest.approx(1.5)
    assert range_deadline(0.0) == pytest.approx(RANGE_REPLY_BYTES / RANGE_MIN_BYTES_PER_S)
