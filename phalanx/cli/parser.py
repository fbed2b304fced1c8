"""The ``phalanx`` command line: ``build_parser`` (every command and flag),
the flag types that range-check values, ``--version``, and ``PASSTHROUGH``,
the server-side processes reachable as ``phalanx <name> ...``. Usage errors
print one ``error:`` line and exit 2 (``_Parser.error``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from phalanx.cli.common import EXIT_INVALID, STATE_DIR_ENV
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
    parse_states,
)

# Server-side processes, reachable as `phalanx <name> ...`; their own
# argument parsers take the rest of the command line.
PASSTHROUGH = {
    "coordinator": ("coordinator.__main__", "run one coordinator replica (python -m coordinator)"),
    "agent": ("agent.__main__", "run one node agent with topology discovery (python -m agent)"),
    "agents-sim": ("agent.sim", "run many simulated node agents in one process (python -m agent.sim)"),
    "chaos": ("chaos.run", "chaos suite: `phalanx chaos run [--scenario NAME|--all] [--seeds N]`"),
}


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
