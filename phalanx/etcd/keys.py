"""The key layout of docs/etcd-keys.md (``Keys``): everything under
``/phalanx/<cluster>/``, and ``prefix_end``, the range end of a prefix. Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """The key layout of docs/etcd-keys.md, in one place."""

    cluster: str

    @property
    def root(self) -> str:
        return f"/phalanx/{self.cluster}/"

    def leader(self, az: str) -> str:
        return f"{self.root}leader/{az}"

    def leaders(self) -> str:
        return f"{self.root}leader/"

    def node(self, az: str, node: str) -> str:
        return f"{self.root}nodes/{az}/{node}"

    def nodes(self, az: str = "") -> str:
        return f"{self.root}nodes/{az}/" if az else f"{self.root}nodes/"

    def gang(self, gang_id: str) -> str:
        return f"{self.root}gangs/{gang_id}"

    def gangs(self) -> str:
        return f"{self.root}gangs/"

    def reservation(self, az: str, gang_id: str) -> str:
        return f"{self.root}reservations/{az}/{gang_id}"

    def reservations(self, az: str = "") -> str:
        return f"{self.root}reservations/{az}/" if az else f"{self.root}reservations/"

    def decision(self, gang_id: str, incarnation: int) -> str:
        return f"{self.root}decisions/{gang_id}/{incarnation}"

    def decisions(self, gang_id: str = "") -> str:
        return f"{self.root}decisions/{gang_id}/" if gang_id else f"{self.root}decisions/"

    def member_summary(self, gang_id: str, az: str) -> str:
        """Per-AZ member status of a cross-AZ gang, written by that AZ's
        leader (the participant), watched by the owner."""
        return f"{self.root}members/{gang_id}/{az}"

    def member_summaries(self, gang_id: str = "") -> str:
        return f"{self.root}members/{gang_id}/" if gang_id else f"{self.root}members/"

    def idempotency(self, key: str) -> str:
        return f"{self.root}idempotency/{key}"

    def expired(self, gang_id: str = "") -> str:
        """What is left of a collected gang: its id, terminal state and owner,
        so GetGang can say "finished and expired" (docs/etcd-keys.md
        "Retention by count and bytes"); bounded in number."""
        return f"{self.root}expired/{gang_id}"

    def name(self, name: str) -> str:
        """Index of live gang names: a name is unique among live gangs."""
        return f"{self.root}names/{name}"

    def policy(self) -> str:
        """The GangService policy every coordinator applies (coordinator/policy_store.py)."""
        return f"{self.root}policy"


def prefix_end(prefix: str) -> bytes:
    """The range_end that selects every key starting with ``prefix``."""
    b = bytearray(prefix.encode())
    for i in reversed(range(len(b))):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"
