"""Rate limits per caller identity, applied at the edge of the coordinator
(the thin driver around coordinator/core/rate_limit.py; docs/limits.md
"Rate limits"). A refusal is ``ResourceExhausted`` naming the limit, the
identity and when to retry; nothing is read or written for it."""

from __future__ import annotations

import time
from typing import Any, Callable

from coordinator.core.rate_limit import (
    REGISTER_BURST_FLAG, REGISTER_RATE_FLAG, SUBMIT_BURST_FLAG, SUBMIT_RATE_FLAG, TOKEN_READ_BURST_FLAG,
    TOKEN_READ_RATE_FLAG, RateLimits, TokenBuckets,
)
from phalanx.errors import ResourceExhausted


class Throttled(ResourceExhausted):
    """Over a rate limit; ``retry_after_s`` is when a token is there again."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Throttle:
    def __init__(self, limits: RateLimits, metrics: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.metrics = metrics
        self.clock = clock
        self._submits = TokenBuckets(limits.submit_per_s, limits.submit_burst)
        self._registers = TokenBuckets(limits.register_per_s, limits.register_burst)
        self._token_reads = TokenBuckets(limits.token_read_per_s, limits.token_read_burst)

    def submission(self, who: str) -> None:
        """One SubmitGang from ``who`` (its owner string; "" in plaintext)."""
        wait = self._submits.take(who, self.clock())
        if wait is not None:
            self._refuse("submit", f"submissions from {who or 'unidentified callers'} are limited to "
                         f"{self.limits.submit_per_s:g}/s with a burst of {self.limits.submit_burst} "
                         f"({SUBMIT_RATE_FLAG}, {SUBMIT_BURST_FLAG})", wait)

    def registration(self, who: str) -> None:
        """One agent registration from ``who`` (its certificate's name, or
        the node it names in plaintext)."""
        wait = self._registers.take(who, self.clock())
        if wait is not None:
            self._refuse("register", f"registrations of {who} are limited to {self.limits.register_per_s:g}/s with "
                         f"a burst of {self.limits.register_burst} ({REGISTER_RATE_FLAG}, {REGISTER_BURST_FLAG})",
                         wait)

    def token_read(self, who: str) -> None:
        """One AgentService.ReadToken from ``who`` (its certificate's name,
        or the peer's address in plaintext)."""
        wait = self._token_reads.take(who, self.clock())
        if wait is not None:
            self._refuse("token_read", f"token reads of {who} are limited to {self.limits.token_read_per_s:g}/s "
                         f"with a burst of {self.limits.token_read_burst} ({TOKEN_READ_RATE_FLAG}, "
                         f"{TOKEN_READ_BURST_FLAG})", wait)

    def _refuse(self, kind: str, text: str, wait: float) -> None:
        if self.metrics is not None:
            self.metrics.throttled.labels(kind).inc()
        raise Throttled(f"rate limit: {text}; retry in {max(wait, 0.001):.3f} s", wait)
