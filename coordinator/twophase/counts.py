"""Per-gang counts of the etcd requests the two-phase protocol makes
(docs/two-phase.md "Peer calls"; bench/admission.py reads the line)."""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)


class RequestCounts:
    """gang -> etcd requests made for it, and how many of those were a peer
    call's check read because the watch did not show the attempt or the
    decision yet (a lagging watch). ``auth_taken(gang)`` takes the servicer's
    TLS reads counted for the gang (PeerCalls.auth_reads)."""

    def __init__(self, az: str, auth_taken: Callable[[str], int]):
        self.az = az
        self.auth_taken = auth_taken
        self.etcd_requests: dict[str, int] = {}
        self.check_reads: dict[str, int] = {}

    def count(self, gang: str, n: int = 1, check: bool = False) -> None:
        """Count ``n`` etcd requests made for ``gang``; ``check``: a peer
        call's check read, taken because the watch was behind."""
        self.etcd_requests[gang] = self.etcd_requests.get(gang, 0) + n
        if check:
            self.check_reads[gang] = self.check_reads.get(gang, 0) + n

    def report(self, gang: str, inc: int, role: str) -> None:
        """Log the gang's counts (its attempt is reserved or dispatched) and start over."""
        n = self.etcd_requests.pop(gang, 0)
        checks = self.check_reads.pop(gang, 0)
        auth = self.auth_taken(gang)
        log.info("two-phase etcd-requests gang=%s inc=%d az=%s role=%s n=%d check_reads=%d auth_reads=%d",
                 gang, inc, self.az, role, n, checks, auth)

    def forget(self, gang: str) -> None:
        self.etcd_requests.pop(gang, None)
        self.check_reads.pop(gang, None)
        self.auth_taken(gang)
