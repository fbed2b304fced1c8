"""``phalanx up`` run from Python (tests, benchmarks, demos) as a child
process: ``UpProcess`` (docs/local-cluster.md, From Python)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from phalanx import procs
from phalanx.up.config import REPO_ROOT
from phalanx.up.credentials import ACTIVATION_LINE

METRICS_LINE = re.compile(r"^phalanx up: metrics (\S+) (https?://\S+/metrics)$")


class UpProcess:
    """``phalanx up ARGS`` in a child process: start it, wait for its
    ``PHALANX_ADDRESS`` line, stop it with a signal.

        with UpProcess(["--no-workload", "--azs", "2", "--base-port", "0"]) as up:
            client = Client(up.address)
    """

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.args = list(args)
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.address = ""
        self.state_dir: Path | None = None
        self.config: Path | None = None  # the client config it wrote
        self.activation = ""  # the `export PATH=... PHALANX_CONFIG=...` line it printed
        self._cond = threading.Condition()
        self._eof = False  # the reader has seen the end of the output
        self._reader: threading.Thread | None = None

    @property
    def addresses(self) -> list[str]:
        return self.address.split(",") if self.address else []

    def metrics_urls(self) -> dict[str, str]:
        """Process name (``az-a-c0``, ``az-a-agents``, ...) -> its /metrics
        URL, from the lines ``up`` printed."""
        found = (METRICS_LINE.match(line) for line in self.lines)
        return {m.group(1): m.group(2) for m in found if m}

    def start(self, timeout: float = 240.0) -> "UpProcess":
        # SIGTERM when the caller dies (a killed test run): `up` then cleans up.
        self.proc = procs.spawn(
            [sys.executable, "-m", "phalanx", "up", *self.args], die_with_parent=procs.TERM,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=self.env, cwd=str(REPO_ROOT),
        )
        self._reader = threading.Thread(target=self._read, name="phalanx-up-output", daemon=True)
        self._reader.start()
        m = self.wait_for_line(r"^PHALANX_ADDRESS=(\S+)$", timeout)
        self.address = m.group(1)
        sd = self.find_line(r"^phalanx up: state dir (\S+) ")
        self.state_dir = Path(sd.group(1)) if sd else None
        cf = self.find_line(r"^PHALANX_CONFIG=(\S+)$")
        self.config = Path(cf.group(1)) if cf else None
        # Printed right after PHALANX_ADDRESS: what a user pastes into a new shell.
        self.activation = self.wait_for_line(ACTIVATION_LINE.pattern, timeout).group(0)
        return self

    @property
    def admin_dir(self) -> Path | None:
        """The admin client dir the config names (what ``Client(tls_dir=...)``
        takes); None with --insecure."""
        if self.config is None:
            return None
        doc = yaml.safe_load(self.config.read_text())
        return (self.config.parent / doc["tls_dir"]).resolve() if doc.get("tls_dir") else None

    def client_kwargs(self) -> dict[str, Any]:
        """``Client``/``AsyncClient`` keyword arguments for this cluster."""
        admin = self.admin_dir
        return {"tls_dir": admin} if admin is not None else {"insecure": True}

    def client_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment in which the CLI reaches this cluster as ``up``
        told the user to (``PHALANX_CONFIG``, or the addresses in plaintext)."""
        env = dict(os.environ if base is None else base)
        for name in ("PHALANX_ADDRESS", "PHALANX_TLS_DIR", "PHALANX_INSECURE", "PHALANX_CONFIG"):
            env.pop(name, None)
        if self.config is not None:
            env["PHALANX_CONFIG"] = str(self.config)
        return env

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:  # drains the pipe so `up` never blocks on it
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def find_line(self, pattern: str) -> re.Match[str] | None:
        rx = re.compile(pattern)
        with self._cond:
            for line in self.lines:
                m = rx.search(line)
                if m:
                    return m
        return None

    def wait_for_line(self, pattern: str, timeout: float, after: int = 0) -> re.Match[str]:
        """The first output line (from index ``after``) matching ``pattern``."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = after
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = max(seen, len(self.lines))
                # Exited *and* every line it wrote read (a last line may still
                # be in the pipe when the process is already gone).
                exited = self.proc is not None and self.proc.poll() is not None and self._eof
                left = deadline - time.monotonic()
                if exited or left <= 0:
                    why = f"exited with code {self.proc.returncode}" if exited and self.proc else f"no match after {timeout:g}s"
                    raise RuntimeError(f"phalanx up {why} waiting for {pattern!r}; output:\n" + "\n".join(self.lines[-60:]))
                self._cond.wait(min(left, 0.5))

    def stop(self, sig: int = signal.SIGINT, timeout: float = 120.0) -> int:
        """Signal ``up`` and wait for it; SIGKILL (its group) after ``timeout``."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # `up` is stuck: kill what it started (each child leads its
                # own group), then `up` itself.
                for pgid in child_groups(self.proc.pid):
                    try:
                        os.killpg(pgid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)  # every line in self.lines
        return self.proc.returncode

    def __enter__(self) -> "UpProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def proc_stat(pid: int) -> tuple[int, int, int, str] | None:
    """(ppid, pgid, sid, state) of a live process from /proc; None if gone."""
    fields = procs.stat_fields(pid)
    if fields is None:
        return None
    return int(fields[1]), int(fields[2]), int(fields[3]), fields[0].decode()


def child_groups(pid: int) -> set[int]:
    """Process groups of the direct children of ``pid`` (Linux /proc)."""
    groups = set()
    for p in procs.pids():
        st = proc_stat(p)
        if st is not None and st[0] == pid:
            groups.add(st[1])
    return groups
