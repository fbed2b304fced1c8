"""What start-up waits for and how it fails: a leader elected in this run
in every AZ (docs/local-cluster.md, Ready)."""

from __future__ import annotations

from dataclasses import dataclass


class StartupFailed(Exception):
    pass


@dataclass(frozen=True)
class LeaderSeen:
    """One AZ's leader as ClusterStatus reports it."""

    az: str
    leader_id: str
    address: str
    epoch: int


def leaders_of_this_run(
    seen: list[LeaderSeen], azs: tuple[str, ...], baseline_revision: int, addresses: set[str]
) -> tuple[set[str], dict[str, LeaderSeen]]:
    """(AZs whose leader was elected in this run, AZs whose leader key is an
    older one). A leader of this run is one of this run's coordinators
    (its address) whose key was created after ``baseline_revision``, the
    etcd revision read before any of them started: a leader key of an
    earlier run on the same etcd (a kept --state-dir, an --etcd shared
    across runs) carries the same ids and, with fixed ports, the same
    addresses, but never a newer epoch (an epoch is the key's create
    revision)."""
    ours: set[str] = set()
    stale: dict[str, LeaderSeen] = {}
    for s in seen:
        if s.az not in azs:
            continue
        if s.epoch > baseline_revision and s.address in addresses:
            ours.add(s.az)
        else:
            stale[s.az] = s
    return ours, stale
