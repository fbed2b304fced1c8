"""The ``phalanx`` commands that work on local files and contact no
coordinator: ``logs`` (members' output under an agents' state dir, ``-f``
to follow it), ``certs`` (a cluster's CA and certificates, etcd's PKI) and
``etcd-auth`` (etcd's users and roles, as its root user)."""

from __future__ import annotations

import argparse
import codecs
import datetime
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from phalanx.cli.common import EXIT_ERROR, EXIT_OK, STATE_DIR_ENV, UsageError, print_line


def log_roots(state_dir: Path, gang: str, depth: int = 3) -> list[Path]:
    """Agent state dirs under ``state_dir`` that hold logs of ``gang``.

    ``phalanx up --launch`` gives each AZ's agents process its own dir under
    one parent, and a simulator may keep one dir per node below that, so look
    a few levels down rather than make the user find the right one."""
    found: list[Path] = []
    level = [state_dir]
    for _ in range(depth + 1):
        nxt: list[Path] = []
        for d in level:
            if (d / "logs" / gang).is_dir():
                found.append(d)
            try:
                nxt.extend(sorted(p for p in d.iterdir() if p.is_dir() and p.name != "logs"))
            except OSError:
                pass
        level = nxt
    return found


def resolve_log_gang(state_dir: Path, gang: str) -> str:
    """A gang id as given, or for a gang *name* the id (``<name>-<8 hex>``) of
    the most recently written gang of that name, like ``phalanx get NAME``."""
    if "/" in gang or log_roots(state_dir, gang):
        return gang
    candidates: dict[str, float] = {}
    pattern = re.compile(rf"^{re.escape(gang)}-[0-9a-f]{{8}}$")
    level = [state_dir]
    for _ in range(4):
        nxt: list[Path] = []
        for d in level:
            logs = d / "logs"
            if logs.is_dir():
                for entry in logs.iterdir():
                    if pattern.match(entry.name):
                        candidates[entry.name] = max(candidates.get(entry.name, 0.0), entry.stat().st_mtime)
            try:
                nxt.extend(p for p in d.iterdir() if p.is_dir() and p.name != "logs")
            except OSError:
                pass
        level = nxt
    return max(candidates, key=lambda k: candidates[k]) if candidates else gang


# How often `logs -f` looks for new output (a person watching, like tail -f).
FOLLOW_POLL_S = 0.25
# A member whose exit record exists but whose log got no end mark (its agent
# died before writing it) is done once its log stopped growing this long.
FOLLOW_SETTLE_S = 2.0


def cmd_logs(args: argparse.Namespace) -> int:
    state_dir = args.state_dir or os.environ.get(STATE_DIR_ENV, "")
    if not state_dir:
        raise UsageError(f"logs needs --state-dir or {STATE_DIR_ENV} (the agents' --state-dir)")
    if not Path(state_dir).is_dir():
        raise UsageError(f"--state-dir: {state_dir} is not a directory")
    # Imported here: no other command reads member logs.
    from phalanx.member_logs import read_log

    gang = resolve_log_gang(Path(state_dir), args.gang)

    def find(incarnation: int | None) -> list[tuple[Any, Path]]:
        try:
            found = [f for root in log_roots(Path(state_dir), gang) for f in read_log(root, gang, incarnation=incarnation, rank=args.rank)]
        except ValueError as exc:  # an unsafe gang name for a path
            raise UsageError(str(exc)) from None
        return sorted(found, key=lambda kp: (kp[0].incarnation, kp[0].rank))

    files = find(args.incarnation)
    if not files:
        what = f"gang {args.gang}" + (f" rank {args.rank}" if args.rank is not None else "")
        what += f" incarnation {args.incarnation}" if args.incarnation is not None else ""
        raise UsageError(f"no logs for {what} under {state_dir}")
    # Default to the latest incarnation: earlier ones are history.
    incarnation = max(key.incarnation for key, _ in files) if args.incarnation is None else args.incarnation
    files = [(k, p) for k, p in files if k.incarnation == incarnation]
    if args.follow:
        return follow_logs(lambda: find(incarnation))
    for i, (key, path) in enumerate(files):
        if len(files) > 1:
            sys.stdout.write(("\n" if i else "") + f"==> {key} ({path}) <==\n")
        try:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 16), b""):
                    sys.stdout.write(chunk.decode("utf-8", "replace"))
        except OSError as exc:
            print_line(f"error: cannot read {path}: {exc.strerror or exc}", sys.stderr)
    sys.stdout.flush()
    return EXIT_OK


def cmd_certs(args: argparse.Namespace) -> int:
    """``phalanx certs init|issue``: the files only (phalanx.certs)."""
    from phalanx import certs  # local: cryptography is needed only here

    if args.certs_command in ("etcd-init", "etcd-user"):
        return cmd_certs_etcd(args)
    now = datetime.datetime.now(datetime.timezone.utc)
    try:
        if args.certs_command == "init":
            crt, key = certs.init_ca(Path(args.dir), args.cluster, now=now, days=args.days)
            print_line(f"wrote {crt} and {key} (0600): the CA of cluster {args.cluster}")
            return EXIT_OK
        queues = certs.parse_list(args.queues, "--queues") if args.queues is not None else ()
        hosts = certs.parse_hosts(args.hosts) if args.hosts is not None else None
        crt, key, cert = certs.issue(Path(args.dir), args.role, args.name, now=now, queues=queues,
                                     node=args.node, az=args.az, days=args.days, hosts=hosts)
    except certs.CertError as exc:
        raise UsageError(str(exc)) from None
    print_line(f"wrote {crt} and {key} (0600): {certs.describe(cert)}")
    return EXIT_OK


