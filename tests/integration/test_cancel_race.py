"""Cancels that race a gang's start, with REAL member processes (issue 26).

Rounds of gangs (2 members x 1 GPU, filling both nodes) are each cancelled
at a random point 0-300 ms after its submission was acknowledged: while it
waits, while its reservation is written, while its assignments travel or
its agents check their token and launch, or once it runs. A cancel the
server answers ABORTED would be retried (as the SDK does); none should be.
After each round, on observed facts only: every gang terminal in etcd, no
reservation left holding its devices, and no process of any of its members
alive on this host (found by the environment the agent gave them, whatever
any record says), within the stop grace plus the fence bound. Before the
fix (7e1ec24) the single-AZ test failed 4 runs of 4: a member that started
after its gang's only revocation ran on, its devices held RELEASING for good.

The cross-AZ test does the same on the two-phase path with simulated
agents; it passed before the fix too (its agents start members without the
wait that opened the race), and guards the path against a regression.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path
from typing import Awaitable, Callable

import grpc
import pytest

from phalanx.model import GangState
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import LocalCluster, dgx_node, tiny, until
from tests.integration.test_gang_events_cluster import stop
from tests.integration.test_gang_runtime import AZ, agent_proc, gang_pids
from tests.members import MEMBER_PYTHON, member_tmp, writable  # noqa: F401 (member_tmp: a fixture)

pytestmark = pytest.mark.integration

ROUNDS = 8
GANGS_PER_ROUND = 8  # 2 x 1 GPU each: both 8-GPU nodes, full
CROSS_AZ_ROUNDS = 8
CROSS_AZ_GANGS_PER_ROUND = 3  # 3 x 8 GPUs each: one at a time on the four nodes
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


async def race_rounds(c: LocalCluster, spec: Callable[[str], pb.GangSpec], rounds: int, per_round: int,
                      live: Callable[[str], Awaitable[list]]) -> None:
    """Rounds of ``per_round`` gangs (``spec(name)``), each cancelled at a
    random point 0-CANCEL_WITHIN_S after its submission's ack (retried on
    ABORTED); after each round, wait (on observed facts) for every gang
    terminal, its reservations gone in every AZ and ``live(gang)`` (what
    of its members still runs) empty. Then every gang is CANCELLED, etcd's
    accounting exact, and no cancel was answered ABORTED."""
    rnd = random.Random(SEED)
    t = c.timings
    # A member of a torn-down gang is gone within the stop grace once its
    # agent hears the revocation, and by its own fencing at the latest
    # (replace_after_s); the rest is slack for loaded CI cores.
    bound = t.stop_grace_s + t.replace_after_s + 30
    aborted: list[str] = []
    every: list[str] = []
    for r in range(rounds):
        async def one(i: int) -> str:
            g = await c.submit(spec(f"race-{r}-{i}"))
            # The cancel's point in the start: the stimulus, not a wait.
            await asyncio.sleep(rnd.uniform(0, CANCEL_WITHIN_S))
            await cancel_until_taken(c, g.id, aborted)
            return g.id

        ids = await asyncio.gather(*(one(i) for i in range(per_round)))
        every += ids

        async def settled() -> bool:
            gangs = await c.etcd_gangs()
            if any(not gangs[i].state.terminal for i in ids):
                return False
            if any(gang in ids for _, gang in await c.etcd_reservations()):
                return False
            return not any([await live(i) for i in ids])

        try:
            await until(f"round {r}: every gang terminal, its reservations gone and its members gone",
                        settled, timeout=bound)
        except TimeoutError:
            gangs = await c.etcd_gangs()
            left = {i: (gangs[i].state.name, await live(i)) for i in ids}
            held = sorted((az, g) for az, g in await c.etcd_reservations() if g in ids)
            raise AssertionError(f"round {r} (seed {SEED}): live members of ended gangs "
                                 f"{ {i: v for i, v in left.items() if v[1]} }; reservations left {held}; "
                                 f"ABORTED answers {aborted}") from None
    gangs = await c.etcd_gangs()
    assert all(gangs[i].state == GangState.CANCELLED for i in every), {i: gangs[i].state.name for i in every}
    assert await c.check_etcd_invariants() == []
    # The server retried every cancel that lost a compare to a write of the
    # gang's start: the client never saw ABORTED for a live gang.
    assert aborted == []


async def test_cancels_racing_the_start_leave_no_member_and_no_reservation(local_cluster: LocalCluster,
                                                                           tmp_path: Path) -> None:
    """Single-AZ gangs, real agent processes, real member processes."""
    c = local_cluster
    c.start_coordinator(AZ, "a0")
    await c.wait_leader(AZ)
    agents = [agent_proc(c, n, tmp_path / f"state-{n}", tmp_path / f"hist-{n}.jsonl") for n in ("n0", "n1")]
    try:
        await c.wait_nodes_ready(AZ, 2)
        member = [MEMBER_PYTHON, "-c", "import time; time.sleep(600)"]

        def spec(name: str) -> pb.GangSpec:
            return pb.GangSpec(name=name, members=2, resources=pb.Resources(gpus=1), run=pb.RunSpec(command=member))

        async def live(gang: str) -> list[int]:
            return sorted(gang_pids(gang))

        await race_rounds(c, spec, ROUNDS, GANGS_PER_ROUND, live)
    finally:
        stop(agents)


async def test_cancels_racing_a_cross_az_start_leave_no_member_and_no_hold(local_cluster: LocalCluster) -> None:
    """The two-phase path: gangs of 3 x 8 GPUs over two AZs of two 8-GPU
    nodes each (so every one spans both AZs), simulated agents in this
    process (their members are timers: what runs is read from the agents'
    own records of starts and exits), cancelled while they wait, while their
    attempt is prepared or committed, while their members are dispatched in
    both AZs, or once they run."""
    c = local_cluster
    azs = ("az-a", "az-b")
    for az in azs:
        c.start_coordinator(az, f"{az[-1]}0")
    for az in azs:
        await c.wait_leader(az)
        c.start_agents(az, [dgx_node(f"{az[-1]}n{i}", az) for i in range(2)])
    for az in azs:
        await c.wait_nodes_ready(az, 2)

    def spec(name: str) -> pb.GangSpec:
        return tiny(name, members=3, gpus=8, duration=600.0, topology=pb.TopologyConstraint(allow_cross_az=True))

    async def live(gang: str) -> list[str]:
        started, exited = set(), set()
        for group in c.agent_groups:
            for event, detail in list(group.history):
                if str(detail.get("key", "")).startswith(f"{gang}#"):
                    (started if event == "member_started" else exited if event == "member_exited" else set()).add(
                        detail["key"])
        return sorted(started - exited)

    await race_rounds(c, spec, CROSS_AZ_ROUNDS, CROSS_AZ_GANGS_PER_ROUND, live)
