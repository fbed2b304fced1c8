"""What ``--check-book`` costs a leader per admission cycle: the time of one
``Book.problems()`` on a book of a large AZ.

    .venv/bin/python bench/book_check.py [--nodes 3000] [--gangs 1000] [--cross-az 100] [--runs 50]

Builds the book as a leader holds it after a takeover: ``--gangs`` owned
RUNNING single-AZ gangs, each holding two whole 8-GPU nodes, as many
finished gangs awaiting collection, and ``--cross-az`` PREPARED cross-AZ
holds on the remaining nodes (``--nodes`` in all), then times ``problems()``
``--runs`` times. Results: docs/benchmarks.md "The book check".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from bench.machine import machine_line  # noqa: E402
from coordinator.book import Book  # noqa: E402
from coordinator.core.records import GangRecord  # noqa: E402
from coordinator.core.retention import FinishedGang  # noqa: E402
from coordinator.core.twophase import PrepareReceived  # noqa: E402
from phalanx.model import GangState  # noqa: E402
from phalanx.reservation import HoldState, NodeDevices, Reservation  # noqa: E402
from phalanx.spec import GangSpec, Resources  # noqa: E402
from phalanx.store import Keys  # noqa: E402
from phalanx.timings import Timings  # noqa: E402

AZ = "az-a"
GPUS = tuple(range(8))
NODES_PER_GANG = 2


def build(nodes: int, gangs: int, cross_az: int) -> Book:
    if gangs * NODES_PER_GANG + cross_az > nodes:
        raise SystemExit(f"error: {gangs} gangs of {NODES_PER_GANG} nodes and {cross_az} cross-AZ holds need "
                         f"more than --nodes {nodes}")
    book = Book.of(AZ, Keys("/phalanx/bench"), Timings())
    spec = GangSpec(name="g", members=NODES_PER_GANG * 8, resources=Resources(gpus=1))
    reservations = []
    for i in range(gangs):
        gang = f"g{i}"
        held = {f"n{NODES_PER_GANG * i + k}": NodeDevices(GPUS) for k in range(NODES_PER_GANG)}
        reservations.append(Reservation(AZ, gang, 1, HoldState.COMMITTED, held))
        book.owned(GangRecord(id=gang, spec=spec, state=GangState.RUNNING, owner_az=AZ, submitted_at=1.0,
                              updated_at=1.0))
        book.finished_seen(FinishedGang(f"f{i}", GangState.SUCCEEDED, AZ, 1.0, i + 1), 1.0)
    book.restored(reservations)
    for j in range(cross_az):
        book.participant_decides(PrepareReceived(
            stimulus_id="bench", gang=f"w{j}", incarnation=1, owner_az="az-b", priority=0, submitted_at=1.0,
            nodes={f"n{gangs * NODES_PER_GANG + j}": (GPUS, ())}), 1.0)
    return book


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench/book_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=3000)
    p.add_argument("--gangs", type=int, default=1000)
    p.add_argument("--cross-az", type=int, default=100)
    p.add_argument("--runs", type=int, default=50)
    a = p.parse_args(argv)
    book = build(a.nodes, a.gangs, a.cross_az)
    assert book.problems() == [], book.problems()[:3]
    times = []
    for _ in range(a.runs):
        started = time.perf_counter()
        book.problems()
        times.append((time.perf_counter() - started) * 1000)
    print(machine_line())
    print(f"book: {a.nodes} nodes, {a.gangs} gangs holding {a.gangs * NODES_PER_GANG} nodes, {a.gangs} finished, "
          f"{a.cross_az} cross-AZ holds")
    print(f"problems(): median {statistics.median(times):.2f} ms, max {max(times):.2f} ms over {a.runs} runs")


if __name__ == "__main__":
    main()
