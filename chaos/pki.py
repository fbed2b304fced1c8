"""The certificates of one chaos run (or one benchmark run): a gRPC CA for the
Phalanx cluster and a separate etcd CA, both in the run's own state dir.

::

    <root>/grpc/   ca.crt ca.key coordinator-<id>.* agent-<node>.*   (--tls-dir of every process)
    <root>/clients/<name>/   ca.crt client.crt client.key           (workload, probe: admin)
    <etcd>/        ca.* server.*  (every member: clients and peers)  + one dir per etcd user:
    <etcd>/root/  <etcd>/phalanx-<cluster>-coordinator/
    (no agent etcd user: agents read through their AZ's coordinators)

(``<etcd>`` is ``<root>/etcd`` or the etcd CA dir given to :meth:`RunPki.create`.)

Coordinator certificates name no host: every client verifies the cluster's
coordinator name instead (``phalanx.tls.coordinator_channel``), so the
namespace addresses, and the proxies in front of them, need no ``--hosts``.
The etcd server certificate names every member's address: members verify
each other's peer certificates against the address they dial.

Everything is made once, up front, and lives and dies with the run's state
dir (the caller removes it).
"""

from __future__ import annotations

import datetime
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from phalanx import certs, etcd_pki
from phalanx.client import TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE
from phalanx.tls import TlsFiles, utc_now

COORDINATOR = "coordinator"
AGENT = "agent"


@dataclass(frozen=True)
class RunPki:
    root: Path
    cluster: str
    etcd_dir: Path

    @property
    def grpc_dir(self) -> Path:
        return self.root / "grpc"

    @classmethod
    def create(cls, root: Path, cluster: str, *, etcd_dir: Path | None = None, etcd_hosts: Sequence[str] = (),
               now: datetime.datetime | None = None) -> "RunPki":
        """The gRPC CA of ``cluster`` and its etcd users (coordinator and
        root; agents get none), in the etcd CA of ``etcd_dir`` (an ``etcd_pki.init``
        directory, e.g. the one chaos.etcd_cluster made for its members) or
        of a new one in ``<root>/etcd`` naming ``etcd_hosts``."""
        now = now or utc_now()
        pki = cls(Path(root), cluster, Path(etcd_dir) if etcd_dir else Path(root) / "etcd")
        certs.init_ca(pki.grpc_dir, cluster, now=now)
        if etcd_dir is None:
            etcd_pki.init(pki.etcd_dir, hosts=tuple(etcd_hosts), now=now)
        for user in (etcd_pki.ROOT_USER, etcd_pki.user_for(cluster, COORDINATOR)):
            if not (pki.etcd_dir / user).is_dir():
                etcd_pki.issue_client(pki.etcd_dir, user, now=now)
        return pki

    def coordinator(self, cid: str, az: str | None = None) -> Path:
        """Issue coordinator ``cid``'s certificate (bound to ``az``); the dir for its --tls-dir."""
        certs.issue(self.grpc_dir, "coordinator", cid, az=az, now=utc_now(), hosts=())
        return self.grpc_dir

    def agents(self, nodes: Sequence[str], az: str | None = None) -> Path:
        """Issue one agent certificate per node (bound to it and to ``az``); the dir for --tls-dir."""
        now = utc_now()
        for node in nodes:
            certs.issue(self.grpc_dir, "agent", node, node=node, az=az, now=now)
        return self.grpc_dir

    def client(self, name: str, role: str = "admin") -> Path:
        """A client dir (ca.crt client.crt client.key) for ``role``/``name``."""
        d = self.root / "clients" / name
        d.mkdir(parents=True, exist_ok=True)
        certs.issue(self.grpc_dir, role, name, now=utc_now(), out=(d / TLS_CERT_FILE, d / TLS_KEY_FILE))
        shutil.copyfile(self.grpc_dir / certs.CA_CERT, d / TLS_CA_FILE)
        return d

    def etcd_user_dir(self, role: str) -> Path:
        """The --etcd-tls-dir of a coordinator ("coordinator"; agents have none)."""
        return self.etcd_dir / etcd_pki.user_for(self.cluster, role)

    @property
    def etcd_root_dir(self) -> Path:
        return self.etcd_dir / etcd_pki.ROOT_USER

    @property
    def etcd_root(self) -> TlsFiles:
        return etcd_pki.files(self.etcd_root_dir)
