"""The ``phalanx`` command: submit and inspect gangs, run a local cluster.

Exit codes (docs/cli.md):
  0  success (``wait``: the wanted state was reached)
  1  any other error: server error, unreachable cluster, ``wait`` timed out or
     the gang ended in another terminal state
  2  invalid input: a bad gang spec (checked locally, before anything is sent),
     a bad flag, or a request the server rejected as INVALID_ARGUMENT
  130 interrupted (Ctrl-C)

Expected errors print one ``error: <message>`` line on stderr, never a
traceback; usage errors too (``_Parser.error``).

Start-up time (docs/cli.md "Start-up time"): this module imports neither
gRPC, protobuf, cryptography, asyncio nor YAML; each command imports what it
needs when it runs, so ``--help``, ``--version`` and a usage error cost only
the parser. ``tests/unit/test_cli_startup.py`` keeps it so.
"""

from __future__ import annotations

import argparse
import codecs
import datetime
import json
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from phalanx.client_names import (
    ADDRESS_ENV,
    CONFIG_ENV,
    DEFAULT_ADDRESS,
    DEFAULT_CONFIG,
    INSECURE_ENV,
    MAX_LIMIT,
    MAX_TIMEOUT_S,
    TLS_DIR_ENV,
    check_timeout,
    is_terminal,
    parse_states,
    state_name,
)
from phalanx.model import GangState, Level
from phalanx.text_tables import format_age, format_table

if TYPE_CHECKING:  # annotations only: imported by the commands that run
    from phalanx.client import AsyncClient, Connection
    from phalanx.errors import PhalanxError
    from phalanx.spec import GangSpec
    from phalanx.v1 import gang_pb2
    from phalanx.v1 import types_pb2 as pb

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INVALID = 2
EXIT_INTERRUPTED = 130

STATE_DIR_ENV = "PHALANX_STATE_DIR"


class UsageError(Exception):
    """Bad local input (a flag value, an unreadable file): exit code 2."""


# --- formatting (format_age, format_table: phalanx/text_tables.py) --------------


def age_since(timestamp: float, now: float | None = None) -> str:
    if not timestamp:
        return "-"
    return format_age((time.time() if now is None else now) - timestamp)


def level_label(value: int) -> str:
    try:
        return Level(value).label if value else "-"
    except ValueError:
        return str(value)


def message_to_dict(msg: Any) -> Any:
    """phalanx.wire.message_to_dict (protobuf is imported on first use)."""
    from phalanx.wire import message_to_dict as to_dict

    return to_dict(msg)


def dump(msg: Any, fmt: str) -> str:
    import yaml

    data = message_to_dict(msg) if not isinstance(msg, (dict, list)) else msg
    # Text as the user wrote it (a spec's "2×A100" stays so), as `describe` prints it.
    if fmt == "json":
        return json.dumps(data, indent=2, sort_keys=False, ensure_ascii=False)
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip("\n")


def gang_gpus(gang: pb.Gang) -> int:
    return gang.spec.members * gang.spec.resources.gpus


def describe_gang(gang: pb.Gang, now: float | None = None) -> str:
    """The human form of ``phalanx get``."""
    spec = gang.spec
    topo = []
    if spec.topology.required:
        topo.append(f"required {level_label(spec.topology.required)}")
    if spec.topology.preferred:
        topo.append(f"preferred {level_label(spec.topology.preferred)}")
    if spec.topology.allow_cross_az:
        topo.append("cross-AZ allowed")
    if gang.span:
        topo.append(f"span {level_label(gang.span)}")
    model = f" {spec.resources.gpu_model}" if spec.resources.gpu_model else ""
    nics = f", {spec.resources.rdma_nics} RDMA NIC" if spec.resources.rdma_nics else ""
    fields = [
        ("id", gang.id),
        ("name", spec.name),
        ("state", f"{state_name(gang)} (incarnation {gang.incarnation}, restarts {gang.restarts})"),
        ("owner az", gang.owner_az or "-"),
        ("members", f"{spec.members} x {spec.resources.gpus}{model} GPU{nics} = {gang_gpus(gang)} GPUs"),
        ("queue", f"{spec.queue or 'default'} (priority {spec.priority})"),
        ("topology", ", ".join(topo) or "-"),
        ("submitted", f"{_clock(gang.submitted_at)} ({age_since(gang.submitted_at, now)} ago)" if gang.submitted_at else "-"),
        ("updated", f"{_clock(gang.updated_at)} ({age_since(gang.updated_at, now)} ago)" if gang.updated_at else "-"),
    ]
    if gang.owner:
        # Only a TLS cluster records who submitted a gang; a plaintext one's
        # output stays as it was.
        fields.insert(4, ("submitted by", gang.owner))
    if gang.reason:
        fields.append(("reason", gang.reason))
    width = max(len(k) for k, _ in fields) + 1
    out = [f"{(k + ':').ljust(width)} {v}" for k, v in fields]
    if gang.placement:
        out.append("placement:")
        rows = [
            [m.rank, m.az, m.node, ",".join(str(g) for g in m.gpus) or "-", ",".join(m.nics) or "-"]
            for m in sorted(gang.placement, key=lambda m: m.rank)
        ]
        out.extend("  " + line for line in format_table(["RANK", "AZ", "NODE", "GPUS", "NICS"], rows).splitlines())
    return "\n".join(out)


