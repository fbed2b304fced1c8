"""The command-line flags every Phalanx process takes alike: its
credentials (``--tls-dir``, ``--etcd-tls-dir``, ``--insecure``) and its logs
(``--log-level``, ``--log-format``), with the one-line error for a missing
credential. One definition, so the coordinator, the agent and the simulated
agents cannot drift apart in what they require or how they say it."""

from __future__ import annotations

import argparse
import os

from phalanx import logfmt

ETCD_TLS_HELP = ("reach etcd over TLS as this cluster's {user} user: DIR holds ca.crt, client.crt and client.key "
                 "(phalanx certs etcd-user); required unless --insecure")


def add_credential_flags(p: argparse.ArgumentParser, *, tls_help: str, etcd_user: str) -> None:
    """``tls_help``: what --tls-dir holds for this process; ``etcd_user``:
    whose etcd user --etcd-tls-dir holds (coordinator, agent)."""
    p.add_argument("--tls-dir", default="", help=tls_help + "; required unless --insecure")
    p.add_argument("--etcd-tls-dir", default="", help=ETCD_TLS_HELP.format(user=etcd_user))
    p.add_argument("--insecure", action="store_true",
                   help="allow plaintext where --tls-dir / --etcd-tls-dir is not given (each logs a warning)")


def add_log_flags(p: argparse.ArgumentParser, *, level: str = "INFO") -> None:
    p.add_argument("--log-level", default=os.environ.get("PHALANX_LOG_LEVEL", level))
    p.add_argument("--log-format", default=os.environ.get("PHALANX_LOG_FORMAT", "text"), choices=logfmt.FORMATS,
                   help="text, or json: one JSON object per line with az, epoch, gang, stimulus... (docs/logging.md)")


def missing_credentials(a: argparse.Namespace, *, plaintext: str) -> str | None:
    """The error for a credential flag left out without --insecure, or None.
    ``plaintext``: what --insecure would do instead ("serve plaintext",
    "connect in plaintext")."""
    if a.insecure:
        return None
    if not a.tls_dir:
        return f"--tls-dir: required (pass --insecure to {plaintext})"
    if not a.etcd_tls_dir:
        return "--etcd-tls-dir: required (pass --insecure to reach etcd in plaintext)"
    return None
