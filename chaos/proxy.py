"""A small TCP proxy that the chaos suite steers at run time.

Why it exists: an iptables DROP in one direction breaks TCP both ways (the
handshake's SYN-ACK or the data's ACKs are lost too), so "request delivered,
reply lost" cannot be made with packet filters alone; and this kernel has no
netem qdisc, so delay and loss cannot be made with ``tc`` either. The proxy
terminates TCP on both sides and decides, chunk by chunk, what to forward.

Run (inside a namespace host, or anywhere)::

    python -m chaos.proxy --listen 10.213.5.3:7100 --target 10.213.5.1:7000 \
        --control /tmp/run/proxy.sock --seed 7

``--control`` is a unix socket path (reachable from every namespace: unix
sockets live in the file system, not the network) or a TCP port number bound
on 127.0.0.1 of the proxy's own namespace.

Control protocol: one command per line, one reply line, ``OK [data]`` or
``ERR message``. Words are case-insensitive.

    PING                                  OK pong
    GET                                   OK {"mode": ..., "delay_ms": {...}, "loss_p": ..., ...}
    MODE pass|drop|drop_c2s|drop_s2c      OK
    DELAY <c2s_ms> <s2c_ms>               OK
    LOSS <p> [close|drop]                 OK
    SEED <int>                            OK       (for connections accepted from now on)
    RESET                                 OK <n>   (aborts all n open connections)
    STATS                                 OK {"connections_total": ..., ...}

Semantics (c2s = client to server, s2c = server to client):

- ``drop_*``: bytes read in a dropped direction are discarded, the connection
  stays open and the other direction keeps working; nothing is buffered, so
  lifting the fault does not deliver what was dropped. Connection closes
  (EOF) are still passed on so that dropped connections do not pile up.
- ``DELAY``: a chunk is written once it has been held for the *current* delay
  of its direction; order is kept. Changing the delay applies to chunks
  already held, so lowering it releases them at once.
- ``LOSS p close`` (default): each chunk read, with probability p, aborts the
  whole connection (both sides get a RST) -- a lost connection, which TCP
  applications must survive. ``LOSS p drop``: each chunk is discarded with
  probability p and the connection stays up -- the byte stream then has a
  hole, which tests framing/corruption handling, not network loss.
- Randomness: connection number k (counted from 0 in accept order, or from
  the last SEED) draws, per direction, from ``random.Random("<seed>/<k>/<dir>")``:
  the same seed and the same sequence of chunks give the same decisions.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

if TYPE_CHECKING:
    from chaos.netns import Host

Mode = Literal["pass", "drop", "drop_c2s", "drop_s2c"]
Direction = Literal["c2s", "s2c"]
LossAction = Literal["close", "drop"]
MODES: tuple[str, ...] = get_args(Mode)
DIRECTIONS: tuple[Direction, Direction] = ("c2s", "s2c")
CHUNK = 65536


class ProxyError(RuntimeError):
    """The proxy answered ERR, or could not be reached."""


@dataclass
class ProxySettings:
    """What the proxy does now; changed by control commands."""

    mode: Mode = "pass"
    delay_ms: dict[str, float] = field(default_factory=lambda: {"c2s": 0.0, "s2c": 0.0})
    loss_p: float = 0.0
    loss_action: LossAction = "close"
    seed: int = 0

    def drops(self, direction: Direction) -> bool:
        return self.mode == "drop" or self.mode == f"drop_{direction}"


def parse_addr(text: str) -> tuple[str, int]:
    """``"IP:PORT"`` -> ``(ip, port)``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected IP:PORT, got {text!r}")
    return host, int(port)


class _Conn:
    """One proxied connection: two pipes, aborted together."""

    def __init__(self, index: int, client: asyncio.StreamWriter) -> None:
        self.index = index
        self.writers: list[asyncio.StreamWriter] = [client]
        self.aborted = False

    def abort(self) -> None:
        # abort() rather than close(): the peers should see a reset at once,
        # as after a real connection loss, not a graceful FIN.
        self.aborted = True
        for w in self.writers:
            w.transport.abort()


