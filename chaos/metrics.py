"""Per-run metrics of a chaos run (docs/chaos.md "Per-run metrics").

Three numbers per run, each from the source that sees all of it:

- **leadership changes** per AZ: from the recorded history (every
  ``leader/<az>`` term the recorder saw begin after the cluster was ready).
  A coordinator's own counter is per process and dies with it; the history
  also counts the terms of coordinators that were killed.
- **time to full gang**: from the history too, per gang: its record's first
  write to its first RUNNING write as the recorder saw them (the submission
  to every member running), with the count, median, 95th percentile and
  maximum.
- **fenced writes refused**: only the coordinator whose write etcd refused
  knows (no record is written), so every coordinator's ``/metrics`` is
  scraped at the end of the run, after the settle and before teardown
  (``phalanx_fenced_writes_refused_total``). A coordinator restarted during
  the run reports what it did since its last start: the report says how
  many starts each one had, and one that does not answer is named.

``derive`` is pure (the history and the scrapes in); ``main`` is the
scraper that runs inside the client host (``python -m chaos.metrics``),
where the coordinators' addresses are reachable.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from chaos.history import History, gang_observations, leader_terms

# Every coordinator of a chaos cluster serves /metrics here (on its host's
# address; the gRPC port is chaos.cluster.COORD_PORT).
METRICS_PORT = 9090
FENCED = "phalanx_fenced_writes_refused_total"
LEADERSHIP = "phalanx_leadership_changes_total"


@dataclass(frozen=True)
class Scraped:
    """One coordinator's answer at the end of a run."""

    coordinator: str
    address: str
    starts: int  # process starts during the run (1: never restarted)
    fenced_refused: float | None = None  # None: no answer
    leadership_changes: float | None = None
    error: str = ""


@dataclass(frozen=True)
class RunMetrics:
    leadership_changes: dict[str, int]  # AZ -> new terms after the cluster was ready (history)
    full_gang_s: dict[str, float]  # gang -> submission to RUNNING, seconds (history)
    fenced_refused: float | None  # sum over the coordinators that answered; None when none did
    scraped: tuple[Scraped, ...] = field(default_factory=tuple)

    @property
    def full_gang_stats(self) -> dict[str, float]:
        """count, p50, p95, max of ``full_gang_s`` (empty: no gang ran)."""
        xs = sorted(self.full_gang_s.values())
        if not xs:
            return {}
        return {"count": len(xs), "p50": _quantile(xs, 0.5), "p95": _quantile(xs, 0.95), "max": xs[-1]}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["full_gang_stats"] = self.full_gang_stats
        return d


def _quantile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of sorted ``xs``."""
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def parse(text: str) -> dict[str, float]:
    """The two counters a run reports, summed over their label values."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {FENCED: 0.0, LEADERSHIP: 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def scraped_from(answers: Mapping[str, Mapping[str, Any]], starts: Mapping[str, int]) -> tuple[Scraped, ...]:
    """``answers``: what ``main`` printed (coordinator -> address and text or
    error); ``starts``: each coordinator's process starts."""
    out = []
    for cid in sorted(answers):
        a = answers[cid]
        if a.get("text") is None:
            out.append(Scraped(cid, a.get("address", ""), starts.get(cid, 1), error=str(a.get("error", "no answer"))))
            continue
        try:
            values = parse(a["text"])
        except ValueError as exc:  # not the exposition format
            out.append(Scraped(cid, a.get("address", ""), starts.get(cid, 1), error=f"unparsable: {exc}"))
            continue
        out.append(Scraped(cid, a.get("address", ""), starts.get(cid, 1), values[FENCED], values[LEADERSHIP]))
    return tuple(out)


def derive(h: History, scraped: Sequence[Scraped] = ()) -> RunMetrics:
    """The run's metrics from its history and the end-of-run scrapes (pure)."""
    t0 = h.params.started_at
    terms = leader_terms(h.etcd)
    changes = {az: sum(1 for t in terms.get(az, []) if t.start > t0) for az in h.params.azs}
    full: dict[str, float] = {}
    for gang, obs in gang_observations(h.etcd).items():
        if not obs:
            continue
        running = next((o for o in obs if o.state == "RUNNING"), None)
        if running is not None:
            full[gang] = max(0.0, running.mono - obs[0].mono)
    answered = [s.fenced_refused for s in scraped if s.fenced_refused is not None]
    return RunMetrics(changes, full, sum(answered) if answered else None, tuple(scraped))


def render(m: RunMetrics) -> list[str]:
    """The report's lines."""
    lines = ["Per-run metrics"]
    lines.append("  leadership changes (history: new leader terms after ready): "
                 + (", ".join(f"{az} {n}" for az, n in sorted(m.leadership_changes.items())) or "none")
                 + f"; total {sum(m.leadership_changes.values())}")
    st = m.full_gang_stats
    lines.append("  time to full gang (history: first record to RUNNING): "
                 + (f"{st['count']} gangs, p50 {st['p50']:.2f}s, p95 {st['p95']:.2f}s, max {st['max']:.2f}s" if st
                    else "no gang ran"))
    if not m.scraped:
        lines.append("  fenced writes refused: not scraped")
    else:
        total = "no coordinator answered" if m.fenced_refused is None else f"{m.fenced_refused:g}"
        lines.append(f"  fenced writes refused (coordinators' /metrics at the end): {total}")
        for s in m.scraped:
            since = "" if s.starts <= 1 else f" (restarted: counts since start {s.starts} only)"
            if s.error:
                lines.append(f"    {s.coordinator} {s.address}: no answer: {s.error}")
            else:
                lines.append(f"    {s.coordinator}: fenced refused {s.fenced_refused:g}, became leader "
                             f"{s.leadership_changes:g} time(s){since}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m chaos.metrics --targets JSON --tls-dir DIR``: scrape each
    coordinator ({id: HOST:PORT}) and print {id: {address, text | error}}
    as one JSON object. Always exits 0 once the arguments are good: an
    unanswered scrape is a finding for the report, not a failure."""
    p = argparse.ArgumentParser(prog="python -m chaos.metrics")
    p.add_argument("--targets", required=True, help="JSON object: coordinator id -> HOST:PORT of its /metrics")
    p.add_argument("--tls-dir", required=True, help="a client dir of the run's CA (ca.crt client.crt client.key)")
    p.add_argument("--timeout", type=float, default=5.0)
    a = p.parse_args(argv)
    from phalanx.client import client_tls
    from phalanx.metrics import ScrapeError, scrape

    files, cluster = client_tls(a.tls_dir)
    out: dict[str, dict[str, Any]] = {}
    for cid, address in sorted(json.loads(a.targets).items()):
        try:
            out[cid] = {"address": address, "text": scrape(address, tls=files, cluster=cluster, timeout_s=a.timeout)}
        except ScrapeError as exc:
            out[cid] = {"address": address, "text": None, "error": str(exc)}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
