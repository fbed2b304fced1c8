"""Forking children (subprocess with a preexec_fn: phalanx/procs.py) while
gRPC threads are busy must not break the parent's gRPC: phalanx/__init__.py
turns gRPC's fork support off before grpc loads. With it on, this very
program logs "epoll_wait error: Bad file descriptor" and can abort."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROGRAM = r"""
import subprocess, sys, threading
sys.path.insert(0, sys.argv[1])
import phalanx.store  # imports phalanx, then grpc, as every entry point does
import grpc
from concurrent import futures
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(4))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
stop = threading.Event()
def busy():
    while not stop.is_set():
        stub.Check(health_pb2.HealthCheckRequest())
threads = [threading.Thread(target=busy) for _ in range(3)]
for t in threads:
    t.start()
for _ in range(40):
    subprocess.run(["true"], preexec_fn=lambda: None, check=True)
stop.set()
for t in threads:
    t.join()
server.stop(0)
print("ok")
"""


def test_forking_while_grpc_is_busy_is_clean() -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(REPO)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
    for sign in ("Bad file descriptor", "fork_posix", "Kick failed"):
        assert sign not in done.stderr, done.stderr[-2000:]
