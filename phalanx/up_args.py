"""``phalanx up``'s flags, apart from phalanx/up.py so that the CLI's parser
(``--help``, ``--version``, a usage error) is built without importing what
``up`` runs on (gRPC, the client, etcd helpers)."""

from __future__ import annotations

import argparse
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--azs", type=int, default=3, help="number of AZs (az-a, az-b, ...), default 3")
    p.add_argument("--coordinators-per-az", type=int, default=2, help="coordinator replicas per AZ, default 2")
    p.add_argument("--nodes-per-az", type=int, default=8, help="simulated nodes per AZ, default 8")
    p.add_argument("--spines", type=int, default=None, help="spines per AZ (default: the simulator's)")
    p.add_argument("--leaves-per-spine", type=int, default=None, help="leaves per spine (default: the simulator's)")
    p.add_argument("--etcd", default="", help="use this etcd (host:port[,...]) instead of starting one")
    p.add_argument(
        "--etcd-pki", default="",
        help="with --etcd: its PKI directory (phalanx certs etcd-init: ca.crt, ca.key), from which up issues "
        "this cluster's etcd users (and root's, if missing) and provisions their roles",
    )
    p.add_argument(
        "--insecure", action="store_true",
        help="plaintext everywhere: gRPC without TLS, etcd without TLS or auth (warns; for debugging only)",
    )
    p.add_argument("--no-workload", action="store_true", help="start the cluster only")
    p.add_argument("--launch", action="store_true", help="agents launch members as real processes")
    p.add_argument("--state-dir", default="", help="keep etcd data and logs here (default: a temp dir, removed on exit)")
    p.add_argument(
        "--cluster", default="",
        help="cluster name (etcd key prefix); default: the one a kept --state-dir remembers, else local-<random>",
    )
    p.add_argument(
        "--base-port", type=int, default=7070,
        help="first coordinator port (then +1, ...; a taken port is replaced by a free one, with a warning); "
        "0: free ports only",
    )
    p.add_argument("--gangs-per-az", type=int, default=3, help="workload: live gangs kept per AZ, default 3")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds to wait for the cluster to come up")
    p.add_argument("--log-format", choices=("text", "json"), default=os.environ.get("PHALANX_LOG_FORMAT") or None,
                   help="the log format of every process up starts (docs/logging.md; default: $PHALANX_LOG_FORMAT, "
                        "else text)")