def _clock(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def gang_rows(gangs: Sequence[pb.Gang], now: float | None = None) -> list[list[Any]]:
    return [
        [
            g.id,
            g.spec.name,
            state_name(g),
            g.owner_az or "-",
            g.spec.members,
            gang_gpus(g),
            age_since(g.submitted_at, now),
            g.reason,
        ]
        for g in gangs
    ]


GANG_HEADERS = ["ID", "NAME", "STATE", "AZ", "MEMBERS", "GPUS", "AGE", "REASON"]


def watch_line(gang: pb.Gang) -> str:
    """One line per change for ``phalanx watch``, stamped with when the
    record changed (``updated_at``), not when the line is printed: the
    first line shows a state reached before the watch began."""
    stamp = time.strftime("%H:%M:%S", time.localtime(gang.updated_at)) if gang.updated_at else time.strftime("%H:%M:%S")
    parts = [stamp, gang.id, state_name(gang), f"inc={gang.incarnation}"]
    if gang.placement:
        nodes = {(m.az, m.node) for m in gang.placement}
        azs = {m.az for m in gang.placement}
        parts.append(f"nodes={len(nodes)}" + (f" azs={len(azs)}" if len(azs) > 1 else ""))
    if gang.span:
        parts.append(f"span={level_label(gang.span)}")
    if gang.reason:
        parts.append(gang.reason)
    return "  ".join(parts)


# --- commands talking to the cluster --------------------------------------------


def _print(text: str = "", file: TextIO | None = None) -> None:
    print(text, file=file or sys.stdout, flush=True)


def read_spec_file(path: str) -> GangSpec:
    """Read and validate a spec file (``-`` = stdin), at most
    ``phalanx.spec.MAX_SPEC_BYTES`` of it. InvalidSpec / UsageError."""
    from phalanx.spec import load_spec, read_spec_bytes

    try:
        if path == "-":
            text = read_spec_bytes(sys.stdin.buffer, "stdin")
        else:
            with open(path, "rb") as f:
                text = read_spec_bytes(f, path)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    return load_spec(text)


async def cmd_submit(client: AsyncClient, args: argparse.Namespace, spec: GangSpec) -> int:
    result = await client.submit(spec, idempotency_key=args.idempotency_key)
    gang = result.gang
    if args.output in ("json", "yaml"):
        _print(dump(gang, args.output))
    elif args.output == "wide":
        _print(format_table(GANG_HEADERS, gang_rows([gang])))
    else:
        _print(gang.id)
    if not result.created:
        _print(f"note: gang {gang.id} was already submitted with this idempotency key", sys.stderr)
    return EXIT_OK


async def cmd_get(client: AsyncClient, args: argparse.Namespace) -> int:
    gang = await client.get(args.id)
    _print(dump(gang, args.output) if args.output in ("json", "yaml") else describe_gang(gang))
    return EXIT_OK


async def cmd_list(client: AsyncClient, args: argparse.Namespace) -> int:
    gangs = await client.list(
        states=args.states, queue=args.queue, owner_az=args.az, name_prefix=args.name_prefix, limit=args.limit
    )
    if args.output in ("json", "yaml"):
        _print(dump([message_to_dict(g) for g in gangs], args.output))
    elif gangs:
        _print(format_table(GANG_HEADERS, gang_rows(gangs)))
    else:
        _print("no gangs")
    return EXIT_OK


async def cmd_watch(client: AsyncClient, args: argparse.Namespace) -> int:
    last_line_key: tuple[Any, ...] | None = None
    async for gang in client.watch(args.id):
        # One line per *visible* change; a record rewrite that changes nothing
        # shown (e.g. a heartbeat timestamp) is not worth a line.
        key = (gang.state, gang.incarnation, gang.reason, len(gang.placement), gang.span)
        if key != last_line_key:
            _print(watch_line(gang))
            last_line_key = key
        if is_terminal(gang):
            break
    return EXIT_OK


async def cmd_wait(client: AsyncClient, args: argparse.Namespace) -> int:
    from phalanx.client import TerminalStateReached

    try:
        gang = await client.wait(args.id, args.wanted, timeout=args.timeout)
    except TimeoutError as exc:
        _print(f"error: timed out: {exc}", sys.stderr)
        return EXIT_ERROR
    except TerminalStateReached as exc:
        _print(f"error: {exc}", sys.stderr)
        return EXIT_ERROR
    _print(f"gang {gang.id} is {state_name(gang)}")
    return EXIT_OK


async def cmd_cancel(client: AsyncClient, args: argparse.Namespace) -> int:
    gang = await client.cancel(args.id, reason=args.reason)
    _print(f"gang {gang.id}: {state_name(gang)}" + (f" ({gang.reason})" if gang.reason else ""))
    return EXIT_OK


async def cmd_explain(client: AsyncClient, args: argparse.Namespace) -> int:
    response = await client.explain(args.id)
    if args.output in ("json", "yaml"):
        _print(dump(response, args.output))
        return EXIT_OK
    gang = response.gang
    _print(f"gang {gang.id or args.id}: {state_name(gang)}" + (f" ({gang.reason})" if gang.reason else ""))
    if response.summary:
        _print(response.summary)
    if response.shortfalls:
        _print("shortfall by domain:")
        rows = [
            [
                level_label(s.level),
                s.domain,
                f"{s.gpus_free}/{s.gpus_total}",
                s.gpus_needed,
                f"{s.members_fit}/{s.members_needed}",
                s.reason,
            ]
            for s in response.shortfalls
        ]
        table = format_table(["LEVEL", "DOMAIN", "GPUS FREE/TOTAL", "GPUS NEEDED", "MEMBERS FIT/NEEDED", "REASON"], rows)
        _print("\n".join("  " + line for line in table.splitlines()))
    return EXIT_OK


# --- `phalanx describe` and `phalanx events` (docs/events.md) -------------------


def event_line(e: pb.GangEventRecord) -> str:
    """One event, as `phalanx events` and `phalanx describe` print it."""
    inc = f"inc={e.incarnation}" if e.incarnation else "inc=-"
    return f"{_clock(e.at)}  epoch={e.epoch}  {inc}  {e.kind:<13}  {e.message}"


def describe_full(gang: pb.Gang, now: float | None = None) -> str:
    """`phalanx describe`: spec, state, placement, events, in reading order."""
    import yaml

    from phalanx.wire import spec_from_pb

    spec = yaml.safe_dump(spec_from_pb(gang.spec).to_dict(), sort_keys=False, allow_unicode=True).rstrip("\n")
    out = [f"gang {gang.id}", "spec:"] + ["  " + line for line in spec.splitlines()]
    state = [
        ("state", f"{state_name(gang)} (incarnation {gang.incarnation}, restarts {gang.restarts})"),
        ("owner az", gang.owner_az or "-"),
        ("submitted", f"{_clock(gang.submitted_at)} ({age_since(gang.submitted_at, now)} ago)" if gang.submitted_at else "-"),
        ("updated", f"{_clock(gang.updated_at)} ({age_since(gang.updated_at, now)} ago)" if gang.updated_at else "-"),
    ]
    if gang.owner:
        state.insert(2, ("submitted by", gang.owner))
    if gang.reason:
        state.append(("reason", gang.reason))
    if gang.span:
        state.append(("span", level_label(gang.span)))
    width = max(len(k) for k, _ in state) + 1
    out.append("state:")
    out.extend(f"  {(k + ':').ljust(width)} {v}" for k, v in state)
    if gang.placement:
        out.append("placement:")
        rows = [[m.rank, m.az, m.node, ",".join(str(g) for g in m.gpus) or "-", ",".join(m.nics) or "-"]
                for m in sorted(gang.placement, key=lambda m: m.rank)]
        out.extend("  " + line for line in format_table(["RANK", "AZ", "NODE", "GPUS", "NICS"], rows).splitlines())
    else:
        out.append("placement: -")
    if gang.events:
        out.append("events:")
        # Each event's stimulus (the decision that wrote it), as the
        # coordinator's log lines name it: grep the logs for it.
        out.extend("  " + event_line(e) + (f"  [stimulus={e.stimulus}]" if e.stimulus else "") for e in gang.events)
    else:
        out.append("events: - (none recorded: a coordinator older than events wrote this gang)")
    return "\n".join(out)


async def cmd_describe(client: AsyncClient, args: argparse.Namespace) -> int:
    gang = await client.get(args.id)
    _print(dump(gang, args.output) if args.output in ("json", "yaml") else describe_full(gang))
    return EXIT_OK


async def cmd_events(client: AsyncClient, args: argparse.Namespace) -> int:
    """The gang's events so far, then (unless --no-follow) each new one
    until the gang is terminal; without an ID, every new event of the
    cluster (or of --queue) until interrupted."""
    if not args.id:
        return await cmd_cluster_events(client, args)
    if args.queue:
        raise UsageError("--queue: follows the events of a queue, so it takes no gang ID")
    if args.no_follow:
        events: Any = (await client.get(args.id)).events
        for e in events:
            _print(json.dumps(message_to_dict(e)) if args.output == "json" else event_line(e))
        return EXIT_OK
    async for e in client.watch_events(args.id):
        _print(json.dumps(message_to_dict(e)) if args.output == "json" else event_line(e))
    return EXIT_OK


def cluster_event_line(ce: gang_pb2.ClusterEvent) -> str:
    """One event of the cluster stream: the gang (name and id), then the
    event as `phalanx events ID` prints it."""
    return f"{ce.gang_name} ({ce.gang_id})  {event_line(ce.event)}"


async def cmd_cluster_events(client: AsyncClient, args: argparse.Namespace) -> int:
    if args.no_follow:
        raise UsageError("--no-follow: the cluster stream has no history to print; name a gang ID")
    where = f"queue {args.queue}" if args.queue else "every queue"

    def opened() -> None:
        # On stderr: stdout carries only events (one JSON object a line with -o json).
        print(f"following new gang events of {where} (Ctrl-C stops)", file=sys.stderr, flush=True)

    async for ce in client.watch_cluster_events(args.queue, on_open=opened):
        _print(json.dumps(message_to_dict(ce)) if args.output == "json" else cluster_event_line(ce))
    return EXIT_OK


def node_rows(nodes: Sequence[pb.NodeStatus], now: float | None = None) -> list[list[Any]]:
    rows = []
    for n in sorted(nodes, key=lambda n: (n.topology.az, n.topology.node)):
        t = n.topology
        rows.append(
            [
                t.node,
                t.az or "-",
                f"{t.spine or '-'}/{t.leaf or '-'}",
                "yes" if n.ready else "no",
                f"{n.gpus_used}/{n.gpus_total}",
                age_since(n.last_heartbeat, now),
                n.reason,
            ]
        )
    return rows


async def cmd_nodes(client: AsyncClient, args: argparse.Namespace) -> int:
    nodes = await client.nodes(az=args.az)
    if args.output in ("json", "yaml"):
        _print(dump([message_to_dict(n) for n in nodes], args.output))
    elif nodes:
        _print(format_table(["NODE", "AZ", "SPINE/LEAF", "READY", "GPUS USED/TOTAL", "HEARTBEAT", "REASON"], node_rows(nodes)))
    else:
        _print("no nodes")
    return EXIT_OK


async def cmd_status(client: AsyncClient, args: argparse.Namespace) -> int:
    st = await client.status()
    if args.output in ("json", "yaml"):
        _print(dump(st, args.output))
        return EXIT_OK
    # Which cluster answered, and where: two local clusters on one machine
    # may both answer on ports that look like the default.
    _print(f"cluster {st.cluster or '-'} (answered by {st.served_by or 'a coordinator'} at {client.last_address})")
    rows = [
        [
            az.az,
            az.leader_id if az.has_leader else "(none)",
            az.leader_address if az.has_leader else "-",
            az.epoch if az.has_leader else "-",
            f"{az.nodes_ready}/{az.nodes_total}" + node_states_note(az),
            f"{az.gpus_free}/{az.gpus_total}" + (f" (usable {az.gpus_usable_free}/{az.gpus_usable})"
                                                  if az.gpus_usable != az.gpus_total else ""),
        ]
        for az in sorted(st.azs, key=lambda a: a.az)
    ]
    if rows:
        _print(format_table(["AZ", "LEADER", "ADDRESS", "EPOCH", "NODES READY/TOTAL", "GPUS FREE/TOTAL"], rows))
    else:
        _print("no AZs")
    counts = dict(st.gangs_by_state)
    _print("gangs: " + (format_state_counts(counts) or "none"))
    _print(etcd_space_line(st.etcd))
    return EXIT_OK


def node_states_note(az: Any) -> str:
    """" (1 not ready, 2 cordoned, 1 expired)" for an AzStatus, or ""
    when every node is ready (docs/nodes.md)."""
    parts = [f"{n} {what}" for n, what in ((az.nodes_not_ready, "not ready"), (az.nodes_cordoned, "cordoned"),
                                           (az.nodes_expired, "expired")) if n]
    return f" ({', '.join(parts)})" if parts else ""


def etcd_space_line(etcd: Any) -> str:
    """The status line about etcd's space (a gang_pb2.EtcdSpace): an error
    line while its NOSPACE alarm stops every write, a warning from 80 % of
    its quota, else the plain figures."""
    where = 'docs/etcd-keys.md "When etcd is full"'
    if etcd.level == "alarm":
        return (f"error: etcd's space alarm (NOSPACE) is active: {etcd.summary}; etcd refuses every write, so no gang "
                f"is admitted, started or finished until an operator recovers ({where})")
    if etcd.level == "warning":
        return (f"warning: etcd is nearly full: {etcd.summary}; at the quota it refuses every write: keep fewer "
                f"finished gangs or raise the quota ({where})")
    if etcd.error:
        return f"etcd: its space could not be read: {etcd.error}"
    return etcd.summary or "etcd: space not reported (an older coordinator answered)"


def format_state_counts(counts: dict[str, int]) -> str:
    """``PENDING 1, RUNNING 3`` in lifecycle order; keys may be names with or
    without the ``GANG_STATE_`` prefix."""

    def order(name: str) -> tuple[int, str]:
        try:
            return (min(int(s) for s in parse_states(name)), name)
        except ValueError:
            return (len(GangState) + 1, name)

    items = sorted(((k, v) for k, v in counts.items() if v), key=lambda kv: order(kv[0]))
    return ", ".join(f"{k.removeprefix('GANG_STATE_')} {v}" for k, v in items)


async def cmd_topology(client: AsyncClient, args: argparse.Namespace) -> int:
    # Imported here so every other command works without the view module.
    from phalanx.topology_view import render_tree
    from phalanx.wire import topology_from_pb

    nodes = await client.nodes(az=args.az)
    entries = [(topology_from_pb(n.topology), frozenset(n.used_gpus), bool(n.ready)) for n in nodes]
    _print(render_tree(entries))
    return EXIT_OK


async def cmd_top(client: AsyncClient, args: argparse.Namespace) -> int:
    from phalanx.top import run_top  # here: rich is needed by top only

    return await run_top(client, once=args.once, watch=args.watch, interval=args.interval, rows=args.rows,
                         output=args.output)


# --- local commands -----------------------------------------------------------------


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
            _print(f"error: cannot read {path}: {exc.strerror or exc}", sys.stderr)
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
            _print(f"wrote {crt} and {key} (0600): the CA of cluster {args.cluster}")
            return EXIT_OK
        queues = certs.parse_list(args.queues, "--queues") if args.queues is not None else ()
        hosts = certs.parse_hosts(args.hosts) if args.hosts is not None else None
        crt, key, cert = certs.issue(Path(args.dir), args.role, args.name, now=now, queues=queues,
                                     node=args.node, az=args.az, days=args.days, hosts=hosts)
    except certs.CertError as exc:
        raise UsageError(str(exc)) from None
    _print(f"wrote {crt} and {key} (0600): {certs.describe(cert)}")
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
            _print(f"wrote {out.ca}, {Path(args.dir) / certs.CA_KEY} (0600), {out.cert} and {out.key} (0600): "
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
    _print(f"wrote {out_dir}/ ({certs.CA_CERT}, {etcd_pki.CLIENT_CERT}, {etcd_pki.CLIENT_KEY} 0600): "
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
        _print(f"error: {exc}", sys.stderr)
        return EXIT_ERROR
    if args.remove:
        _print(f"removed the etcd users and roles of cluster {args.cluster}")
        return EXIT_OK
    for role, perms in state["roles"].items():
        _print(f"role {role}: " + "; ".join(p.describe() for p in perms))
    for user, roles in state["users"].items():
        _print(f"user {user}: roles {', '.join(roles)}")
    _print("auth: enabled (users log in by the CN of their etcd client certificate)")
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


# --- argument parsing -------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error convention: one ``error:`` line on
    stderr and exit code 2, not a usage dump (subparsers inherit the class)."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        self.exit(EXIT_INVALID, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _rpc_timeout(text: str) -> float:
    try:
        return check_timeout(_positive_float(text), "the deadline")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not lo <= value <= hi:
            # A 100-digit value is echoed shortened: the line stays one line.
            shown = text if len(text) <= 24 else text[:20] + "..."
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi}, got {shown}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


_non_negative_int = _int_in(0, MAX_LIMIT)


class _StatesAction(argparse.Action):
    """``--state running --state pending`` or ``--state running,pending``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        current = list(getattr(namespace, self.dest, None) or [])
        for item in str(values).split(","):
            if not item.strip():
                continue
            try:
                current.extend(sorted(parse_states(item)))
            except ValueError as exc:
                parser.error(f"{option_string}: {exc}")
        setattr(namespace, self.dest, current)


def _common_options() -> argparse.ArgumentParser:
    # Defaults are SUPPRESSed so these flags work before *and* after the
    # subcommand without the subparser's default overwriting the main one.
    common = _Parser(add_help=False)
    common.add_argument(
        "--address",
        default=argparse.SUPPRESS,
        help=f"coordinator address(es), comma-separated (env {ADDRESS_ENV}, else the config file's addresses; "
             f"default {DEFAULT_ADDRESS})",
    )
    common.add_argument(
        "--rpc-timeout",
        type=_rpc_timeout,
        default=argparse.SUPPRESS,
        help=f"deadline of each API call in seconds, failover included (default 10, at most {MAX_TIMEOUT_S:g})",
    )
    common.add_argument(
        "--tls-dir",
        default=argparse.SUPPRESS,
        help=f"connect with TLS: a directory with ca.crt, client.crt and client.key (env {TLS_DIR_ENV}, else "
             f"tls_dir in the config file ${CONFIG_ENV}, default {DEFAULT_CONFIG}; `phalanx config` shows which)",
    )
    common.add_argument(
        "--insecure",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"connect in plaintext (env {INSECURE_ENV}=1); never the default",
    )
    common.add_argument(
        "--token-file",
        default=argparse.SUPPRESS,
        help="send the bearer token in FILE (env PHALANX_TOKEN: the token itself); only over TLS, where "
             "--tls-dir needs only ca.crt (docs/security.md \"Bearer tokens\")",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common_options()
    parser = _Parser(
        prog="phalanx",
        description="Phalanx: gang scheduling of GPU training jobs across availability zones.",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes: 0 ok, 1 error (or wait not satisfied), 2 invalid input, 130 interrupted",
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from phalanx.up_args import add_arguments as add_up_arguments  # not phalanx.up: it imports gRPC

    for name, (_, text) in PASSTHROUGH.items():
        sub.add_parser(name, help=text, add_help=False)
    p = sub.add_parser("up", help="run a local multi-AZ cluster (etcd, coordinators, simulated agents)")
    add_up_arguments(p)

    p = sub.add_parser("submit", parents=[common], help="submit a gang spec (YAML); prints the gang id")
    p.add_argument("file", metavar="FILE", help="gang spec file, '-' for stdin")
    p.add_argument("--idempotency-key", default=None, help="reuse to make a resubmission return the same gang")
    p.add_argument("-o", "--output", choices=["id", "json", "yaml", "wide"], default="id")
    p.add_argument("--dry-run", action="store_true", help="only validate; print the normalised spec")

    p = sub.add_parser("get", parents=[common], help="show one gang")
    p.add_argument("id", metavar="ID", help="gang id, or a name (its live gang, else its newest kept one)")
    p.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text")

    p = sub.add_parser("list", parents=[common], help="list gangs")
    p.add_argument("--state", dest="states", action=_StatesAction, default=[], metavar="STATE", help="filter by state (repeatable, or comma-separated)")
    p.add_argument("--queue", default="")
    p.add_argument("--az", default="", help="owner AZ")
    p.add_argument("--name-prefix", default="")
    p.add_argument("--limit", type=_non_negative_int, default=0, help=f"newest N gangs (0: all; at most {MAX_LIMIT})")
    p.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table")

    p = sub.add_parser("watch", parents=[common], help="print a line per change until the gang is terminal")
    p.add_argument("id", metavar="ID")

    p = sub.add_parser("wait", parents=[common], help="wait until a gang reaches a state")
    p.add_argument("id", metavar="ID")
    p.add_argument("--for", dest="wanted", action=_StatesAction, default=[], required=True, metavar="STATE", help="wanted state (repeatable, or comma-separated)")
    p.add_argument("--timeout", type=_positive_float, default=300.0, help="seconds (default 300)")

    p = sub.add_parser("cancel", parents=[common], help="cancel a gang")
    p.add_argument("id", metavar="ID")
    p.add_argument("--reason", default="", help="recorded on the gang")

    p = sub.add_parser("explain", parents=[common], help="why a gang is (not) placed: summary and per-domain shortfalls")
    p.add_argument("id", metavar="ID")
    p.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text")

    p = sub.add_parser("nodes", parents=[common], help="list nodes")
    p.add_argument("--az", default="")
    p.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table")

    p = sub.add_parser("status", parents=[common], help="leaders, epochs and capacity per AZ; gangs by state")
    p.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text")

    # `phalanx top` (phalanx/top.py, docs/monitoring.md).
    p = sub.add_parser("top", parents=[common], help="leaders, capacity, gangs by state and pending gangs, refreshed in place")
    p.add_argument("--once", action="store_true", help="print the view once and exit (also on a terminal)")
    p.add_argument("--watch", action="store_true", help="not on a terminal: print the view again every --interval")
    p.add_argument("--interval", type=_positive_float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--rows", type=_non_negative_int, default=10, help="pending gangs listed, oldest first (default 10)")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")

    # `phalanx describe` and `phalanx events` (docs/events.md).
    p = sub.add_parser("describe", parents=[common], help="one gang in full: spec, state, placement and its events")
    p.add_argument("id", metavar="ID", help="gang id, or a name (its live gang, else its newest kept one)")
    p.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text")
    p = sub.add_parser("events", parents=[common],
                       help="a gang's events, then each new one until it is terminal; without ID, the cluster's new events")
    p.add_argument("id", metavar="ID", nargs="?", default="",
                   help="gang id, or a name; left out: every new event of the cluster (or of --queue)")
    p.add_argument("--queue", default="", help="without ID: only the gangs of this queue")
    p.add_argument("--no-follow", action="store_true", help="print the events so far and exit")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text", help="json: one object per line")

    p = sub.add_parser("config", parents=[common],
                       help="where this CLI finds its coordinators and credentials (flags, env, config file); contacts nobody")

    p = sub.add_parser("topology", parents=[common], help="the network tree with GPU usage")
    p.add_argument("--az", default="")

    p = sub.add_parser("logs", parents=[common], help="print member logs written by agents started with --launch")
    p.add_argument("gang", metavar="GANG", help="gang id, or name (its most recent gang)")
    p.add_argument("--rank", type=_non_negative_int, default=None)
    p.add_argument("--incarnation", type=_non_negative_int, default=None, help="default: the latest one found")
    p.add_argument("--state-dir", default=None, help=f"the agents' state dir (env {STATE_DIR_ENV})")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output until the members have ended (Ctrl-C stops)")

    p = sub.add_parser("policy", help="the cluster's GangService policy: get it, or set it (admin) from a YAML file")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = actions.add_parser("get", parents=[common], help="print the policy as YAML, headed by its revision")
    q.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    q = actions.add_parser("set", parents=[common],
                           help="replace the policy with FILE (YAML), if it is still at --revision (from policy get)")
    q.add_argument("file", metavar="FILE", help="the policy, YAML (- for stdin): max_priority, submitters, visibility")
    q.add_argument("--revision", type=_non_negative_int, required=True,
                   help="the revision `phalanx policy get` printed (0: no policy stored yet); a newer one is refused")

    p = sub.add_parser("node", help="node lifecycle (admin): cordon, uncordon, drain or delete a node (docs/nodes.md)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (("cordon", "place nothing new on NODE; what runs there stays"),
                       ("uncordon", "let NODE take work again"),
                       ("drain", "cordon NODE, then wait until it holds no devices (--requeue: restart its gangs elsewhere)"),
                       ("delete", "remove NODE's record; refused while gangs hold its devices unless --force")):
        q = actions.add_parser(name, parents=[common], help=text)
        q.add_argument("node", metavar="NODE")
        q.add_argument("--az", required=True, help="the node's AZ")
        if name == "drain":
            q.add_argument("--requeue", action="store_true", help="restart its gangs on other nodes now (default: let them finish)")
            q.add_argument("--timeout", type=_positive_float, default=300.0,
                           help="seconds to wait for the node to hold no devices (default 300)")
        if name == "delete":
            q.add_argument("--force", action="store_true", help="delete even while gangs hold its devices (they restart or fail)")

    # Local only: files in --dir, no coordinator is contacted (docs/security.md).
    p = sub.add_parser("certs", help="a cluster's CA and the certificates it issues (files in --dir)")
    actions = p.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    q = actions.add_parser("init", help="create a CA: DIR/ca.crt and DIR/ca.key (0600); never replaces one")
    q.add_argument("--dir", required=True, help="directory for the CA (created 0700)")
    q.add_argument("--cluster", default="local", help="the cluster the CA is for (default local, as the coordinator's)")
    q.add_argument("--days", type=_int_in(1, 36600), default=3650, help="validity of the CA (default 3650)")
    q = actions.add_parser("issue", help="issue DIR/<role>-<name>.crt and .key (0600) naming the identity and role; re-issuing renews")
    q.add_argument("--dir", required=True, help="directory holding the CA (phalanx certs init)")
    q.add_argument("--role", required=True, choices=["admin", "submitter", "viewer", "agent", "coordinator"])
    q.add_argument("--name", required=True, help="who: a user, a service, an agent or coordinator id")
    q.add_argument("--queues", default=None, help="submitter only (required): the queues it may use, comma-separated")
    q.add_argument("--node", default=None, help="agent only (required): the node it may register as")
    q.add_argument("--az", default=None, help="agent or coordinator: the AZ it serves in; a coordinator of another AZ "
                                              "refuses it (docs/security.md \"AZ binding\")")
    q.add_argument("--hosts", default=None, help="coordinator only: DNS names and IPs other TLS clients dial, comma-separated (default "
                        "localhost,127.0.0.1,::1); coordinators.<cluster>.phalanx.invalid, the name phalanx's own "
                        "clients check, is always added")
    q.add_argument("--days", type=_int_in(1, 36600), default=365, help="validity (default 365; not beyond the CA's)")
    q = actions.add_parser("etcd-init", help="create etcd's own CA and its members' certificate: DIR/ca.crt ca.key server.crt server.key")
    q.add_argument("--dir", required=True, help="directory for the etcd CA (created 0700; not the Phalanx CA's)")
    q.add_argument("--hosts", default=None, help="extra DNS names and IPs of the etcd members, comma-separated "
                   "(always: etcd.phalanx.invalid,localhost,127.0.0.1,::1)")
    q.add_argument("--days", type=_int_in(1, 36600), default=3650, help="validity of the CA and the server certificate (default 3650)")
    q = actions.add_parser("etcd-user", help="issue DIR/<user>/{ca.crt,client.crt,client.key}: an etcd user's client certificate (CN = user)")
    q.add_argument("--dir", required=True, help="directory holding the etcd CA (phalanx certs etcd-init)")
    q.add_argument("--user", default=None, help="the etcd user, e.g. root (or give --cluster and --role)")
    q.add_argument("--cluster", default=None, help="with --role: the user phalanx-<cluster>-<role>")
    q.add_argument("--role", default=None, choices=["coordinator", "agent"])
    q.add_argument("--days", type=_int_in(1, 36600), default=365, help="validity (default 365; not beyond the CA's)")

    p = sub.add_parser("etcd-auth", help="provision (or --remove) a cluster's least-privilege etcd users and roles; turns etcd auth on")
    p.add_argument("--etcd", required=True, help="etcd endpoints host:port, comma-separated")
    p.add_argument("--etcd-tls-dir", required=True, help="the root user's client directory (phalanx certs etcd-user --user root)")
    p.add_argument("--cluster", required=True, help="the cluster whose users and roles to provision")
    p.add_argument("--remove", action="store_true", help="remove that cluster's users and roles instead")
    p.add_argument("--agent-user", action="store_true",
                   help="also the legacy read-only agent user, for agents started with --etcd/--etcd-tls-dir; only "
                        "on an etcd with the fixes docs/security.md lists (default: none, agents read through the "
                        "coordinators; an agent user there is removed)")
    return parser


class _VersionAction(argparse.Action):
    """``--version``: the installed version, looked up only when asked for
    (importlib.metadata costs every other command ~15 ms of start-up)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and exit", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"phalanx {_version()}", flush=True)  # on stdout, as argparse's own version action
        parser.exit()


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("phalanx")
    except metadata.PackageNotFoundError:  # run from a source tree without an install
        return "unknown (not installed)"


async def cmd_policy(client: AsyncClient, args: argparse.Namespace) -> int:
    """``phalanx policy get`` / ``set`` (docs/security.md "Policy as data")."""
    import yaml

    if args.action == "get":
        policy, record = await client.get_policy()
        if args.output == "json":
            _print(json.dumps({"revision": record.revision, "set_by": record.set_by, "set_at": record.set_at,
                               "policy": policy}, indent=2, sort_keys=True))
            return EXIT_OK
        when = f" at {datetime.datetime.fromtimestamp(record.set_at, datetime.timezone.utc).isoformat(timespec='seconds')}" \
            if record.set_at else ""
        who = f", set by {record.set_by}{when}" if record.set_by else ""
        _print(f"# revision: {record.revision}{who}" + (" (no policy stored: the defaults)" if not record.revision else ""))
        _print(yaml.safe_dump(policy, sort_keys=True).rstrip("\n"))
        return EXIT_OK
    policy = read_policy_file(args.file)
    record = await client.set_policy(policy, args.revision)
    _print(f"policy set: revision {record.revision} (by {record.set_by or 'an unauthenticated caller'})")
    return EXIT_OK


def read_policy_file(path: str) -> dict[str, Any]:
    """The YAML mapping in ``path`` (``-`` = stdin); UsageError naming the
    file. The coordinator validates the fields (INVALID_ARGUMENT names them)."""
    from phalanx import strict_docs

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = strict_docs.load_yaml(text)
    except strict_docs.DocumentError as exc:
        raise UsageError(f"{path}: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"{path}: the policy must be a mapping (max_priority, submitters, visibility), got {type(data).__name__}")
    return data


async def cmd_node(client: AsyncClient, args: argparse.Namespace) -> int:
    """``phalanx node cordon|uncordon|drain|delete NODE --az AZ`` (docs/nodes.md)."""
    where = f"{args.node} ({args.az})"
    if args.action in ("cordon", "uncordon"):
        await client.cordon(args.az, args.node, args.action == "cordon")
        _print(f"node {where} {args.action}ed")
        return EXIT_OK
    if args.action == "delete":
        held = await client.delete_node(args.az, args.node, force=args.force)
        _print(f"node {where} deleted" + (f" (gangs {', '.join(held)} held its devices)" if held else ""))
        return EXIT_OK
    answer = await client.drain(args.az, args.node, requeue=args.requeue, timeout=args.timeout)
    if answer.requeued:
        _print(f"restarted on other nodes: {', '.join(answer.requeued)}")
    if answer.gangs:
        _print(f"error: node {where} still holds devices of {', '.join(answer.gangs)} after {args.timeout:g}s "
               "(it stays cordoned)", file=sys.stderr)
        return EXIT_ERROR
    _print(f"node {where} drained: cordoned, it holds no devices")
    return EXIT_OK


REMOTE: dict[str, Callable[[AsyncClient, argparse.Namespace], Awaitable[int]]] = {
    "node": cmd_node,
    "policy": cmd_policy,
    "get": cmd_get,
    "list": cmd_list,
    "watch": cmd_watch,
    "wait": cmd_wait,
    "cancel": cmd_cancel,
    "explain": cmd_explain,
    "nodes": cmd_nodes,
    "status": cmd_status,
    "topology": cmd_topology,
    "top": cmd_top,
    "describe": cmd_describe,
    "events": cmd_events,
}


def resolve_connection(args: argparse.Namespace) -> Connection:
    """Where the command connects and with what: --address/--tls-dir/
    --insecure, then $PHALANX_ADDRESS/$PHALANX_TLS_DIR/$PHALANX_INSECURE, then
    the config file (phalanx.client.resolve_connection). UsageError naming
    the flag, variable or file."""
    from phalanx.client import ClientConfigError, connection_settings

    try:
        return connection_settings(getattr(args, "address", None), getattr(args, "tls_dir", None),
                                   getattr(args, "insecure", False), cli=True)
    except ClientConfigError as exc:
        raise UsageError(str(exc)) from None


def cmd_config(args: argparse.Namespace) -> int:
    """``phalanx config``: where the credentials and addresses come from,
    and who the client certificate says this is; contacts nobody."""
    from phalanx.client import client_tls
    from phalanx.tls import TlsError

    conn = resolve_connection(args)
    _print(f"addresses: {','.join(conn.addresses)} (from {conn.addresses_from})")
    if conn.tls_dir is None:
        _print(f"tls: off, plaintext (from {conn.tls_from})")
        return EXIT_OK
    try:
        files, cluster = client_tls(conn.tls_dir)
    except TlsError as exc:
        raise UsageError(f"{conn.tls_from}: TLS: {exc}") from None
    from phalanx.tls import load, utc_now

    loaded = load(files, cluster=cluster, use="client", now=utc_now())
    _print(f"tls: {conn.tls_dir} (from {conn.tls_from})")
    _print(f"cluster: {cluster} (the CA in {files.ca})")
    _print(f"identity: {loaded.identity.uri()} (until {loaded.cert.not_valid_after_utc.isoformat()})")
    return EXIT_OK


async def _run_remote(args: argparse.Namespace) -> int:
    import yaml

    from phalanx.client import AsyncClient, ClientConfigError, read_token_file
    from phalanx.tls import TlsError

    conn = resolve_connection(args)
    try:
        token = read_token_file(args.token_file) if getattr(args, "token_file", None) else None
        client = AsyncClient(timeout=getattr(args, "rpc_timeout", 10.0), connection=conn, token=token,
                             fail_fast=True)
    except TlsError as exc:  # names the file and the check
        raise UsageError(f"{conn.tls_from}: TLS: {exc}") from None
    except ClientConfigError as exc:
        raise UsageError(str(exc)) from None
    async with client:
        if args.command == "submit":
            spec = read_spec_file(args.file)  # validated before any connection
            if args.dry_run:
                _print(yaml.safe_dump(spec.to_dict(), sort_keys=False, allow_unicode=True).rstrip("\n"))
                return EXIT_OK
            return await cmd_submit(client, args, spec)
        return await REMOTE[args.command](client, args)


def run(args: argparse.Namespace) -> int:
    """Dispatch a parsed command; expected errors become exit codes."""
    if args.command != "up":
        # One `error:` line is all the user sees: gRPC's C-core would log each
        # failed handshake and reconnect on stderr (unless GRPC_VERBOSITY is
        # set). Before gRPC is first imported; not for `up`, whose children
        # inherit the environment and keep their logs.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        if args.command == "up":
            from phalanx import up as up_module

            return up_module.run(args)
        if args.command == "logs":
            return cmd_logs(args)
        if args.command == "certs":
            return cmd_certs(args)
        if args.command == "etcd-auth":
            return cmd_etcd_auth(args)
        if args.command == "config":
            return cmd_config(args)
        import asyncio

        return asyncio.run(_run_remote(args))
    except UsageError as exc:
        _print(f"error: {exc}", sys.stderr)
        return EXIT_INVALID
    except ImportError as exc:
        # topology/logs need modules that may not be installed in this build.
        _print(f"error: {args.command} is not available: {exc}", sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        _print("interrupted", sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `phalanx list | head`: the reader went away; not an error worth a trace.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except Exception as exc:
        # InvalidSpec, PhalanxError, TlsError: their modules are imported only
        # when one of them may be what happened (start-up time).
        code = _expected_error(exc)
        if code is None:
            raise
        return code


def _expected_error(exc: BaseException) -> int | None:
    """The exit code of an expected error, after its one ``error:`` line;
    None for anything else (a bug: its traceback is shown)."""
    from phalanx.errors import InvalidArgument, PhalanxError
    from phalanx.spec import InvalidSpec
    from phalanx.tls import TlsError

    if isinstance(exc, InvalidSpec):
        _print(f"error: {exc}", sys.stderr)
        return EXIT_INVALID
    if isinstance(exc, InvalidArgument):
        _print(f"error: invalid argument: {_one_line(exc)}", sys.stderr)
        return EXIT_INVALID
    if isinstance(exc, PhalanxError):
        _print(f"error: {_one_line(exc)}", sys.stderr)
        return EXIT_ERROR
    if isinstance(exc, TlsError):  # a TLS file that changed under a running command
        _print(f"error: TLS: {exc}", sys.stderr)
        return EXIT_ERROR
    return None


# Server-side processes, reachable as `phalanx <name> ...`; their own
# argument parsers take the rest of the command line.
PASSTHROUGH = {
    "coordinator": ("coordinator.__main__", "run one coordinator replica (python -m coordinator)"),
    "agent": ("agent.__main__", "run one node agent with topology discovery (python -m agent)"),
    "agents-sim": ("agent.sim", "run many simulated node agents in one process (python -m agent.sim)"),
    "chaos": ("chaos.run", "chaos suite: `phalanx chaos run [--scenario NAME|--all] [--seeds N]`"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH:
        import importlib

        rest = argv[1:]
        if argv[0] == "chaos" and rest[:1] == ["run"]:
            rest = rest[1:]
        module = importlib.import_module(PASSTHROUGH[argv[0]][0])
        return int(module.main(rest) or 0)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:  # argparse: 0 after --help, 2 for a usage error
        return exc.code if isinstance(exc.code, int) else EXIT_INVALID
    if extra:
        # Named by the command that refused them, whose --help lists what it takes.
        prog = " ".join(["phalanx", *(w for w in (args.command, getattr(args, "action", None),
                                                   getattr(args, "certs_command", None)) if w)])
        _print(f"error: {prog}: unrecognized arguments: {' '.join(extra)} (see {prog} --help)", sys.stderr)
        return EXIT_INVALID
    if args.command is None:
        _print("error: phalanx: a command is required (see phalanx --help)", sys.stderr)
        return EXIT_INVALID
    return run(args)


def _one_line(exc: PhalanxError) -> str:
    """A server's message on one line, followed by who answered (the
    cluster's name and the coordinator: two local clusters may both answer
    on ports that look like the default)."""
    text = " ".join(str(exc).split())
    origin = exc.origin
    return f"{text} [{origin}]" if origin else text

