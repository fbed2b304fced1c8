"""Record what etcd saw, from inside a chaos host (the root namespace has no route).

Two commands, both through :mod:`phalanx.store` (the only etcd gateway),
with ``--etcd-tls-dir D`` (ca.crt client.crt client.key of an etcd user that
may read the cluster's prefix; the chaos cluster gives root) or ``--insecure``::

    python -m chaos.recorder watch --etcd H:P,H:P --cluster C --out etcd.jsonl
        every put/delete under /phalanx/C/ from revision 1 on, one JSON line
        each, stamped with this process's monotonic clock when it was seen.
        Prints ``PHALANX_RECORDER_READY revision=N`` once watching.
    python -m chaos.recorder dump --etcd H:P,... --cluster C --out final.json
        one consistent range read of the whole prefix (the final state).

A line of the watch history::

    {"src": "etcd", "kind": "put"|"delete"|"gap", "key": "leader/a" (relative
     to the cluster root), "rev": 42, "create_rev": 40, "mod_rev": 42,
     "lease": 7587..., "value": {...} | null, "mono": ..., "wall": ...}

A gang record's value carries its events, each with the stimulus id of the
coordinator decision that wrote it, so the history can name the decision
behind every gang write (chaos.history.Tracer, docs/chaos.md "Following a
violation back"); the recorder keeps the value whole for that.

Why a watch from revision 1 and not polling: etcd delivers every revision in
order, so the checker can tell exactly which leader epoch was current when a
reservation was written (invariant 6 on the etcd side). The ``mono`` stamp is
when the *recorder* saw the event, which is never earlier than when it
happened; the checker only uses it in directions where that lag cannot
produce a false alarm. A watch that breaks (etcd member down, no quorum)
resumes from the last revision seen, so nothing is skipped; only a compaction
would lose history, and then a ``gap`` line says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from phalanx.store import KV, Compacted, Store, StoreUnavailable
from phalanx import etcd_pki

READY = "PHALANX_RECORDER_READY"


def _value(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return raw.decode(errors="replace")


def kv_line(root: str, kind: str, kv: KV, rev: int) -> dict[str, Any]:
    """One history line for ``kv`` (a delete carries no value)."""
    return {
        "src": "etcd",
        "kind": kind,
        "key": kv.key[len(root):] if kv.key.startswith(root) else kv.key,
        "rev": rev,
        "create_rev": kv.create_revision,
        "mod_rev": kv.mod_revision,
        "lease": kv.lease,
        "value": _value(kv.value) if kind == "put" else None,
        "mono": time.monotonic(),
        "wall": time.time(),
    }


def _write(out: TextIO, line: dict[str, Any]) -> None:
    out.write(json.dumps(line, separators=(",", ":")) + "\n")
    out.flush()


async def watch(store: Store, out: TextIO, stop: asyncio.Event, retry_s: float = 0.2, start: int = 1) -> None:
    """Write every event under the cluster prefix from revision ``start``
    until ``stop`` (1: a chaos run's own etcd, fresh; a shared one keeps only
    its recent history, phalanx.etcd_server.EtcdServer.compaction_retention)."""
    root = store.keys.root
    announced = False
    while not stop.is_set():
        try:
            if not announced:
                # Proves etcd answers before we say READY; the watch itself
                # starts at revision 1 whatever this returns.
                rev = await store.revision()
                print(f"{READY} revision={rev}", flush=True)
                announced = True
            async for batch in store.watch_prefix(root, start):
                for ev in batch:
                    _write(out, kv_line(root, ev.kind, ev.kv, ev.revision))
                    start = ev.revision + 1
                if stop.is_set():
                    return
        except Compacted as exc:
            # History before compact_revision is gone: say so, re-list, go on.
            kvs, rev = await store.get_prefix(root)
            _write(out, {"src": "etcd", "kind": "gap", "key": "", "rev": rev, "from_rev": start,
                         "value": None, "mono": time.monotonic(), "wall": time.time(),
                         "detail": str(exc)})
            for kv in kvs:
                _write(out, kv_line(root, "put", kv, kv.mod_revision))
            start = rev + 1
        except StoreUnavailable:
            await asyncio.sleep(retry_s)


async def dump(store: Store, timeout: float) -> dict[str, Any]:
    """One consistent read of the whole prefix, retried until ``timeout``."""
    root = store.keys.root
    async for attempt in AsyncRetrying(stop=stop_after_delay(timeout), wait=wait_fixed(0.3),
                                       retry=retry_if_exception_type(StoreUnavailable), reraise=True):
        with attempt:
            mono = time.monotonic()
            kvs, rev = await store.get_prefix(root)
    return {
        "revision": rev,
        "mono": mono,
        "wall": time.time(),
        "kvs": [
            {"key": kv.key[len(root):], "value": _value(kv.value), "create_rev": kv.create_revision,
             "mod_rev": kv.mod_revision, "lease": kv.lease}
            for kv in kvs
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.recorder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("watch", "dump"))
    p.add_argument("--etcd", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=30.0, help="dump: give up after this long")
    p.add_argument("--etcd-tls-dir", default="", help="etcd client files (ca.crt client.crt client.key)")
    p.add_argument("--insecure", action="store_true", help="reach etcd in plaintext")
    a = p.parse_args(argv)
    if not a.etcd_tls_dir and not a.insecure:
        p.error("--etcd-tls-dir: required (pass --insecure to reach etcd in plaintext)")
    tls = etcd_pki.files(a.etcd_tls_dir) if a.etcd_tls_dir else None

    async def amain() -> int:
        store = await Store(a.etcd, a.cluster, tls=tls, timeout=2.0).connect()
        try:
            if a.command == "dump":
                data = await dump(store, a.timeout)
                tmp = Path(a.out + ".tmp")
                tmp.write_text(json.dumps(data))
                tmp.replace(a.out)
                return 0
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            with open(a.out, "a", buffering=1) as out:
                task = asyncio.create_task(watch(store, out, stop))
                await stop.wait()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            return 0
        finally:
            await store.close()

    return asyncio.run(amain())


if __name__ == "__main__":
    sys.exit(main())
