"""The ``phalanx`` commands that talk to the cluster (one ``cmd_*`` handler
each, dispatched by ``REMOTE``), how they connect (``resolve_connection``,
``phalanx config``) and ``run_remote``, which opens the client and runs one.
phalanx.client, gRPC and YAML are imported here only when a command runs
(docs/cli.md "Start-up time")."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.cli.common import EXIT_ERROR, EXIT_OK, UsageError, print_line
from phalanx.cli.output import (
    GANG_HEADERS,
    cluster_event_line,
    describe_full,
    describe_gang,
    dump,
    etcd_space_line,
    event_line,
    format_state_counts,
    gang_rows,
    level_label,
    message_to_dict,
    node_rows,
    node_states_note,
    watch_line,
)
from phalanx.client_names import is_terminal, state_name
from phalanx.text_tables import format_table

if TYPE_CHECKING:  # annotations only: imported by the commands that run
    from phalanx.client import AsyncClient, Connection
    from phalanx.spec import GangSpec


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
        print_line(dump(gang, args.output))
    elif args.output == "wide":
        print_line(format_table(GANG_HEADERS, gang_rows([gang])))
    else:
        print_line(gang.id)
    if not result.created:
        print_line(f"note: gang {gang.id} was already submitted with this idempotency key", sys.stderr)
    return EXIT_OK


async def cmd_get(client: AsyncClient, args: argparse.Namespace) -> int:
    gang = await client.get(args.id)
    print_line(dump(gang, args.output) if args.output in ("json", "yaml") else describe_gang(gang))
    return EXIT_OK


async def cmd_list(client: AsyncClient, args: argparse.Namespace) -> int:
    gangs = await client.list(
        states=args.states, queue=args.queue, owner_az=args.az, name_prefix=args.name_prefix, limit=args.limit
    )
    if args.output in ("json", "yaml"):
        print_line(dump([message_to_dict(g) for g in gangs], args.output))
    elif gangs:
        print_line(format_table(GANG_HEADERS, gang_rows(gangs)))
    else:
        print_line("no gangs")
    return EXIT_OK


async def cmd_watch(client: AsyncClient, args: argparse.Namespace) -> int:
    last_line_key: tuple[Any, ...] | None = None
    async for gang in client.watch(args.id):
        # One line per *visible* change; a record rewrite that changes nothing
        # shown (e.g. a heartbeat timestamp) is not worth a line.
        key = (gang.state, gang.incarnation, gang.reason, len(gang.placement), gang.span)
        if key != last_line_key:
            print_line(watch_line(gang))
            last_line_key = key
        if is_terminal(gang):
            break
    return EXIT_OK


async def cmd_wait(client: AsyncClient, args: argparse.Namespace) -> int:
    from phalanx.client import TerminalStateReached

    try:
        gang = await client.wait(args.id, args.wanted, timeout=args.timeout)
    except TimeoutError as exc:
        print_line(f"error: timed out: {exc}", sys.stderr)
        return EXIT_ERROR
    except TerminalStateReached as exc:
        print_line(f"error: {exc}", sys.stderr)
        return EXIT_ERROR
    print_line(f"gang {gang.id} is {state_name(gang)}")
    return EXIT_OK


async def cmd_cancel(client: AsyncClient, args: argparse.Namespace) -> int:
    gang = await client.cancel(args.id, reason=args.reason)
    print_line(f"gang {gang.id}: {state_name(gang)}" + (f" ({gang.reason})" if gang.reason else ""))
    return EXIT_OK


async def cmd_explain(client: AsyncClient, args: argparse.Namespace) -> int:
    response = await client.explain(args.id)
    if args.output in ("json", "yaml"):
        print_line(dump(response, args.output))
        return EXIT_OK
    gang = response.gang
    print_line(f"gang {gang.id or args.id}: {state_name(gang)}" + (f" ({gang.reason})" if gang.reason else ""))
    if response.summary:
        print_line(response.summary)
    if response.shortfalls:
        print_line("shortfall by domain:")
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
        print_line("\n".join("  " + line for line in table.splitlines()))
    return EXIT_OK


async def cmd_describe(client: AsyncClient, args: argparse.Namespace) -> int:
    gang = await client.get(args.id)
    print_line(dump(gang, args.output) if args.output in ("json", "yaml") else describe_full(gang))
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
            print_line(json.dumps(message_to_dict(e)) if args.output == "json" else event_line(e))
        return EXIT_OK
    async for e in client.watch_events(args.id):
        print_line(json.dumps(message_to_dict(e)) if args.output == "json" else event_line(e))
    return EXIT_OK


async def cmd_cluster_events(client: AsyncClient, args: argparse.Namespace) -> int:
    if args.no_follow:
        raise UsageError("--no-follow: the cluster stream has no history to print; name a gang ID")
    where = f"queue {args.queue}" if args.queue else "every queue"

    def opened() -> None:
        # On stderr: stdout carries only events (one JSON object a line with -o json).
        print(f"following new gang events of {where} (Ctrl-C stops)", file=sys.stderr, flush=True)

    async for ce in client.watch_cluster_events(args.queue, on_open=opened):
        print_line(json.dumps(message_to_dict(ce)) if args.output == "json" else cluster_event_line(ce))
    return EXIT_OK


async def cmd_nodes(client: AsyncClient, args: argparse.Namespace) -> int:
    nodes = await client.nodes(az=args.az)
    if args.output in ("json", "yaml"):
        print_line(dump([message_to_dict(n) for n in nodes], args.output))
    elif nodes:
        print_line(format_table(["NODE", "AZ", "SPINE/LEAF", "READY", "GPUS USED/TOTAL", "HEARTBEAT", "REASON"], node_rows(nodes)))
    else:
        print_line("no nodes")
    return EXIT_OK


async def cmd_status(client: AsyncClient, args: argparse.Namespace) -> int:
    st = await client.status()
    if args.output in ("json", "yaml"):
        print_line(dump(st, args.output))
        return EXIT_OK
    # Which cluster answered, and where: two local clusters on one machine
    # may both answer on ports that look like the default.
    print_line(f"cluster {st.cluster or '-'} (answered by {st.served_by or 'a coordinator'} at {client.last_address})")
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
        print_line(format_table(["AZ", "LEADER", "ADDRESS", "EPOCH", "NODES READY/TOTAL", "GPUS FREE/TOTAL"], rows))
    else:
        print_line("no AZs")
    counts = dict(st.gangs_by_state)
    print_line("gangs: " + (format_state_counts(counts) or "none"))
    print_line(etcd_space_line(st.etcd))
    return EXIT_OK


async def cmd_topology(client: AsyncClient, args: argparse.Namespace) -> int:
    # Imported here so every other command works without the view module.
    from phalanx.topology_view import render_tree
    from phalanx.wire import topology_from_pb

    nodes = await client.nodes(az=args.az)
    entries = [(topology_from_pb(n.topology), frozenset(n.used_gpus), bool(n.ready)) for n in nodes]
    print_line(render_tree(entries))
    return EXIT_OK


async def cmd_top(client: AsyncClient, args: argparse.Namespace) -> int:
    from phalanx.top import run_top  # here: rich is needed by top only

    return await run_top(client, once=args.once, watch=args.watch, interval=args.interval, rows=args.rows,
                         output=args.output)


async def cmd_policy(client: AsyncClient, args: argparse.Namespace) -> int:
    """``phalanx policy get`` / ``set`` (docs/security.md "Policy as data")."""
    import yaml

    if args.action == "get":
        policy, record = await client.get_policy()
        if args.output == "json":
            print_line(json.dumps({"revision": record.revision, "set_by": record.set_by, "set_at": record.set_at,
                               "policy": policy}, indent=2, sort_keys=True))
            return EXIT_OK
        when = f" at {datetime.datetime.fromtimestamp(record.set_at, datetime.timezone.utc).isoformat(timespec='seconds')}" \
            if record.set_at else ""
        who = f", set by {record.set_by}{when}" if record.set_by else ""
        print_line(f"# revision: {record.revision}{who}" + (" (no policy stored: the defaults)" if not record.revision else ""))
        print_line(yaml.safe_dump(policy, sort_keys=True).rstrip("\n"))
        return EXIT_OK
    policy = read_policy_file(args.file)
    record = await client.set_policy(policy, args.revision)
    print_line(f"policy set: revision {record.revision} (by {record.set_by or 'an unauthenticated caller'})")
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
        print_line(f"node {where} {args.action}ed")
        return EXIT_OK
    if args.action == "delete":
        held = await client.delete_node(args.az, args.node, force=args.force)
        print_line(f"node {where} deleted" + (f" (gangs {', '.join(held)} held its devices)" if held else ""))
        return EXIT_OK
    answer = await client.drain(args.az, args.node, requeue=args.requeue, timeout=args.timeout)
    if answer.requeued:
        print_line(f"restarted on other nodes: {', '.join(answer.requeued)}")
    if answer.gangs:
        print_line(f"error: node {where} still holds devices of {', '.join(answer.gangs)} after {args.timeout:g}s "
               "(it stays cordoned)", file=sys.stderr)
        return EXIT_ERROR
    print_line(f"node {where} drained: cordoned, it holds no devices")
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
    print_line(f"addresses: {','.join(conn.addresses)} (from {conn.addresses_from})")
    if conn.tls_dir is None:
        print_line(f"tls: off, plaintext (from {conn.tls_from})")
        return EXIT_OK
    try:
        files, cluster = client_tls(conn.tls_dir)
    except TlsError as exc:
        raise UsageError(f"{conn.tls_from}: TLS: {exc}") from None
    from phalanx.tls import load, utc_now

    loaded = load(files, cluster=cluster, use="client", now=utc_now())
    print_line(f"tls: {conn.tls_dir} (from {conn.tls_from})")
    print_line(f"cluster: {cluster} (the CA in {files.ca})")
    print_line(f"identity: {loaded.identity.uri()} (until {loaded.cert.not_valid_after_utc.isoformat()})")
    return EXIT_OK


async def run_remote(args: argparse.Namespace) -> int:
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
                print_line(yaml.safe_dump(spec.to_dict(), sort_keys=False, allow_unicode=True).rstrip("\n"))
                return EXIT_OK
            return await cmd_submit(client, args, spec)
        return await REMOTE[args.command](client, args)
