"""Every credential a run of ``phalanx up`` makes (the cluster's gRPC CA and
certificates, its etcd users), the client config the CLI and the SDK read,
and the one line that activates it in a new shell (docs/local-cluster.md,
Security and Ready)."""

from __future__ import annotations

import datetime
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

# Under the state dir: the cluster's gRPC CA and what it issued
# (pki/<cluster>/...), the etcd PKI of the etcd `up` starts (etcd-pki/), and
# the client config the CLI and the SDK read ($PHALANX_CONFIG).
PKI_DIR = "pki"
ETCD_PKI_DIR = "etcd-pki"
CLIENT_CONFIG = "config.yaml"
ADMIN_NAME = "up"  # the admin certificate's name: phalanx://<cluster>/admin/up


@dataclass(frozen=True)
class Credentials:
    """Every file a process of this run is started with (docs/local-cluster.md)."""

    server_dir: Path  # --tls-dir of every coordinator and agent process: ca.crt + their certs
    admin_dir: Path  # ca.crt client.crt client.key: up's own clients, and the client config's tls_dir
    etcd_coordinator: Path  # ca.crt client.crt client.key of phalanx-<cluster>-coordinator (agents get no etcd user)
    etcd_root: Path  # ... of root: provisions the roles (and reads the revision before any coordinator runs)


def make_credentials(
    state_dir: Path, cluster: str, coordinators: Mapping[str, str], nodes: Mapping[str, str], etcd_pki_dir: Path,
    *, now: datetime.datetime,
) -> Credentials:
    """The cluster's gRPC CA (kept with a kept state dir, else new), a
    certificate for every coordinator and simulated node (id -> its AZ: each
    certificate is bound to it) and an admin client certificate (issued
    afresh every run), and this cluster's etcd users from the etcd PKI in
    ``etcd_pki_dir`` (whose ``root/`` must exist)."""
    from phalanx import certs, etcd_pki

    base = state_dir / PKI_DIR / cluster
    ca_dir, server_dir, admin_dir = base / "ca", base / "servers", base / "admin"
    if not (ca_dir / certs.CA_CERT).is_file():
        certs.init_ca(ca_dir, cluster, now=now)
    for d in (server_dir, admin_dir):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.copyfile(ca_dir / certs.CA_CERT, d / certs.CA_CERT)
    # A coordinator certificate names the cluster's server name, which every
    # client verifies whatever address it dials (and the loopback names).
    for cid, az in coordinators.items():
        certs.issue(ca_dir, "coordinator", cid, az=az, now=now, out=certs.leaf_paths(server_dir, "coordinator", cid))
    for node, az in nodes.items():
        certs.issue(ca_dir, "agent", node, node=node, az=az, now=now, out=certs.leaf_paths(server_dir, "agent", node))
    certs.issue(ca_dir, "admin", ADMIN_NAME, now=now, out=(admin_dir / "client.crt", admin_dir / "client.key"))
    return Credentials(
        server_dir=server_dir,
        admin_dir=admin_dir,
        etcd_coordinator=etcd_pki.issue_client(etcd_pki_dir, etcd_pki.user_for(cluster, "coordinator"), now=now),
        etcd_root=etcd_pki_dir / etcd_pki.ROOT_USER,
    )


ACTIVATION_LINE = re.compile(r"^export PATH=\S+ PHALANX_CONFIG=\S+ PHALANX_STATE_DIR=\S+$")


def cli_bin_dir() -> Path | None:
    """The directory of the ``phalanx`` command that belongs to this Python
    (``.venv/bin`` after scripts/setup.sh), None when it has none."""
    bin_dir = Path(sys.executable).parent
    return bin_dir if (bin_dir / "phalanx").is_file() else None


def activation_line(bin_dir: Path | None, config: Path, state_dir: Path) -> str:
    """The one line a new shell needs for everything the README runs: this
    install's ``phalanx``, ``python3`` and ``python`` first on PATH (a fresh
    clone's are only in ``.venv/bin``), the client config and the state dir
    ``phalanx logs`` reads. Paths are shell-quoted."""
    path = f"{shlex.quote(str(bin_dir))}:\"$PATH\"" if bin_dir is not None else '"$PATH"'
    return (f"export PATH={path} PHALANX_CONFIG={shlex.quote(str(config))} "
            f"PHALANX_STATE_DIR={shlex.quote(str(state_dir))}")


def client_config(cluster: str, addresses: list[str], tls_dir: str | None) -> dict[str, Any]:
    """The kubeconfig-style file the CLI and the SDK read ($PHALANX_CONFIG):
    which cluster, where, and with which credentials (``tls_dir`` relative to
    the file, so the state dir can move; None: ``insecure: true``)."""
    doc: dict[str, Any] = {"cluster": cluster, "addresses": list(addresses)}
    if tls_dir is None:
        doc["insecure"] = True
    else:
        doc["tls_dir"] = tls_dir
    return doc


def write_client_config(path: Path, cluster: str, addresses: list[str], tls_dir: Path | None) -> None:
    rel = os.path.relpath(tls_dir, path.parent) if tls_dir is not None else None
    doc = client_config(cluster, addresses, rel)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(
        "# Written by phalanx up for its cluster; the CLI and the SDK read it through $PHALANX_CONFIG.\n"
        + yaml.safe_dump(doc, sort_keys=False)
    )
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
