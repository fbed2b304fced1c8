"""Rate limits per caller identity: submissions, agent registrations and
agents' token reads (docs/limits.md "Rate limits"). Pure: ``now`` is passed in.

A token bucket per key (the caller's identity, or the node name for a
plaintext agent): ``rate`` tokens a second, at most ``burst`` saved up; a
request takes one token or is refused with the seconds until one is there
(the retry hint the caller is given). The number of keys is bounded: when
``max_keys`` is reached, the bucket that has been full the longest is
forgotten (a full bucket carries no state: a new one is full too), so a
caller cycling through identities cannot grow the map.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

SUBMIT_RATE_FLAG = "--submit-rate"
SUBMIT_BURST_FLAG = "--submit-burst"
REGISTER_RATE_FLAG = "--register-rate"
REGISTER_BURST_FLAG = "--register-burst"
TOKEN_READ_RATE_FLAG = "--token-read-rate"
TOKEN_READ_BURST_FLAG = "--token-read-burst"


@dataclass(frozen=True)
class RateLimits:
    """Per identity: submissions (SubmitGang), agent registrations
    (AgentService.Session) and token reads (AgentService.ReadToken, one per
    member start and one per leader lookup). Defaults in docs/limits.md: far
    above what one submitter or agent needs (bench/admission.py offers 150
    gangs/s from one identity; an agent registers once per leader change and
    starts at most one member per GPU per assignment), far below a flood."""

    submit_per_s: float = 200.0
    submit_burst: int = 400
    register_per_s: float = 1.0
    register_burst: int = 10
    token_read_per_s: float = 50.0
    token_read_burst: int = 500

    def errors(self) -> list[str]:
        out = []
        for name, flag in (("submit_per_s", SUBMIT_RATE_FLAG), ("register_per_s", REGISTER_RATE_FLAG),
                           ("token_read_per_s", TOKEN_READ_RATE_FLAG)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                out.append(f"{flag} must be a positive number (per second), got {v!r}")
        for name, flag in (("submit_burst", SUBMIT_BURST_FLAG), ("register_burst", REGISTER_BURST_FLAG),
                           ("token_read_burst", TOKEN_READ_BURST_FLAG)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                out.append(f"{flag} must be a whole number of at least 1, got {v!r}")
        return out


class TokenBuckets:
    """One token bucket per key."""

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        # key -> (tokens, at): tokens as of ``at``; oldest-touched first.
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def _tokens(self, key: str, now: float) -> float:
        tokens, at = self._buckets.get(key, (float(self.burst), now))
        return min(float(self.burst), tokens + max(0.0, now - at) * self.rate)

    def take(self, key: str, now: float) -> float | None:
        """Take a token for ``key``: None when granted, else the seconds
        until the next token (> 0)."""
        tokens = self._tokens(key, now)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            self._buckets.move_to_end(key)
            return (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens - 1.0, now)
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_keys:
            self._forget_one(now)
        return None

    def _forget_one(self, now: float) -> None:
        """Drop the least recently used bucket that is full again; if none is
        (every key is throttled now), the least recently used one: that key
        is then forgiven its debt, which costs at most one burst."""
        for key in self._buckets:
            if self._tokens(key, now) >= self.burst:
                del self._buckets[key]
                return
        self._buckets.popitem(last=False)
