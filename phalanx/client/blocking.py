"""The blocking client, :class:`Client`: one private :class:`AsyncClient` on
its own event loop in a background daemon thread. Chosen over the sync gRPC
stubs so that failover, deadlines, idempotent submit retries and watch
resumption exist in exactly one place (phalanx/client/async_client.py)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from phalanx.client.async_client import AsyncClient, SubmitResult
from phalanx.client.specs import SpecLike
from phalanx.client_names import StateLike
from phalanx.v1 import gang_pb2
from phalanx.v1 import types_pb2 as pb

T = TypeVar("T")


class Client:
    """Blocking client with the same methods as :class:`AsyncClient`.

    Runs an AsyncClient on a private event loop in a daemon thread; every
    method submits a coroutine there and waits for its result. Safe to share
    between threads. ``watch`` returns a plain iterator."""

    def __init__(self, addresses: str | Sequence[str] | None = None, timeout: float = 10.0,
                 tls_dir: str | os.PathLike[str] | None = None, insecure: bool = False, *, token: str | None = None,
                 fail_fast: bool = False):
        # fail_fast: as AsyncClient's (a round that reaches no address at all ends the call).
        self._async = AsyncClient(addresses, timeout, tls_dir, insecure, token=token,
                                  fail_fast=fail_fast)  # validates before a thread exists
        self.connection = self._async.connection
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="phalanx-client", daemon=True)
        self._thread.start()
        self.addresses = self._async.addresses
        self.timeout = self._async.timeout

    def _run(self, coro: Awaitable[T]) -> T:
        if self._loop.is_closed():
            raise RuntimeError("client is closed")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt in the caller: stop the RPC too
            raise

    def submit(self, spec: SpecLike, idempotency_key: str | None = None) -> SubmitResult:
        return self._run(self._async.submit(spec, idempotency_key))

    def get(self, id: str) -> pb.Gang:
        return self._run(self._async.get(id))

    def list(
        self,
        states: Collection[StateLike] | StateLike | None = None,
        queue: str = "",
        owner_az: str = "",
        name_prefix: str = "",
        limit: int = 0,
    ) -> list[pb.Gang]:
        return self._run(self._async.list(states, queue, owner_az, name_prefix, limit))

    def watch(self, id: str) -> Iterator[pb.Gang]:
        return self._iterate(self._async.watch(id))

    def watch_events(self, id: str, after_seq: int = 0) -> Iterator[pb.GangEventRecord]:
        return self._iterate(self._async.watch_events(id, after_seq))

    def watch_cluster_events(self, queue: str = "", on_open: Callable[[], None] | None = None,
                             on_gap: Callable[[int], None] | None = None) -> Iterator[gang_pb2.ClusterEvent]:
        return self._iterate(self._async.watch_cluster_events(queue, on_open, on_gap))

    def _iterate(self, agen: Any) -> Iterator[Any]:
        """An async generator of the client's loop, as a blocking iterator
        (closed on the loop when the caller stops early)."""
        try:
            while True:
                item = self._run(_anext(agen))
                if item is _END:
                    return
                yield item
        finally:
            if not self._loop.is_closed():
                asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop).result()

    def wait(self, id: str, states: Collection[StateLike] | StateLike, timeout: float) -> pb.Gang:
        return self._run(self._async.wait(id, states, timeout))

    def cancel(self, id: str, reason: str = "") -> pb.Gang:
        return self._run(self._async.cancel(id, reason))

    def explain(self, id: str) -> gang_pb2.ExplainGangResponse:
        return self._run(self._async.explain(id))

    def nodes(self, az: str = "") -> list[pb.NodeStatus]:
        return self._run(self._async.nodes(az))

    def status(self) -> gang_pb2.ClusterStatusResponse:
        return self._run(self._async.status())

    def get_policy(self) -> tuple[dict[str, Any], gang_pb2.PolicyRecord]:
        return self._run(self._async.get_policy())

    def cordon(self, az: str, node: str, cordoned: bool = True) -> pb.NodeStatus:
        return self._run(self._async.cordon(az, node, cordoned))

    def drain(self, az: str, node: str, *, requeue: bool = False, timeout: float = 300.0) -> gang_pb2.DrainNodeResponse:
        return self._run(self._async.drain(az, node, requeue=requeue, timeout=timeout))

    def delete_node(self, az: str, node: str, *, force: bool = False) -> list[str]:
        return self._run(self._async.delete_node(az, node, force=force))

    def set_policy(self, policy: Mapping[str, Any], expected_revision: int) -> gang_pb2.PolicyRecord:
        return self._run(self._async.set_policy(policy, expected_revision))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._async.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_END = object()


async def _anext(agen: AsyncIterator[T]) -> T | object:
    # run_coroutine_threadsafe needs a coroutine (__anext__ gives an awaitable),
    # and StopAsyncIteration does not cross a concurrent Future cleanly.
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _END