class Proxy:
    """The proxy's state and logic; :func:`main` runs it under asyncio."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], settings: ProxySettings | None = None) -> None:
        self.listen = listen
        self.target = target
        self.settings = settings or ProxySettings()
        self.stats: collections.Counter[str] = collections.Counter()
        self.conns: set[_Conn] = set()
        self._next_index = 0
        self._held: dict[str, int] = {"c2s": 0, "s2c": 0}  # chunks waiting out a delay
        # Replaced (and the old one set) on every settings change, so that
        # writers holding a delayed chunk re-evaluate the delay at once.
        self._changed = asyncio.Event()
        self._server: asyncio.Server | None = None

    # -- control -------------------------------------------------------------

    def _notify(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    def command(self, line: str) -> str:
        """Execute one control line; the reply line (without newline)."""
        words = line.split()
        if not words:
            return "ERR empty command"
        verb, args = words[0].upper(), words[1:]
        s = self.settings
        try:
            if verb == "PING":
                return "OK pong"
            if verb == "GET":
                return "OK " + json.dumps(asdict(s), sort_keys=True)
            if verb == "STATS":
                data: dict[str, Any] = dict(self.stats)
                data["connections_open"] = len(self.conns)
                data["held_chunks_c2s"] = self._held["c2s"]
                data["held_chunks_s2c"] = self._held["s2c"]
                return "OK " + json.dumps(data, sort_keys=True)
            if verb == "MODE" and len(args) == 1:
                mode = args[0].lower()
                if mode not in MODES:
                    return f"ERR mode must be one of {', '.join(MODES)}"
                s.mode = cast(Mode, mode)
            elif verb == "DELAY" and len(args) == 2:
                c2s, s2c = float(args[0]), float(args[1])
                if not (math.isfinite(c2s) and math.isfinite(s2c)) or c2s < 0 or s2c < 0:
                    return "ERR delays must be finite and >= 0"
                s.delay_ms = {"c2s": c2s, "s2c": s2c}
            elif verb == "LOSS" and len(args) in (1, 2):
                p = float(args[0])
                action = args[1].lower() if len(args) == 2 else "close"
                if not 0.0 <= p <= 1.0 or action not in get_args(LossAction):
                    return "ERR usage: LOSS <p in [0,1]> [close|drop]"
                s.loss_p, s.loss_action = p, cast(LossAction, action)
            elif verb == "SEED" and len(args) == 1:
                s.seed = int(args[0])
                self._next_index = 0
            elif verb == "RESET" and not args:
                conns = list(self.conns)
                for c in conns:
                    c.abort()
                self.stats["resets"] += 1
                return f"OK {len(conns)}"
            else:
                return f"ERR unknown or malformed command: {line.strip()!r}"
        except ValueError as e:
            return f"ERR {e}"
        self._notify()
        return "OK"

    async def _control_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                writer.write((self.command(line.decode(errors="replace")) + "\n").encode())
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def serve_control(self, address: str) -> asyncio.Server:
        """Listen for control commands on a unix socket path, or a loopback port number."""
        if address.isdigit():
            return await asyncio.start_server(self._control_client, "127.0.0.1", int(address))
        path = Path(address)
        path.unlink(missing_ok=True)  # a leftover socket file from a killed proxy
        return await asyncio.start_unix_server(self._control_client, str(path))

    # -- data path -------------------------------------------------------------

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.listen[0], self.listen[1], reuse_address=True)

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        index = self._next_index
        self._next_index += 1
        seed = self.settings.seed
        self.stats["connections_total"] += 1
        conn = _Conn(index, c_writer)
        self.conns.add(conn)
        try:
            try:
                s_reader, s_writer = await asyncio.open_connection(*self.target)
            except OSError:
                self.stats["connect_failures"] += 1
                conn.abort()
                return
            conn.writers.append(s_writer)
            rngs = {d: random.Random(f"{seed}/{index}/{d}") for d in DIRECTIONS}
            queues: dict[str, collections.deque[tuple[float, bytes | None]]] = {
                d: collections.deque() for d in DIRECTIONS
            }
            wake = {d: asyncio.Event() for d in DIRECTIONS}
            tasks = [
                asyncio.create_task(self._read(conn, "c2s", c_reader, queues["c2s"], wake["c2s"], rngs["c2s"])),
                asyncio.create_task(self._write("c2s", s_writer, queues["c2s"], wake["c2s"])),
                asyncio.create_task(self._read(conn, "s2c", s_reader, queues["s2c"], wake["s2c"], rngs["s2c"])),
                asyncio.create_task(self._write("s2c", c_writer, queues["s2c"], wake["s2c"])),
            ]
            try:
                # Returns when all four finish (clean close both ways) or at
                # the first error, which takes the whole connection down.
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                if any(not t.cancelled() and t.exception() is not None for t in done):
                    conn.abort()
            finally:
                for t in tasks:
                    t.cancel()
                # Retrieve every outcome so none is logged as "never retrieved".
                await asyncio.gather(*tasks, return_exceptions=True)
                for d in DIRECTIONS:
                    self._held[d] -= sum(1 for _, data in queues[d] if data is not None)
        finally:
            self.conns.discard(conn)
            for w in conn.writers:
                w.close()

    async def _read(
        self,
        conn: _Conn,
        direction: Direction,
        reader: asyncio.StreamReader,
        queue: collections.deque[tuple[float, bytes | None]],
        wake: asyncio.Event,
        rng: random.Random,
    ) -> None:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                queue.append((time.monotonic(), None))  # EOF, passed on in order
                wake.set()
                return
            self.stats[f"bytes_in_{direction}"] += len(data)
            s = self.settings
            if s.drops(direction):
                self.stats[f"bytes_dropped_{direction}"] += len(data)
                continue
            if s.loss_p > 0.0 and rng.random() < s.loss_p:
                self.stats[f"chunks_lost_{direction}"] += 1
                if s.loss_action == "close":
                    self.stats["connections_lost"] += 1
                    conn.abort()
                    raise ConnectionAbortedError("random loss")
                continue
            queue.append((time.monotonic(), data))
            self._held[direction] += 1
            wake.set()

    async def _write(
        self,
        direction: Direction,
        writer: asyncio.StreamWriter,
        queue: collections.deque[tuple[float, bytes | None]],
        wake: asyncio.Event,
    ) -> None:
        while True:
            if not queue:
                wake.clear()
                await wake.wait()
                continue
            arrived, data = queue[0]
            changed = self._changed
            remaining = arrived + self.settings.delay_ms[direction] / 1000.0 - time.monotonic()
            if remaining > 0:
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except TimeoutError:
                    pass
                continue
            queue.popleft()
            if data is None:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            self._held[direction] -= 1
            writer.write(data)
            self.stats[f"bytes_out_{direction}"] += len(data)
            await writer.drain()


async def _run(args: argparse.Namespace) -> None:
    settings = ProxySettings(
        mode=cast(Mode, args.mode),
        delay_ms={"c2s": args.delay_c2s, "s2c": args.delay_s2c},
        seed=args.seed,
    )
    proxy = Proxy(parse_addr(args.listen), parse_addr(args.target), settings)
    await proxy.start()
    control = await proxy.serve_control(args.control)
    print(f"READY {args.listen} -> {args.target} control {args.control}", flush=True)
    async with control:
        await control.serve_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos.proxy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, help="IP:PORT to accept clients on")
    ap.add_argument("--target", required=True, help="IP:PORT of the server")
    ap.add_argument("--control", required=True, help="unix socket path, or a port on 127.0.0.1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=MODES, default="pass")
    ap.add_argument("--delay-c2s", type=float, default=0.0, metavar="MS")
    ap.add_argument("--delay-s2c", type=float, default=0.0, metavar="MS")
    args = ap.parse_args(argv)
    try:
        asyncio.run(_run(args))
    except KeyboardInterrupt:
        pass
    return 0


# ---------------------------------------------------------------------------
# Client side


class ProxyControl:
    """Synchronous client for the control protocol (one short connection per command).

    ``address`` is the unix socket path, or the control port on 127.0.0.1 --
    the latter only works from inside the proxy's namespace.
    """

    def __init__(self, address: str | int | Path, timeout: float = 5.0) -> None:
        self.address = str(address)
        self.timeout = timeout

    def _connect(self) -> socket.socket:
        if self.address.isdigit():
            return socket.create_connection(("127.0.0.1", int(self.address)), timeout=self.timeout)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.address)
        except OSError:
            sock.close()
            raise
        return sock

    def command(self, line: str) -> str:
        """Send one command; the data after ``OK`` (raises :class:`ProxyError` on ``ERR``)."""
        try:
            with self._connect() as sock:
                sock.sendall((line.strip() + "\n").encode())
                buf = b""
                while not buf.endswith(b"\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
        except OSError as e:
            raise ProxyError(f"proxy control {self.address} unreachable: {e}") from e
        reply = buf.decode().strip()
        if reply == "OK" or reply.startswith("OK "):
            return reply[3:]
        raise ProxyError(f"proxy {self.address}: {line.strip()!r} -> {reply or 'no reply'}")

    def ping(self) -> bool:
        try:
            return self.command("PING") == "pong"
        except ProxyError:
            return False

    def wait_ready(self, timeout: float = 15.0, proc: subprocess.Popen[Any] | None = None) -> "ProxyControl":
        """Poll every 0.05 s until the proxy answers, for at most ``timeout``;
        fail at once if its process has exited."""

        def answers() -> bool:
            if proc is not None and proc.poll() is not None:
                raise ProxyError(f"proxy exited with {proc.returncode} before answering on {self.address}")
            return self.ping()

        retrying = Retrying(stop=stop_after_delay(timeout), wait=wait_fixed(0.05),
                            retry=retry_if_result(lambda up: not up), retry_error_callback=lambda _: False,
                            sleep=time.sleep)
        if retrying(answers):
            return self
        raise ProxyError(f"proxy at {self.address} not answering after {timeout}s")

    def set_mode(self, mode: Mode) -> None:
        self.command(f"MODE {mode}")

    def set_delay(self, c2s_ms: float = 0.0, s2c_ms: float = 0.0) -> None:
        self.command(f"DELAY {c2s_ms} {s2c_ms}")

    def set_loss(self, p: float, action: LossAction = "close") -> None:
        self.command(f"LOSS {p} {action}")

    def reseed(self, seed: int) -> None:
        self.command(f"SEED {seed}")

    def reset(self) -> int:
        """Abort every open connection; how many there were."""
        return int(self.command("RESET"))

    def settings(self) -> dict[str, Any]:
        return cast(dict[str, Any], json.loads(self.command("GET")))

    def stats(self) -> dict[str, int]:
        return cast(dict[str, int], json.loads(self.command("STATS")))


@dataclass
class RunningProxy:
    """A proxy process started on a host, with its control client."""

    proc: subprocess.Popen[Any]
    control: ProxyControl
    listen: tuple[str, int]
    target: tuple[str, int]

    @property
    def address(self) -> str:
        """``ip:port`` that clients connect to instead of the target."""
        return f"{self.listen[0]}:{self.listen[1]}"


def start_proxy(
    host: "Host",
    listen_port: int,
    target: tuple[str, int],
    control_path: str | Path,
    seed: int = 0,
    log_path: Path | None = None,
    timeout: float = 15.0,
) -> RunningProxy:
    """Start ``python -m chaos.proxy`` inside ``host`` (tracked for teardown) and wait until it answers."""
    listen = (host.ip, listen_port)
    out: Any = open(log_path, "ab") if log_path else subprocess.DEVNULL
    cmd = [
        sys.executable, "-m", "chaos.proxy",
        "--listen", f"{listen[0]}:{listen[1]}",
        "--target", f"{target[0]}:{target[1]}",
        "--control", str(control_path),
        "--seed", str(seed),
    ]
    # The child must import this package even when the caller's cwd is not the repo root.
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = host.popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if log_path:
        out.close()
    control = ProxyControl(control_path).wait_ready(timeout, proc)
    return RunningProxy(proc=proc, control=control, listen=listen, target=target)


if __name__ == "__main__":
    sys.exit(main())
