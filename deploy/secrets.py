"""The Kubernetes Secrets the manifests mount, from the files ``phalanx certs``
wrote (deploy/README.md "Certificates")::

    python deploy/secrets.py --pki PKI --etcd-pki ETCD_PKI --cluster prod > secrets.yaml
    kubectl apply -f secrets.yaml

``PKI`` is the cluster's gRPC CA directory (``phalanx certs init`` /
``issue``): its ``ca.crt`` and every ``coordinator-*`` and ``agent-*``
certificate with its key. ``ETCD_PKI`` is the etcd PKI (``phalanx certs
etcd-init`` / ``etcd-user``): the client directories of the cluster's
coordinator etcd user and of root (agents get no etcd user: they read
through the coordinators). No CA key ever goes into a Secret. A missing file is
one ``error:`` line naming it and the command that makes it, exit 2, and
nothing is written.

Secret data holds the files' bytes, base64-encoded, under their file names:
exactly the names the processes read from the mounted directories.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from phalanx import etcd_pki

COORDINATOR_TLS = "phalanx-coordinator-tls"  # ca.crt + coordinator-<pod>.crt/.key, all AZs
AGENT_TLS = "phalanx-agent-tls"  # ca.crt + agent-<node>.crt/.key, every GPU node
ETCD_COORDINATOR = "phalanx-etcd-coordinator"  # ca.crt client.crt client.key
ETCD_ROOT = "phalanx-etcd-root"  # for the Job phalanx-etcd-auth only
CLIENT_FILES = ("ca.crt", "client.crt", "client.key")


class SecretsError(ValueError):
    pass


def secret_object(name: str, files: dict[str, bytes], namespace: str) -> dict[str, Any]:
    """One Opaque Secret holding ``files`` (file name -> bytes)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "phalanx"}},
        "type": "Opaque",
        "data": {k: base64.b64encode(v).decode() for k, v in sorted(files.items())},
    }


def _read(path: Path, how: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SecretsError(f"{path}: {exc.strerror or exc} ({how})") from None


def leaf_files(pki: Path, role: str) -> dict[str, bytes]:
    """``ca.crt`` and every ``<role>-*.crt`` of ``pki`` with its key."""
    out = {"ca.crt": _read(pki / "ca.crt", f"make it with phalanx certs init --dir {pki}")}
    certs = sorted(pki.glob(f"{role}-*.crt"))
    if not certs:
        raise SecretsError(
            f"--pki {pki}: no {role}-*.crt (issue one per {'coordinator pod' if role == 'coordinator' else 'GPU node'} "
            f"with phalanx certs issue --dir {pki} --role {role} ...)"
        )
    for crt in certs:
        key = crt.with_suffix(".key")
        out[crt.name] = _read(crt, "")
        out[key.name] = _read(key, f"the key of {crt.name}: issue it again")
    return out


def client_dir_files(directory: Path, how: str) -> dict[str, bytes]:
    return {name: _read(directory / name, how) for name in CLIENT_FILES}


def collect(pki: Path, etcd: Path, cluster: str) -> dict[str, dict[str, bytes]]:
    """Secret name -> its files, read from the two PKI directories."""
    out = {COORDINATOR_TLS: leaf_files(pki, "coordinator"), AGENT_TLS: leaf_files(pki, "agent")}
    for secret, user in (
        (ETCD_COORDINATOR, etcd_pki.user_for(cluster, "coordinator")),
        (ETCD_ROOT, etcd_pki.ROOT_USER),
    ):
        how = f"make it with phalanx certs etcd-user --dir {etcd} --user {user}"
        out[secret] = client_dir_files(etcd / user, how)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deploy/secrets.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--pki", required=True, help="the gRPC CA directory (phalanx certs init/issue)")
    p.add_argument("--etcd-pki", required=True, help="the etcd PKI directory (phalanx certs etcd-init/etcd-user)")
    p.add_argument("--cluster", required=True, help="the cluster name (ConfigMap phalanx-etcd, key cluster)")
    p.add_argument("--namespace", default="phalanx")
    p.add_argument("--out", default="-", help="file to write (default: stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        secrets = collect(Path(a.pki), Path(a.etcd_pki), a.cluster)
        text = yaml.safe_dump_all([secret_object(n, f, a.namespace) for n, f in secrets.items()], sort_keys=False)
    except (SecretsError, ValueError) as exc:  # ValueError: a cluster name etcd_pki refuses
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.out == "-":
        sys.stdout.write(text)
    else:
        # Private keys: never readable by others, not even for a moment.
        fd = os.open(a.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
