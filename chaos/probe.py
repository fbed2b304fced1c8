"""A tiny line echo server and client to prove what the network lets through.

Runs inside the namespace hosts (``python -m chaos.probe ...``) so that a
fault's effect is observed end to end, by real TCP, from both sides::

    python -m chaos.probe serve --port 7000 --log /tmp/x.log
        each received line is appended to the log (flushed) as "<peer-ip> <line>",
        then answered with "echo <line>"
    python -m chaos.probe send 10.213.5.1 7000 --message hi \
            [--connect-timeout 2] [--reply-timeout 2]
        exit status says what happened (see :class:`Outcome`)

The exit statuses let a test tell "could not connect" (SYN or SYN-ACK lost)
from "request sent, reply never came, connection still open" (the one-way
fault) from "connection closed".
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from chaos.netns import Host


class Outcome(enum.IntEnum):
    """Exit status of ``probe send``."""

    REPLIED = 0
    CONNECT_FAILED = 2  # refused, unreachable or timed out while connecting
    NO_REPLY = 3  # connected and sent; no reply in time; connection still open
    CLOSED = 4  # connected and sent; peer closed or reset before replying


async def _serve(host: str, port: int, log: TextIO | None) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        peer_ip = peer[0] if peer else "?"
        try:
            while line := await reader.readline():
                text = line.decode(errors="replace").rstrip("\n")
                if log is not None:
                    # Flushed before replying: a test reads the log to know the
                    # request arrived even when the reply is then lost.
                    log.write(f"{peer_ip} {text}\n")
                    log.flush()
                writer.write(f"echo {text}\n".encode())
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port, reuse_address=True)
    print(f"READY {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def send(host: str, port: int, message: str, connect_timeout: float, reply_timeout: float) -> tuple[Outcome, str]:
    """Connect, send one line, wait for one line back. Never raises for network errors."""
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout)
    except OSError as e:
        return Outcome.CONNECT_FAILED, str(e)
    with sock:
        try:
            sock.sendall(f"{message}\n".encode())
            sock.settimeout(reply_timeout)
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    return Outcome.CLOSED, buf.decode(errors="replace")
                buf += chunk
            return Outcome.REPLIED, buf.decode(errors="replace").rstrip("\n")
        except socket.timeout:
            return Outcome.NO_REPLY, ""
        except OSError as e:
            return Outcome.CLOSED, str(e)


def probe_from(
    src: "Host",
    dst_ip: str,
    port: int,
    message: str = "ping",
    connect_timeout: float = 2.0,
    reply_timeout: float = 2.0,
) -> Outcome:
    """Run ``probe send`` inside ``src`` against ``dst_ip:port``; what happened."""
    res = src.run(
        [sys.executable, "-m", "chaos.probe", "send", dst_ip, str(port), "--message", message,
         "--connect-timeout", str(connect_timeout), "--reply-timeout", str(reply_timeout)],
        timeout=connect_timeout + reply_timeout + 30,
    )
    try:
        return Outcome(res.returncode)
    except ValueError:
        raise RuntimeError(f"probe from {src.name} crashed ({res.returncode}): {res.stderr.strip()}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos.probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="line echo server")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--log", type=Path)
    c = sub.add_parser("send", help="send one line, wait for the echo")
    c.add_argument("host")
    c.add_argument("port", type=int)
    c.add_argument("--message", default="ping")
    c.add_argument("--connect-timeout", type=float, default=2.0)
    c.add_argument("--reply-timeout", type=float, default=2.0)
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        log = open(args.log, "a", encoding="utf-8") if args.log else None
        try:
            asyncio.run(_serve(args.host, args.port, log))
        except KeyboardInterrupt:
            pass
        return 0
    outcome, detail = send(args.host, args.port, args.message, args.connect_timeout, args.reply_timeout)
    print(f"{outcome.name} {detail}", flush=True)
    return int(outcome)


if __name__ == "__main__":
    sys.exit(main())
