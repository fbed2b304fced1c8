"""The ``phalanx`` command: submit and inspect gangs, run a local cluster.

Exit codes (docs/cli.md):
  0  success (``wait``: the wanted state was reached)
  1  any other error: server error, unreachable cluster, ``wait`` timed out or
     the gang ended in another terminal state
  2  invalid input: a bad gang spec (checked locally, before anything is sent),
     a bad flag, or a request the server rejected as INVALID_ARGUMENT
  130 interrupted (Ctrl-C)

Expected errors print one ``error: <message>`` line on stderr, never a
traceback; usage errors too (``parser.py``).

Start-up time (docs/cli.md "Start-up time"): this package imports neither
gRPC, protobuf, cryptography, asyncio nor YAML; each command imports what it
needs when it runs, so ``--help``, ``--version`` and a usage error cost only
the parser. ``tests/unit/test_cli_startup.py`` keeps it so.

The package, by responsibility (docs/design.md §2): ``parser.py`` (every
command and flag), ``output.py`` (how answers are shown), ``remote.py`` (the
commands that talk to the cluster, and how they connect), ``local.py``
(``logs``, ``certs``, ``etcd-auth``), ``common.py`` (exit codes,
``UsageError``); here, ``main`` and ``run``, which dispatch a command and turn
expected errors into exit codes. Every name is importable from
``phalanx.cli`` as before the split (the console script is
``phalanx.cli:main``; ``python -m phalanx.cli`` runs ``__main__.py``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

# Every name callers and tests use from phalanx.cli, as before the split.
from phalanx.cli.common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, STATE_DIR_ENV, UsageError, print_line
from phalanx.cli.local import (
    FOLLOW_POLL_S,
    FOLLOW_SETTLE_S,
    cmd_certs,
    cmd_certs_etcd,
    cmd_etcd_auth,
    cmd_logs,
    follow_logs,
    log_roots,
    resolve_log_gang,
)
from phalanx.cli.output import (
    GANG_HEADERS,
    age_since,
    cluster_event_line,
    describe_full,
    describe_gang,
    dump,
    etcd_space_line,
    event_line,
    format_state_counts,
    gang_gpus,
    gang_rows,
    level_label,
    message_to_dict,
    node_rows,
    node_states_note,
    watch_line,
)
from phalanx.cli.parser import PASSTHROUGH, build_parser
from phalanx.cli.remote import (
    REMOTE,
    cmd_cancel,
    cmd_cluster_events,
    cmd_config,
    cmd_describe,
    cmd_events,
    cmd_explain,
    cmd_get,
    cmd_list,
    cmd_node,
    cmd_nodes,
    cmd_policy,
    cmd_status,
    cmd_submit,
    cmd_top,
    cmd_topology,
    cmd_wait,
    cmd_watch,
    read_policy_file,
    read_spec_file,
    resolve_connection,
    run_remote,
)
from phalanx.client_names import ADDRESS_ENV, CONFIG_ENV, DEFAULT_ADDRESS, INSECURE_ENV, TLS_DIR_ENV
from phalanx.text_tables import format_age, format_table

if TYPE_CHECKING:
    import argparse

    from phalanx.errors import PhalanxError


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

        return asyncio.run(run_remote(args))
    except UsageError as exc:
        print_line(f"error: {exc}", sys.stderr)
        return EXIT_INVALID
    except ImportError as exc:
        # topology/logs need modules that may not be installed in this build.
        print_line(f"error: {args.command} is not available: {exc}", sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print_line("interrupted", sys.stderr)
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
        print_line(f"error: {exc}", sys.stderr)
        return EXIT_INVALID
    if isinstance(exc, InvalidArgument):
        print_line(f"error: invalid argument: {_one_line(exc)}", sys.stderr)
        return EXIT_INVALID
    if isinstance(exc, PhalanxError):
        print_line(f"error: {_one_line(exc)}", sys.stderr)
        return EXIT_ERROR
    if isinstance(exc, TlsError):  # a TLS file that changed under a running command
        print_line(f"error: TLS: {exc}", sys.stderr)
        return EXIT_ERROR
    return None


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
        print_line(f"error: {prog}: unrecognized arguments: {' '.join(extra)} (see {prog} --help)", sys.stderr)
        return EXIT_INVALID
    if args.command is None:
        print_line("error: phalanx: a command is required (see phalanx --help)", sys.stderr)
        return EXIT_INVALID
    return run(args)


def _one_line(exc: PhalanxError) -> str:
    """A server's message on one line, followed by who answered (the
    cluster's name and the coordinator: two local clusters may both answer
    on ports that look like the default)."""
    text = " ".join(str(exc).split())
    origin = exc.origin
    return f"{text} [{origin}]" if origin else text

