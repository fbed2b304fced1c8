"""What ``phalanx up`` is asked to run: its flags validated together
(``UpConfig``), the security flags' combinations, the cluster name and the
etcd endpoints as the coordinators take them."""

from __future__ import annotations

import argparse
import os
import re
import string
from dataclasses import dataclass
from pathlib import Path

# The checkout `up` runs from: its children run `python -m coordinator` and
# `agent.sim` from it, the sample workload reads its examples/.
REPO_ROOT = Path(__file__).resolve().parents[2]

MAX_AZS = len(string.ascii_lowercase)
DEFAULT_CLUSTER_PREFIX = "local"

# The simulator's fabric when --spines / --leaves-per-spine are not given
# (agent.sim's own defaults).
SIM_SPINES = 1
SIM_LEAVES_PER_SPINE = 2


@dataclass(frozen=True)
class UpConfig:
    azs: tuple[str, ...]
    coordinators_per_az: int
    nodes_per_az: int
    spines: int | None
    leaves_per_spine: int | None
    etcd: str
    workload: bool
    launch: bool
    state_dir: str
    cluster: str
    base_port: int
    gangs_per_az: int
    start_timeout: float
    insecure: bool = False
    etcd_pki: str = ""
    log_format: str | None = None  # for the children (PHALANX_LOG_FORMAT); None: theirs

    @property
    def sim_spines(self) -> int:
        return self.spines if self.spines is not None else SIM_SPINES

    @property
    def sim_leaves_per_spine(self) -> int:
        return self.leaves_per_spine if self.leaves_per_spine is not None else SIM_LEAVES_PER_SPINE

    def node_names(self, az: str) -> list[str]:
        return sim_node_names(az, self.nodes_per_az, self.sim_spines, self.sim_leaves_per_spine)

    def coordinator_ids(self) -> list[str]:
        return list(self.coordinator_azs())

    def coordinator_azs(self) -> dict[str, str]:
        """Each coordinator id and the AZ it serves (its certificate's binding)."""
        return {f"{az}-c{j}": az for az in self.azs for j in range(self.coordinators_per_az)}

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "UpConfig":
        """Validate every flag together; ValueError names the first bad one."""
        if not 1 <= a.azs <= MAX_AZS:
            raise ValueError(f"--azs must be between 1 and {MAX_AZS}, got {a.azs}")
        for flag, value in (
            ("--coordinators-per-az", a.coordinators_per_az),
            ("--nodes-per-az", a.nodes_per_az),
            ("--gangs-per-az", a.gangs_per_az),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        for flag, value in (("--spines", a.spines), ("--leaves-per-spine", a.leaves_per_spine)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        count = a.azs * a.coordinators_per_az
        if a.base_port != 0 and not 1024 <= a.base_port <= 65535 - count:
            raise ValueError(f"--base-port must be 0 or between 1024 and {65535 - count}, got {a.base_port}")
        if a.cluster and not valid_cluster_name(a.cluster):
            raise ValueError(f"--cluster must be a DNS label (a-z, 0-9, '-', at most 63), got {a.cluster!r}")
        if not a.start_timeout > 0:
            raise ValueError(f"--start-timeout must be positive, got {a.start_timeout}")
        if a.etcd:
            from phalanx.store import parse_endpoints  # the coordinators' own parser: what they would refuse

            try:
                parse_endpoints(normalize_etcd(a.etcd))
            except ValueError as exc:
                raise ValueError(f"--etcd: {exc}") from None
        if a.state_dir and os.path.exists(a.state_dir) and not os.path.isdir(a.state_dir):
            raise ValueError(f"--state-dir: {a.state_dir} exists and is not a directory")
        problem = security_flags_error(bool(a.etcd), a.etcd_pki, a.insecure)
        if problem:
            raise ValueError(problem)
        if a.etcd_pki:
            problem = etcd_pki_dir_error(Path(a.etcd_pki))
            if problem:
                raise ValueError(f"--etcd-pki: {problem}")
        return cls(
            azs=tuple(f"az-{string.ascii_lowercase[i]}" for i in range(a.azs)),
            coordinators_per_az=a.coordinators_per_az,
            nodes_per_az=a.nodes_per_az,
            spines=a.spines,
            leaves_per_spine=a.leaves_per_spine,
            etcd=normalize_etcd(a.etcd),
            workload=not a.no_workload,
            launch=a.launch,
            state_dir=a.state_dir,
            cluster=a.cluster,
            base_port=a.base_port,
            gangs_per_az=a.gangs_per_az,
            start_timeout=a.start_timeout,
            insecure=a.insecure,
            etcd_pki=str(Path(a.etcd_pki).resolve()) if a.etcd_pki else "",
            log_format=getattr(a, "log_format", None),
        )


def security_flags_error(own_etcd_given: bool, etcd_pki: str, insecure: bool) -> str | None:
    """Why ``--etcd`` / ``--etcd-pki`` / ``--insecure`` do not go together
    (None: they do). An etcd of the user's own is reached with TLS and
    client certificates like the one ``up`` starts, so ``up`` needs that
    etcd's CA to issue this cluster's etcd users: ``--etcd-pki``."""
    if insecure and etcd_pki:
        return "--etcd-pki: not with --insecure (which reaches etcd in plaintext, without users)"
    if etcd_pki and not own_etcd_given:
        return "--etcd-pki: only with --etcd (without --etcd, up makes the etcd PKI of the etcd it starts)"
    if own_etcd_given and not etcd_pki and not insecure:
        return (
            "--etcd: needs --etcd-pki DIR (that etcd's PKI, from phalanx certs etcd-init, to issue this cluster's "
            "etcd users) or --insecure (an etcd without TLS and auth)"
        )
    return None


def etcd_pki_dir_error(directory: Path) -> str | None:
    """What ``--etcd-pki`` lacks: the CA, from which ``up`` issues this
    cluster's etcd users (and root's client files, to provision their
    roles, if the directory has none yet)."""
    missing = [str(p) for p in (directory / "ca.crt", directory / "ca.key") if not p.is_file()]
    if missing:
        return f"{directory}: missing {', '.join(missing)} (make the etcd PKI with phalanx certs etcd-init --dir {directory})"
    return None


def valid_cluster_name(name: str) -> bool:
    return len(name) <= 63 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name) is not None


def choose_cluster_name(given: str, remembered: str, token: str) -> str:
    """``--cluster`` if given, else the name a kept state dir remembers, else
    ``local-<token>``: two local clusters never share a name by accident (the
    CLI's default address could otherwise answer from the other one)."""
    if given:
        return given
    if remembered and valid_cluster_name(remembered):
        return remembered
    return f"{DEFAULT_CLUSTER_PREFIX}-{token}"


def normalize_etcd(value: str) -> str:
    """``http://h:p, h2:p2`` -> ``h:p,h2:p2`` (the coordinators want host:port)."""
    out = []
    for item in value.split(","):
        item = item.strip().rstrip("/")
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        if item:
            out.append(item)
    return ",".join(out)


def sim_node_names(az: str, nodes: int, spines: int, leaves_per_spine: int) -> list[str]:
    """The nodes ``python -m agent.sim`` simulates for these flags (its own
    topology function), so each gets an agent certificate for its node."""
    from phalanx.simulated_topology import simulated_fabric

    return [t.node for t in simulated_fabric(az, nodes, spines, leaves_per_spine)]
