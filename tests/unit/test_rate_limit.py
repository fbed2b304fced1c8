"""Tables for coordinator/core/rate_limit.py: token buckets per identity,
their retry hint, their bounded key map, and the flags' validation."""

from __future__ import annotations

import pytest

from coordinator.core.rate_limit import RateLimits, TokenBuckets


@pytest.mark.parametrize("rate,burst,takes,expect", [
    # (time of each take) -> None: granted, or the retry hint in seconds
    (1.0, 2, [0.0, 0.0, 0.0], [None, None, 1.0]),
    (1.0, 2, [0.0, 0.0, 0.5], [None, None, 0.5]),
    (1.0, 2, [0.0, 0.0, 1.0], [None, None, None]),
    (2.0, 1, [0.0, 0.1, 0.5, 0.5], [None, 0.4, None, 0.5]),
    # Saved tokens never exceed the burst, however long the quiet.
    (1.0, 2, [0.0, 0.0, 100.0, 100.0, 100.0], [None, None, None, None, 1.0]),
    # A refused take spends nothing: the hint shrinks as time passes.
    (1.0, 1, [0.0, 0.2, 0.4, 0.9, 1.0], [None, 0.8, 0.6, 0.1, None]),
])
def test_token_bucket(rate: float, burst: int, takes: list[float], expect: list[float | None]) -> None:
    b = TokenBuckets(rate, burst)
    got = [b.take("alice", t) for t in takes]
    assert [None if g is None else round(g, 6) for g in got] == expect


def test_identities_have_their_own_buckets() -> None:
    b = TokenBuckets(1.0, 1)
    assert b.take("alice", 0.0) is None
    assert b.take("alice", 0.0) is not None
    assert b.take("bob", 0.0) is None


def test_the_key_map_is_bounded_and_keeps_the_throttled() -> None:
    """Cycling through identities cannot grow the map past max_keys, and
    forgetting prefers buckets that are full again (they carry no state), so
    a throttled caller stays throttled."""
    b = TokenBuckets(1.0, 1, max_keys=3)
    assert b.take("hog", 0.0) is None
    for i in range(100):
        b.take(f"id-{i}", 0.0)
        assert len(b) <= 3
        assert b.take("hog", 0.0) is not None, "the throttled key was forgotten"


@pytest.mark.parametrize("limits,words", [
    (RateLimits(), None),
    (RateLimits(submit_per_s=0), "--submit-rate must be a positive number"),
    (RateLimits(submit_per_s=float("inf")), "--submit-rate"),
    (RateLimits(register_per_s=-1), "--register-rate"),
    (RateLimits(submit_burst=0), "--submit-burst must be a whole number of at least 1"),
    (RateLimits(register_burst=True), "--register-burst"),
    (RateLimits(token_read_per_s=0), "--token-read-rate must be a positive number"),
    (RateLimits(token_read_burst=0), "--token-read-burst must be a whole number of at least 1"),
])
def test_limits_are_validated(limits: RateLimits, words: str | None) -> None:
    errors = limits.errors()
    assert (errors == []) if words is None else any(words in e for e in errors), errors
