"""Cancels that race a gang's start, with REAL member processes (issue 26).

Rounds of gangs (2 members x 1 GPU, filling both nodes) are each cancelled
at a random point 0-300 ms after its submission was acknowledged: while it
waits, while its reservation is written, while its assignments travel or
its agents check their token and launch, or once it runs. A cancel the
server answers ABORTED would be retried (as the SDK does); none should be.
After each round, on observed facts only: every gang terminal in etcd, no
reservation left holding its devices, and no process of any of its members
alive on this host (found by the environment the agent gave them, whatever
any record says), within the stop grace plus the fence bound.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import grpc
import pytest

from phalanx.model import GangState
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import LocalCluster, until
from tests.integration.test_gang_events_cluster import stop
from tests.integration.test_gang_runtime import AZ, agent_proc, gang_pids
from tests.members import MEMBER_PYTHON, member_tmp, writable  # noqa: F401 (member_tmp: a fixture)

pytestmark = pytest.mark.integration

ROUNDS = 8
GANGS_PER_ROUND = 8  # 2 x 1 GPU each: both 8-GPU nodes, full
CANCEL_WITHIN_S = 0.3
SEED = int(os.environ.get("PHALANX_CANCEL_RACE_SEED", "26"))


@pytest.fixture
def tmp_path(member_tmp: Path) -> Path:
    return writable(member_tmp / "t")


async def cancel_until_taken(c: LocalCluster, gang_id: str, aborted: list[str]) -> None:
    """CancelGang, retried on ABORTED (what the server says a retry may
    fix, and what the SDK retries); each ABORTED is noted."""
    while True:
        try:
            await c.stub().CancelGang(gpb.CancelGangRequest(id=gang_id, reason="race"), timeout=15)
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED:
                raise
            aborted.append(f"{gang_id}: {exc.details()}")


async def test_cancels_racing_the_start_leave_no_member_and_no_reservation(local_cluster: LocalCluster,
                                                                           tmp_path: Path) -> None:
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    agents = [agent_proc(c, n, tmp_path / f"state-{n}", tmp_path / f"hist-{n}.jsonl") for n in ("n0", "n1")]
    try:
        await c.wait_nodes_ready(AZ, 2)
        rnd = random.Random(SEED)
        member = [MEMBER_PYTHON, "-c", "import time; time.sleep(600)"]
        t = c.timings
        # A member of a torn-down gang is gone within the stop grace once its
        # agent hears the revocation, and by its own fencing at the latest
        # (replace_after_s); the rest is slack for loaded CI cores.
        bound = t.stop_grace_s + t.replace_after_s + 30
        aborted: list[str] = []
        every: list[str] = []
        for r in range(ROUNDS):
            async def one(i: int) -> str:
                spec = pb.GangSpec(name=f"race-{r}-{i}", members=2, resources=pb.Resources(gpus=1),
                                   run=pb.RunSpec(command=member))
                g = await c.submit(spec)
                # The cancel's point in the start: the stimulus, not a wait.
                await asyncio.sleep(rnd.uniform(0, CANCEL_WITHIN_S))
                await cancel_until_taken(c, g.id, aborted)
                return g.id

            ids = await asyncio.gather(*(one(i) for i in range(GANGS_PER_ROUND)))
            every += ids

            async def settled() -> bool:
                gangs = await c.etcd_gangs()
                if any(not gangs[i].state.terminal for i in ids):
                    return False
                if any(gang in ids for _, gang in await c.etcd_reservations()):
                    return False
                return not any(gang_pids(i) for i in ids)

            try:
                await until(f"round {r}: every gang terminal, its reservation gone and its members' processes gone",
                            settled, timeout=bound)
            except TimeoutError:
                gangs = await c.etcd_gangs()
                left = {i: (gangs[i].state.name, sorted(gang_pids(i))) for i in ids if gang_pids(i)}
                held = sorted((az, g) for az, g in await c.etcd_reservations() if g in ids)
                raise AssertionError(f"round {r} (seed {SEED}): live members of ended gangs {left}; "
                                     f"reservations left {held}; ABORTED answers {aborted}") from None
        gangs = await c.etcd_gangs()
        assert all(gangs[i].state == GangState.CANCELLED for i in every), {i: gangs[i].state.name for i in every}
        assert await c.check_etcd_invariants() == []
        # The server retried every cancel that lost a compare to a write of
        # the gang's start: the client never saw ABORTED for a live gang.
        assert aborted == []
    finally:
        stop(agents)
