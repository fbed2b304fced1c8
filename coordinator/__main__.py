"""`python -m coordinator` — run one coordinator replica.

Prints ``PHALANX_COORDINATOR_READY id=ID az=AZ address=HOST:PORT`` once the
gRPC server is serving (`` metrics=HOST:PORT`` appended with
``--metrics-listen``); SIGTERM/SIGINT shut down cleanly (resigning
leadership so a standby takes over at once, not after a TTL).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from coordinator.config import CoordinatorConfig
from coordinator.core.fanout import StreamLimits
from coordinator.core.rate_limit import RateLimits

from phalanx.limits import ETCD_DEFAULT_QUOTA_BYTES
from phalanx.process_flags import add_credential_flags, add_log_flags, missing_credentials
from phalanx.timings import ConfigError, timings_from_arg
from coordinator.core.authz import Policy, PolicyError, policy_from_yaml
from coordinator.server import Coordinator
from coordinator.tokens import TokenFileError, load_tokens
from phalanx import logfmt
from phalanx.errors import StoreDenied
from phalanx.tls import TlsError, TlsFiles, etcd_files
from phalanx.usage import OneLineParser


def parse_args(argv: list[str] | None = None) -> CoordinatorConfig:
    return parse_all(argv)[0]




def parse_all(argv: list[str] | None = None) -> tuple[CoordinatorConfig, TlsFiles | None]:
    """The validated config and the --tls-dir files (None: plaintext)."""
    config, tls, _, _ = parse_everything(argv)
    return config, tls


def parse_everything(argv: list[str] | None = None) -> tuple[CoordinatorConfig, TlsFiles | None, Policy | None, TlsFiles | None]:
    """The validated config, the --tls-dir files (None: plaintext), the
    --policy (None: the defaults) and the --etcd-tls-dir files (None:
    plaintext). Plaintext only with --insecure: ConfigError otherwise."""
    p = OneLineParser(prog="python -m coordinator", description=__doc__)
    p.add_argument("--cluster", default="local")
    p.add_argument("--az", required=True)
    p.add_argument("--id", required=True, help="coordinator id, unique in the cluster")
    p.add_argument("--etcd", required=True, help="etcd endpoints, host:port[,host:port]")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--advertise", default="")
    p.add_argument("--timings", default=os.environ.get("PHALANX_TIMINGS", ""),
                   help="JSON object of timing overrides, or 'fast' (validated together at start-up)")
    add_credential_flags(p, etcd_user="coordinator",
                         tls_help="serve only TLS with client certificates: DIR holds ca.crt and coordinator-ID.crt/.key "
                                  "(phalanx certs init/issue --role coordinator --name ID)")
    p.add_argument("--policy", default="",
                   help="YAML file of what GangService allows each role (max_priority per role; docs/security.md); "
                        "needs --tls-dir; validated at start-up")
    p.add_argument("--token-file", default="",
                   help="also take GangService calls with a bearer token: FILE holds 'sha256:<hex> <role> <name> "
                        "[queues=a,b]' lines (docs/security.md), re-read when it changes; needs --tls-dir and --token-listen")
    p.add_argument("--token-listen", default="",
                   help="HOST:PORT of the second TLS port, the one that takes bearer tokens (no client certificate asked)")
    p.add_argument("--metrics-listen", default="",
                   help="serve /metrics at HOST:PORT (127.0.0.1:0 picks a port; default off); with --tls-dir only "
                        "HTTPS with a client certificate of the cluster's CA (docs/metrics.md)")
    p.add_argument("--etcd-quota-bytes", type=int, default=ETCD_DEFAULT_QUOTA_BYTES,
                   help="etcd's --quota-backend-bytes (default etcd's, 2 GiB): etcd does not report it; metrics, "
                        "warnings and `phalanx status` measure its database against it (docs/etcd-keys.md)")
    p.add_argument("--etcd-compact-retention", type=float, default=0.0, metavar="SECONDS",
                   help="for an etcd you run without --auto-compaction-*: the AZ's leader compacts etcd's history to "
                        "what it saw this long ago (cluster-wide; default 0: off; docs/etcd-keys.md \"Compaction\")")
    p.add_argument("--max-finished-gangs", type=int, default=CoordinatorConfig.max_finished_gangs,
                   help="finished gangs this AZ keeps in etcd at most, oldest out first (docs/etcd-keys.md "
                        "\"Retention by count and bytes\")")
    p.add_argument("--max-finished-bytes", type=int, default=0,
                   help="bytes of finished gang records this AZ keeps in etcd at most (default: a 16th of "
                        "--etcd-quota-bytes)")
    p.add_argument("--max-expired-ids", type=int, default=CoordinatorConfig.max_expired_ids,
                   help="ids of collected gangs kept so that `get` says 'finished and expired' (cluster-wide; "
                        "0: none)")
    w = StreamLimits()
    p.add_argument("--watch-streams-per-identity", type=int, default=w.per_identity,
                   help="WatchEvents/WatchGang streams one identity may hold open here (docs/limits.md)")
    p.add_argument("--watch-streams-total", type=int, default=w.total,
                   help="WatchEvents/WatchGang streams open here in all")
    p.add_argument("--watch-buffer", type=int, default=w.buffer,
                   help="changes buffered per stream; a reader that falls further behind is dropped")
    p.add_argument("--watch-history", type=int, default=w.history,
                   help="recent changes kept so that a reopened WatchEvents stream resumes")
    r = RateLimits()
    p.add_argument("--submit-rate", type=float, default=r.submit_per_s,
                   help="SubmitGang calls per second one identity may make here (token bucket; docs/limits.md)")
    p.add_argument("--submit-burst", type=int, default=r.submit_burst, help="... saved up at most")
    p.add_argument("--register-rate", type=float, default=r.register_per_s,
                   help="agent registrations per second one node identity may make here")
    p.add_argument("--register-burst", type=int, default=r.register_burst, help="... saved up at most")
    p.add_argument("--token-read-rate", type=float, default=r.token_read_per_s,
                   help="AgentService.ReadToken calls per second one node identity may make here (an agent's "
                        "leader lookups and token checks)")
    p.add_argument("--token-read-burst", type=int, default=r.token_read_burst, help="... saved up at most")
    p.add_argument("--check-book", action="store_true",
                   help="the leader checks its book after each admission cycle and logs each inconsistency at "
                        "ERROR (tests and chaos runs; docs/book.md \"Checking a running leader\")")
    add_log_flags(p)
    a = p.parse_args(argv)
    logfmt.configure(a.log_level, a.log_format, "coordinator", static={"id": a.id, "az": a.az}, name=a.id)
    timings = timings_from_arg(a.timings)
    config = CoordinatorConfig(
        cluster=a.cluster, az=a.az, coordinator_id=a.id, etcd=tuple(e for e in a.etcd.split(",") if e),
        listen=a.listen, advertise=a.advertise, timings=timings,
        token_file=a.token_file, token_listen=a.token_listen, policy_file=a.policy, metrics_listen=a.metrics_listen,
        etcd_quota_bytes=a.etcd_quota_bytes, etcd_compact_retention_s=a.etcd_compact_retention,
        max_finished_gangs=a.max_finished_gangs, max_finished_bytes=a.max_finished_bytes,
        max_expired_ids=a.max_expired_ids,
        watch=StreamLimits(a.watch_streams_per_identity, a.watch_streams_total, a.watch_buffer, a.watch_history),
        rates=RateLimits(a.submit_rate, a.submit_burst, a.register_rate, a.register_burst, a.token_read_rate,
                         a.token_read_burst),
        check_book=a.check_book,
    ).validate()
    missing = missing_credentials(a, plaintext="serve plaintext")
    if missing:
        raise ConfigError(missing)
    tls = TlsFiles.issued(a.tls_dir, "coordinator", a.id) if a.tls_dir else None
    try:
        etcd_tls = etcd_files(a.etcd_tls_dir) if a.etcd_tls_dir else None
    except TlsError as exc:
        raise ConfigError(f"--etcd-tls-dir: {exc}") from None
    policy = None
    if a.policy:
        if tls is None:
            # Without TLS no caller has an identity, so a policy would be
            # silently ignored: refuse it instead.
            raise ConfigError("--policy: needs --tls-dir (without TLS callers have no identity and nothing is enforced)")
        try:
            text = Path(a.policy).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--policy: {a.policy}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            policy = policy_from_yaml(text, a.policy)
        except PolicyError as exc:
            raise ConfigError(f"--policy: {exc}") from None
    if a.token_file:
        if tls is None:
            raise ConfigError("--token-file: needs --tls-dir (a bearer token is never taken in plaintext)")
        try:
            load_tokens(Path(a.token_file), cluster=a.cluster)  # checked now: a bad file stops the start
        except TokenFileError as exc:
            raise ConfigError(f"--token-file: {exc}") from None
    return config, tls, policy, etcd_tls


async def amain(config: CoordinatorConfig, tls: TlsFiles | None = None, policy: Policy | None = None,
                etcd_tls: TlsFiles | None = None) -> int:
    coord = Coordinator(config, tls=tls, policy=policy, etcd_tls=etcd_tls)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, coord.stop)
    try:
        address = await coord.start()
    except TlsError as exc:  # the --tls-dir or --etcd-tls-dir files: which file, which check
        await coord.close()
        flag = "--etcd-tls-dir" if etcd_tls is not None and exc.path in map(str, etcd_tls.paths()) else "--tls-dir"
        print(f"error: {flag}: {exc}", file=sys.stderr)
        return 2
    except StoreDenied as exc:  # the etcd user of --etcd-tls-dir may not do this: not transient
        await coord.close()
        print(f"error: --etcd-tls-dir: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --listen names a host that does not resolve, or a port that is taken
        await coord.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    # metrics= after address=: readers that split on "address=" take the first word after it.
    metrics = f" metrics={coord.metrics_address}" if coord.metrics_address else ""
    print(f"PHALANX_COORDINATOR_READY id={config.coordinator_id} az={config.az} address={address}{metrics}", flush=True)
    try:
        await coord.run()
    except StoreDenied as exc:  # e.g. an agent's etcd user: it cannot campaign, retrying changes nothing
        print(f"error: --etcd-tls-dir: {exc}", file=sys.stderr)
        return 2
    finally:
        await coord.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        config, tls, policy, etcd_tls = parse_everything(argv)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(amain(config, tls, policy, etcd_tls))


if __name__ == "__main__":
    sys.exit(main())
