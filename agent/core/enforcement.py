"""The agent's own safety rules, pure (docs/agents.md). No I/O, no clock: ``now``
is passed in.

- ``EpochGuard``: reject anything stamped with an epoch older than the highest
  seen. Epochs are etcd create_revisions of leader keys, so they only grow.
- ``DeviceLedger``: refuse an assignment that overlaps devices held by another
  live member, whatever the sender says.
- ``FenceTimer``: if no valid leader was heard for ``fence_after_s``, the agent
  must stop all members (self-fencing).
- ``Arrivals``: assignments received but not yet started or refused; a
  revocation of their incarnation that comes meanwhile (it found nothing
  running to stop) refuses them, so a cancel that races the start is final
  here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass
class EpochGuard:
    highest: int = 0

    def accept(self, epoch: int) -> bool:
        """True if a message with ``epoch`` may be acted on (and remember it)."""
        if epoch < self.highest:
            return False
        self.highest = epoch
        return True


@dataclass
class DeviceLedger(Generic[K]):
    held: dict[K, tuple[frozenset[int], frozenset[str]]] = field(default_factory=dict)

    def conflicts(self, key: K, gpus: tuple[int, ...], nics: tuple[str, ...]) -> list[str]:
        """Why ``key`` may not take these devices (empty list: it may)."""
        out = []
        if len(set(gpus)) != len(gpus):
            out.append(f"duplicate GPUs in assignment {sorted(gpus)}")
        for other, (g, n) in self.held.items():
            if other == key:
                continue
            both_g = g & set(gpus)
            both_n = n & set(nics)
            if both_g:
                out.append(f"GPUs {sorted(both_g)} held by {other}")
            if both_n:
                out.append(f"NICs {sorted(both_n)} held by {other}")
        return out

    def hold(self, key: K, gpus: tuple[int, ...], nics: tuple[str, ...]) -> None:
        self.held[key] = (frozenset(gpus), frozenset(nics))

    def release(self, key: K) -> None:
        self.held.pop(key, None)

    def check(self) -> list[str]:
        """Invariant: no device held twice (used by tests and the chaos checker)."""
        seen_g: dict[int, K] = {}
        out = []
        for key, (gpus, _) in self.held.items():
            for g in gpus:
                if g in seen_g:
                    out.append(f"GPU {g} held by {seen_g[g]} and {key}")
                seen_g[g] = key
        return out


@dataclass
class FenceTimer:
    fence_after_s: float
    last_valid: float  # monotonic time a valid leader was last heard

    def heard(self, now: float) -> None:
        self.last_valid = max(self.last_valid, now)

    def overdue(self, now: float) -> bool:
        return now - self.last_valid > self.fence_after_s

    def deadline(self) -> float:
        return self.last_valid + self.fence_after_s


@dataclass
class Arrivals:
    """Assignments between their arrival and their start (or refusal):
    (gang, incarnation, rank) -> revoked meanwhile. The session notes an
    assignment as it reads it off the stream, before its token check and
    its turn at the lock; a revocation read after it (the leader sends them
    in that order) marks it, and the assignment is then refused instead of
    started: a leader that tore the incarnation down has sent its one
    revocation already, and a member started after it would run unseen."""

    pending: dict[tuple[str, int, int], bool] = field(default_factory=dict)

    def arrive(self, gang: str, incarnation: int, rank: int) -> None:
        self.pending.setdefault((gang, incarnation, rank), False)

    def revoke(self, gang: str, incarnation: int) -> int:
        """Mark every pending assignment of this incarnation; how many."""
        hit = [k for k in self.pending if k[0] == gang and k[1] == incarnation]
        for k in hit:
            self.pending[k] = True
        return len(hit)

    def revoked(self, gang: str, incarnation: int, rank: int) -> bool:
        return self.pending.get((gang, incarnation, rank), False)

    def done(self, gang: str, incarnation: int, rank: int) -> None:
        self.pending.pop((gang, incarnation, rank), None)