def cmd_certs_etcd(args: argparse.Namespace) -> int:
    """``phalanx certs etcd-init|etcd-user``: etcd's own CA, its members'
    certificate and etcd users' client directories (phalanx.etcd_pki)."""
    from phalanx import certs, etcd_pki

    now = datetime.datetime.now(datetime.timezone.utc)
    try:
        if args.certs_command == "etcd-init":
            hosts = certs.parse_hosts(args.hosts) if args.hosts is not None else ()
            out = etcd_pki.init(Path(args.dir), hosts=hosts, now=now, days=args.days)
            names = ",".join(dict.fromkeys((etcd_pki.ETCD_SERVER_NAME, *etcd_pki.DEFAULT_SERVER_HOSTS, *hosts)))
            print_line(f"wrote {out.ca}, {Path(args.dir) / certs.CA_KEY} (0600), {out.cert} and {out.key} (0600): "
                   f"the etcd CA and the members' certificate for {names}")
            return EXIT_OK
        if args.user is not None and (args.cluster is not None or args.role is not None):
            raise certs.CertError("--user: give either --user or --cluster with --role, not both")
        if args.user is None:
            if args.cluster is None or args.role is None:
                raise certs.CertError("--cluster and --role: both are required without --user")
            user = etcd_pki.user_for(args.cluster, args.role)
        else:
            user = etcd_pki.check_user(args.user)
        out_dir = etcd_pki.issue_client(Path(args.dir), user, now=now, days=args.days)
    except certs.CertError as exc:
        raise UsageError(str(exc)) from None
    print_line(f"wrote {out_dir}/ ({certs.CA_CERT}, {etcd_pki.CLIENT_CERT}, {etcd_pki.CLIENT_KEY} 0600): "
           f"etcd user {user}; give it as --etcd-tls-dir {out_dir}")
    return EXIT_OK


def cmd_etcd_auth(args: argparse.Namespace) -> int:
    """``phalanx etcd-auth``: provision (or with --remove, remove) a
    cluster's etcd users and roles, as etcd's root user (phalanx.etcd_auth)."""
    import asyncio

    from phalanx import certs, etcd_auth, etcd_pki
    from phalanx.store import InvalidEndpoint, parse_endpoints
    from phalanx.tls import TlsError

    try:
        endpoints = [e.target for e in parse_endpoints(args.etcd)]
        etcd_auth.roles_for(args.cluster)  # the cluster name, before any connection
        root = etcd_pki.files(args.etcd_tls_dir)
        etcd_pki.check_client(root, now=datetime.datetime.now(datetime.timezone.utc))
    except (InvalidEndpoint, certs.CertError) as exc:
        raise UsageError(str(exc)) from None
    except TlsError as exc:
        raise UsageError(f"--etcd-tls-dir: {exc}") from None

    async def go() -> dict:
        if args.remove:
            await etcd_auth.unprovision(endpoints, root, args.cluster)
        else:
            await etcd_auth.provision(endpoints, root, args.cluster, agent_user=args.agent_user)
        return await etcd_auth.describe(endpoints, root, args.cluster)

    try:
        state = asyncio.run(go())
    except etcd_auth.EtcdAuthError as exc:
        print_line(f"error: {exc}", sys.stderr)
        return EXIT_ERROR
    if args.remove:
        print_line(f"removed the etcd users and roles of cluster {args.cluster}")
        return EXIT_OK
    for role, perms in state["roles"].items():
        print_line(f"role {role}: " + "; ".join(p.describe() for p in perms))
    for user, roles in state["users"].items():
        print_line(f"user {user}: roles {', '.join(roles)}")
    print_line("auth: enabled (users log in by the CN of their etcd client certificate)")
    return EXIT_OK


@dataclass
class _Followed:
    offset: int = 0
    decoder: Any = None
    tail: str = ""  # the last, possibly incomplete, line seen
    ended: bool = False
    last_growth: float = 0.0


def follow_logs(
    find: Callable[[], list[tuple[Any, Path]]],
    *,
    poll_s: float = FOLLOW_POLL_S,
    out: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """``phalanx logs -f``: print what the members wrote and keep printing
    what they write, like ``tail -f`` (with several members, a
    ``==> member <==`` line whenever the output switches to another), until every member followed has
    ended (its log's end mark, or its exit record and a log that stopped
    growing); members that start later (other ranks of this incarnation)
    are picked up. Ctrl-C ends it (exit 130, in ``run``)."""
    from phalanx.member_logs import exit_path_for, has_end_mark

    out = out or sys.stdout
    state: dict[Path, _Followed] = {}
    current: Path | None = None
    while True:
        files = find()
        for key, path in files:
            st = state.setdefault(path, _Followed(decoder=codecs.getincrementaldecoder("utf-8")("replace"), last_growth=clock()))
            try:
                with open(path, "rb") as f:
                    f.seek(st.offset)
                    data = f.read(1 << 20)
            except OSError:
                continue  # pruned or not yet there: looked at again next time
            if data:
                st.offset += len(data)
                st.last_growth = clock()
                text = st.decoder.decode(data)
                if len(state) > 1 and current != path:
                    out.write(("\n" if current is not None else "") + f"==> {key} <==\n")
                current = path
                out.write(text)
                out.flush()
                seen = st.tail + text
                complete, _, st.tail = seen.rpartition("\n")
                if has_end_mark(complete):
                    st.ended = True
            elif not st.ended and clock() - st.last_growth >= FOLLOW_SETTLE_S:
                st.ended = exit_path_for(path).exists()
        if files and all(state.get(p) is not None and state[p].ended for _, p in files):
            return EXIT_OK
        sleep(poll_s)
