"""The chaos suite's bounded retries and polls (tenacity): they stop at their
budget with the error they promise, retry only what is retryable, and say at
once when the machine cannot run a check at all (a missing program)."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from chaos import recorder
from chaos.faults import Fault, HealthCheckFailed
from chaos.netns import ChaosEnvironmentError, Host
from chaos.proxy import ProxyControl, ProxyError
from chaos.workload import Recorder, Workload, plan
from phalanx import procs
from phalanx.store import Store, StoreUnavailable
from phalanx.etcd_server import free_port
from tests.pki import EtcdPki

ROOT = Path(__file__).resolve().parents[2]


class Noop(Fault):
    """A fault that changes nothing: only the health-check waits are under test."""

    def _inject(self) -> None:
        pass

    def _heal(self) -> None:
        pass


class Flaky:
    """A health check that fails ``failures`` times (returning False or raising ``error``), then passes."""

    def __init__(self, failures: int, error: BaseException | None = None) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        if self.calls > self.failures:
            return True
        if self.error is not None:
            raise self.error
        return False


# --- Fault health-check waits ------------------------------------------------------------------------

def test_inject_waits_for_a_check_that_passes_later() -> None:
    check, other = Flaky(2), Flaky(0)
    fault = Noop("noop", before=[check, other], settle_timeout=30)
    fault.inject()
    assert fault.active and check.calls == 3 and other.calls == 1


def test_a_check_that_never_passes_fails_with_its_last_answer() -> None:
    never = Flaky(10**9)
    with pytest.raises(HealthCheckFailed, match=r"noop: health check .* returned false before inject \(waited 0.3s\)"):
        Noop("noop", before=[never], settle_timeout=0.3).inject()
    assert never.calls >= 1
    raising = Flaky(10**9, ValueError("boom"))
    with pytest.raises(HealthCheckFailed, match=r"raised ValueError: boom before inject"):
        Noop("noop", before=[raising], settle_timeout=0.3).inject()


def test_a_check_that_raises_then_passes_is_retried() -> None:
    check = Flaky(2, ConnectionError("not yet"))
    fault = Noop("noop", after=[check], settle_timeout=30)
    fault.inject()
    fault.heal()
    assert not fault.active and check.calls == 3


def test_a_missing_program_is_said_at_once_not_after_the_settle_timeout(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no etcdctl
    host = Host("ctl", None, "phxunit-ctl", "10.213.0.1", None)  # type: ignore[arg-type]  # wrap() needs no cluster
    calls = []

    def etcd_healthy() -> bool:
        calls.append(1)
        return host.run(["etcdctl", "endpoint", "health"]).returncode == 0

    with pytest.raises(ChaosEnvironmentError, match=r"chaos suite cannot run here: program 'etcdctl' not found on "
                                                    r"PATH \(Debian package etcd-client; scripts/setup.sh installs it\)"):
        Noop("noop", before=[etcd_healthy], settle_timeout=600).inject()
    assert calls == [1]


# --- the proxy's readiness poll ------------------------------------------------------------------------------

def test_wait_ready_returns_when_a_real_proxy_answers(tmp_path: Path) -> None:
    control = tmp_path / "control.sock"
    proc = procs.spawn([sys.executable, "-m", "chaos.proxy", "--listen", f"127.0.0.1:{free_port()}",
                         "--target", f"127.0.0.1:{free_port()}", "--control", str(control)],
                        die_with_parent=procs.KILL, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ctl = ProxyControl(control).wait_ready(60, proc)
        assert ctl.ping()
    finally:
        proc.kill()
        proc.wait()


def test_wait_ready_fails_at_once_when_the_proxy_exited(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(ProxyError, match="proxy exited with 3 before answering"):
        ProxyControl(tmp_path / "none.sock").wait_ready(600, proc)


def test_wait_ready_gives_up_after_its_timeout(tmp_path: Path) -> None:
    with pytest.raises(ProxyError, match=r"not answering after 0.2s"):
        ProxyControl(tmp_path / "none.sock").wait_ready(0.2)


# --- the workload's retried calls -------------------------------------------------------------------------------

def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"{code.name} here")


async def retried(codes: list[grpc.StatusCode | None], **kw: Any) -> tuple[tuple, list[dict]]:
    """Run Workload._retrying over a call that fails with ``codes`` in turn (None: answers)."""
    out = io.StringIO()
    wl = Workload({"a": ["127.0.0.1:1", "127.0.0.1:2"]}, Recorder(out, probe=False), **kw)
    p = next(x for x in plan(1, 10, 1.0, ("a",)) if x.az == "a")
    answers = iter(codes)

    async def call(stub: Any) -> str:
        code = next(answers, grpc.StatusCode.UNAVAILABLE)
        if code is None:
            return "answer"
        raise rpc_error(code)

    try:
        result = await wl._retrying("submit", p, p.key, call)
    finally:
        await wl.close()
    return result, [json.loads(line) for line in out.getvalue().splitlines()]


async def test_retryable_codes_are_retried_on_the_next_coordinator() -> None:
    (ok, code, res, attempts, _), lines = await retried(
        [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, None], retry_pause=0.01)
    assert (ok, code, attempts) == (True, "OK", 3) and res[0] == "answer"
    assert [(ln["attempt"], ln["code"]) for ln in lines] == [(1, "UNAVAILABLE"), (2, "DEADLINE_EXCEEDED")]
    targets = [ln["target"] for ln in lines] + [res[1]]
    assert targets[0] != targets[1] and targets[0] == targets[2]  # round the AZ's coordinators


async def test_a_final_code_is_not_retried() -> None:
    (ok, code, res, attempts, _), lines = await retried([grpc.StatusCode.INVALID_ARGUMENT, None])
    assert (ok, code, attempts) == (False, "INVALID_ARGUMENT", 1)
    assert isinstance(res, grpc.aio.AioRpcError) and len(lines) == 1


async def test_retries_end_at_the_budget_with_the_last_error() -> None:
    (ok, code, res, attempts, _), lines = await retried([], retry_budget=0.3, retry_pause=0.05)
    assert (ok, code) == (False, "UNAVAILABLE") and isinstance(res, grpc.aio.AioRpcError)
    assert len(lines) == attempts >= 1  # every attempt was recorded


# --- the recorder's final read ----------------------------------------------------------------------------------

async def test_dump_gives_up_with_store_unavailable_after_its_timeout(tmp_path) -> None:
    # With etcd client credentials, as the chaos recorder runs (TLS is the default).
    pki = EtcdPki(tmp_path / "etcd-pki")
    tls = pki.role("unit", "coordinator")
    store = await Store([f"127.0.0.1:{free_port()}"], "unit", timeout=0.2, tls=tls).connect()  # nothing listens there
    try:
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(recorder.dump(store, timeout=0.5), timeout=60)
    finally:
        await store.close()
