"""When etcd keeps failing, the coordinator's one gang watch ends every
stream it feeds with UNAVAILABLE, saying why, and the next stream starts it
afresh once etcd is back (docs/events.md "The cluster stream"). A private
plaintext etcd, stopped and started again; the coordinator in-process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from phalanx.store import StoreUnavailable

from coordinator.config import CoordinatorConfig
from coordinator.server import Coordinator
from phalanx.etcd_server import EtcdServer
from phalanx.timings import Timings
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import gang_pb2_grpc as ggrpc
from tests.integration.harness import until

pytestmark = pytest.mark.integration


async def test_every_stream_ends_unavailable_when_etcd_is_gone_and_the_next_one_starts_the_watch_again(
        tmp_path: Path) -> None:
    etcd = EtcdServer(data_dir=tmp_path / "etcd", name="down", log_path=tmp_path / "etcd.log")
    etcd.start().wait_ready()
    coord = Coordinator(CoordinatorConfig(cluster="down", az="az-a", coordinator_id="c0", etcd=(etcd.endpoint,),
                                          timings=Timings.fast()))
    try:
        address = await coord.start()
        async with grpc.aio.insecure_channel(address) as ch:
            stub = ggrpc.GangServiceStub(ch)
            streams = [stub.WatchEvents(gpb.WatchEventsRequest()) for _ in range(3)]
            for s in streams:
                await s.initial_metadata()
                assert not s.done()
            etcd.stop()
            for s in streams:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await asyncio.wait_for(s.read(), 120)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "the coordinator's gang watch ended" in (err.value.details() or ""), err.value.details()
            reg = coord.metrics.registry
            assert reg.get_sample_value("phalanx_watch_streams_dropped_total", {"reason": "unavailable"}) == 1
            assert reg.get_sample_value("phalanx_watch_streams") == 0
            etcd.start().wait_ready()
            # "Back" as the coordinator sees it: its etcd channel may still be
            # in gRPC's reconnect backoff from the refused connections.
            async def reached() -> bool:
                try:
                    await coord.store.get(coord.store.keys.leader("az-a"))
                except StoreUnavailable:
                    return False
                return True

            await until("the coordinator reaches the restarted etcd", reached, timeout=120)
            again = stub.WatchEvents(gpb.WatchEventsRequest())
            await asyncio.wait_for(again.initial_metadata(), 120)
            assert not again.done(), await again.details()
            again.cancel()
    finally:
        await coord.close()
        etcd.stop()
