"""The harness's strict teardown (docs/testing.md "Strict teardown"): what a
cluster's coordinators log at ERROR or as a traceback, what its in-process
agents log at ERROR, and an agent task that ends with an exception are found
by ``LocalCluster.unexpected()`` (which ``close()`` turns into a failure),
unless the test declared it with ``expect_log``. The etcd invariants cover
NICs as well as GPUs."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from agent.sim import run_agents
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.store import Put, unchanged
from phalanx.tls import TlsFiles
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb
from tests.integration.harness import TERMINAL, LocalCluster, dgx_node, tiny, until

AZ = "az1"


async def test_a_coordinator_error_line_is_reported_unless_expected(local_cluster: LocalCluster) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "c0")
    await c.wait_leader(AZ)
    assert c.unexpected() == [], "a quiet start-up said something"
    # A real ERROR: the coordinator's certificate file is broken on disk;
    # the next handshake makes the coordinator re-read it and refuse it.
    TlsFiles.issued(c.pki.server_dir(), "coordinator", "c0").cert.write_text("not a certificate\n")
    await c.stub(coord.address).ClusterStatus(gpb.ClusterStatusRequest(), timeout=10)

    async def logged() -> bool:
        return "TLS: keeping the current certificate" in coord.log()

    await until("the refusal logged", logged)
    said = c.unexpected()
    assert len(said) == 1, said
    assert said[0].who == "coordinator" and said[0].where.startswith(f"{coord.log_path}:"), said[0]
    assert "ERROR" in said[0].text and "files on disk are refused" in said[0].text
    # Declared, it is part of the scenario: close() passes.
    c.expect_log(r"agent-never", who="agent")  # another's expectation does not cover it
    assert len(c.unexpected()) == 1
    c.expect_log(r"TLS: keeping the current certificate .*: the files on disk are refused")
    assert c.unexpected() == []


async def test_an_error_of_an_earlier_life_is_reported_after_a_restart(local_cluster: LocalCluster) -> None:
    """A restarted coordinator appends to its log: what its first life said
    at ERROR is still found, while ``log()`` is the new life's."""
    c = local_cluster
    coord = c.start_coordinator(AZ, "c0")
    await c.wait_leader(AZ)
    cert = TlsFiles.issued(c.pki.server_dir(), "coordinator", "c0").cert
    good = cert.read_text()
    cert.write_text("not a certificate\n")
    await c.stub(coord.address).ClusterStatus(gpb.ClusterStatusRequest(), timeout=10)

    async def logged() -> bool:
        return "TLS: keeping the current certificate" in coord.log()

    await until("the refusal logged", logged)
    cert.write_text(good)  # the next life starts with a good certificate
    coord.proc.kill()
    coord.proc.wait()
    again = c.start_coordinator(AZ, "c0")
    await c.wait_leader(AZ)
    assert again.log_path == coord.log_path
    assert "TLS: keeping the current certificate" not in again.log()
    said = c.unexpected()
    assert len(said) == 1 and "files on disk are refused" in said[0].text, said
    c.expect_log(r"TLS: keeping the current certificate .*: the files on disk are refused")


async def test_an_agent_task_exception_and_error_record_are_reported_unless_expected(
        local_cluster: LocalCluster, tmp_path) -> None:
    c = local_cluster
    # A task of agent code that ends with an exception nobody looks at
    # (gather(return_exceptions=True) style): agents of a node whose
    # certificate files do not exist.
    task = asyncio.create_task(run_agents(cluster=c.cluster, az=AZ, etcd=c.etcd, topologies=[dgx_node("n1", AZ)],
                                          timings=c.timings, ready_line=False, tls_dir=tmp_path / "no-certs"))
    await asyncio.wait([task])
    # A failed task that is dropped without anyone retrieving its
    # exception: only asyncio's "never retrieved" report says so.

    async def boom() -> None:
        raise RuntimeError("dropped boom")

    dropped = asyncio.ensure_future(boom())
    await asyncio.wait([dropped])
    del dropped
    gc.collect()
    # An ERROR record of an agent logger.
    logging.getLogger("agent.session").error("agent n9: the leader refused this agent: test")

    said = c.unexpected()
    texts = [s.text for s in said]
    assert len(said) == 3 and all(s.who == "agent" for s in said), said
    assert any("ended with" in t and "no-certs" in t for t in texts), texts
    assert any("Task exception was never retrieved" in t and "dropped boom" in t for t in texts), texts
    assert any(t.startswith("ERROR agent.session: agent n9: the leader refused") for t in texts), texts
    assert any(s.where.startswith(__file__) for s in said), "an agent record names the line that logged it"

    c.expect_log(r"no-certs", who="agent")
    c.expect_log(r"dropped boom", who="agent")
    c.expect_log(r"agent n9: the leader refused this agent", who="coordinator")  # the wrong who covers nothing
    assert len(c.unexpected()) == 1
    c.expect_log(r"agent n9: the leader refused this agent", who="agent")
    assert c.unexpected() == []
    with pytest.raises(ValueError, match="who must be one of"):
        c.expect_log("x", who="etcd")


async def test_close_fails_naming_the_test_and_what_was_said(etcd_endpoint, cluster_name, tmp_path) -> None:
    c = await LocalCluster(etcd_endpoint, cluster_name, tmp_path).start()
    logging.getLogger("agent").error("unexpected trouble")
    with pytest.raises(AssertionError) as e:
        await c.close()
    msg = str(e.value)
    assert "test_close_fails_naming_the_test_and_what_was_said" in msg and "unexpected trouble" in msg, msg
    assert f"{__file__}:" in msg, msg


async def test_etcd_invariants_see_a_nic_reserved_twice(local_cluster: LocalCluster) -> None:
    """Two reservations of disjoint GPUs sharing one NIC (NICs are exclusive:
    capacity.free_view subtracts held NICs; the agent's ledger refuses an
    overlap): the harness's etcd invariants name the NIC."""
    c = local_cluster
    for gang, gpus in (("g-a", (0,)), ("g-b", (1,))):
        r = Reservation(az=AZ, gang=gang, incarnation=1, state=HoldState.RELEASING,
                        nodes={"n1": NodeDevices(gpus, ("mlx5_0",))})
        assert (await c.store.create_if_absent(c.store.keys.reservation(AZ, gang), r.to_dict()))[0]
    problems = await c.check_etcd_invariants()
    assert any("NIC" in p and "mlx5_0" in p and "g-a" in p and "g-b" in p for p in problems), problems
    assert not any("GPU" in p for p in problems), problems


async def test_etcd_invariants_compare_placement_and_reservation_nics(local_cluster: LocalCluster) -> None:
    """A running gang with RDMA NICs: its reservation holds exactly the NICs
    of its placement (the invariants hold), and a reservation that lost one
    of them no longer matches its placement."""
    c = local_cluster
    c.start_coordinator(AZ, "c0")
    await c.wait_leader(AZ)
    c.start_agents(AZ, [dgx_node("n1", AZ)])
    await c.wait_nodes_ready(AZ, 1)
    spec = tiny("nics", members=2, gpus=2, duration=60.0)
    spec.resources.rdma_nics = 2
    gang = await c.submit(spec)
    await c.wait_state(gang.id, {pb.GANG_STATE_RUNNING})
    placed = {nic for m in (await c.etcd_gangs())[gang.id].placement for nic in m.nics}
    assert len(placed) == 4, placed
    assert await c.check_etcd_invariants() == []
    # The same reservation without one of its NICs (written as the leader's
    # own user could): the invariants name the mismatch.
    key = c.store.keys.reservation(AZ, gang.id)
    kv = await c.store.get(key)
    assert kv is not None
    doc = kv.json()
    doc["nodes"]["n1"]["nics"] = doc["nodes"]["n1"]["nics"][1:]
    assert (await c.store.txn([unchanged(kv)], [Put(key, doc)])).succeeded
    problems = await c.check_etcd_invariants()
    assert any(f"{gang.id}: placement" in p and "mlx5" in p for p in problems), problems
    await c.stub().CancelGang(gpb.CancelGangRequest(id=gang.id, reason="done"), timeout=10)
    await c.wait_state(gang.id, TERMINAL)
