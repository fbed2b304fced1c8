"""Reports of a chaos run: a text summary and a self-contained HTML timeline.

``report.txt``: the scenario, its faults, leaders per AZ over time, client
outcomes, gangs by final state, recovery after healing, and each invariant
PASS/FAIL with how much it checked and every violation with its evidence.

``timeline.html``: one inline SVG (no script, no external asset): fault
windows as red bands across the chart, per AZ a leadership row (one colour
per coordinator, labelled with the epoch) and one row per gang (state
segments as the recorder saw them; member lifetimes as thin bars beneath,
from the agents' own stamps), violations as red markers. Hover anything for
details (SVG ``<title>``).

Times are seconds since the cluster was ready (``+12.3s``), on the machine's
monotonic clock, the same in every source.

Both also carry the run's metrics (``chaos.metrics``: leadership changes and
time to full gang from the history, fenced writes refused from the
coordinators' /metrics) when the run collected them.
"""

from __future__ import annotations

import html
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from chaos.checker import Verdict
from chaos.metrics import RunMetrics, render as render_metrics
from chaos.history import (
    INF,
    GangObservation,
    History,
    MemberInterval,
    gang_observations,
    leader_terms,
    member_intervals,
)


def _rel(h: History, t: float) -> str:
    return "end" if not math.isfinite(t) else f"+{t - h.params.started_at:.2f}s"


def fault_windows(h: History) -> list[tuple[str, float, float, str]]:
    """(name, inject, heal, notes) per fault step, in order."""
    out: list[tuple[str, float, float, str]] = []
    open_: dict[str, float] = {}
    notes: dict[str, list[str]] = defaultdict(list)
    for f in h.faults:
        if f.action == "inject":
            open_[f.name] = f.mono
        elif f.action == "heal" and f.name in open_:
            out.append((f.name, open_.pop(f.name), f.mono, "; ".join(notes.pop(f.name, []))))
        elif f.action == "note":
            notes[f.name].append(f.detail)
    for name, t in open_.items():
        out.append((name, t, INF, "never healed; ".join(notes.pop(name, []))))
    return sorted(out, key=lambda w: w[1])


def summary(h: History, v: Verdict, wall_s: float | None = None, metrics: RunMetrics | None = None) -> str:
    """The text report of one run (with ``metrics``: its per-run metrics
    before the invariants)."""
    p = h.params
    lines = [f"Phalanx chaos run: {p.scenario} seed {p.seed}" + (f"   (wall {wall_s:.1f}s)" if wall_s else "")]
    t = p.timings
    lines.append(
        f"timings: lease_ttl {t.get('lease_ttl_s')}s, fence_after {t.get('fence_after_s')}s, re-place after "
        f"{float(t.get('fence_after_s', 0)) + float(t.get('replace_margin_s', 0)):g}s; recovery bound "
        f"{p.recovery_bound_s:g}s; token window {p.token_window_s:g}s; settle {'ok' if p.settled else 'TIMED OUT'}")
    for n in p.notes:
        lines.append(f"note: {n}")
    lines.append("")
    lines.append("Faults")
    wins = fault_windows(h)
    if not wins:
        lines.append("  none")
    for name, a, b, notes in wins:
        lines.append(f"  {_rel(h, a):>9} .. {_rel(h, b):>9}  {name}" + (f"  ({notes})" if notes else ""))
    procs = [e for e in h.processes if e.mono >= p.started_at]
    if procs:
        lines.append("Process events")
        for e in procs:
            lines.append(f"  {_rel(h, e.mono):>9}  {e.action:8} {e.name} {e.detail}")
    lines.append("")
    lines.append("Leaders per AZ (epoch = leader key create_revision; times as seen by the recorder)")
    terms = leader_terms(h.etcd)
    for az in p.azs:
        parts = [f"{t.coordinator} e{t.epoch} {_rel(h, max(t.start, p.started_at))}..{_rel(h, t.end)}"
                 for t in terms.get(az, [])]
        lines.append(f"  {az}: " + (" | ".join(parts) or "none"))
    lines.append("")
    subs = [o for o in h.outcomes if o.op == "submit" and not o.probe]
    cross = [o for o in h.outcomes if o.op == "submit_cross_az"]
    cancels = [o for o in h.outcomes if o.op == "cancel"]
    attempts = Counter(c.code for c in h.calls if not c.probe)
    lines.append(f"Client: {len(subs)} submissions, {sum(o.acked for o in subs)} acknowledged "
                 f"({sum(o.attempts > 1 for o in subs)} after retries); {len(cancels)} cancels "
                 f"({sum(o.acked for o in cancels)} ok); {len(cross)} cross-AZ submissions "
                 f"({sum(o.acked for o in cross)} acknowledged)")
    lines.append("  attempts by status: " + ", ".join(f"{k} {n}" for k, n in attempts.most_common()))
    lines.extend(cancel_lines(h))
    if h.final is not None:
        states = Counter(g.get("state", "?") for g in h.final.gangs.values() if isinstance(g, Mapping))
        lines.append("Gangs by final state: " + (", ".join(f"{k} {n}" for k, n in sorted(states.items())) or "none"))
        reasons = Counter(_short_reason(g.get("reason", "")) for g in h.final.gangs.values()
                          if isinstance(g, Mapping) and g.get("state") == "FAILED")
        for r, n in reasons.most_common(6):
            lines.append(f"  FAILED x{n}: {r}")
    ev = Counter(e.event for e in h.agents)
    lines.append("Agent effects: " + ", ".join(f"{k} {n}" for k, n in sorted(ev.items())))
    lines.append(traceability(h))
    m = v.measurements
    stops = m.get("terminal_stops")
    if stops:
        lines.append(f"Terminal gangs (invariant 9): {v.result(9).checked} examined, "
                     f"{stops['outlived_terminal_write']} with a member alive at their terminal write; the longest a "
                     f"member outlived it {stops['longest_after_terminal_write_s']:.2f}s (bound {stops['bound_s']:g}s "
                     "= stop_grace_s + fence_after_s + replace_margin_s)")
    lines.append(f"Recovery after the last heal (bound {m.get('bound_s', p.recovery_bound_s):g}s): leader "
                 f"{_fmt_az(m.get('leader_after_heal_s', {}))}; admission {_fmt_az(m.get('admission_after_heal_s', {}))}")
    for a in m.get("anomalies", []):
        lines.append(f"observation: {a}")
    if metrics is not None:
        lines.append("")
        lines.extend(render_metrics(metrics))
    lines.append("")
    lines.append("Invariants")
    for r in v.results:
        mark = "PASS" if r.passed else "FAIL"
        lines.append(f"  [{mark}] {r.number}. {r.name}: checked {r.checked}, {len(r.violations)} violation(s)")
    if v.violations:
        lines.append("")
        lines.append("Violations")
        for x in v.violations:
            lines.append("  " + x.render(p.started_at).replace("\n", "\n  "))
    lines.append("")
    lines.append("VERDICT: " + ("no violation" if v.ok else f"{len(v.violations)} violation(s)"))
    return "\n".join(lines) + "\n"


def cancels_by_aim(h: History) -> dict[str, dict[str, Counter[str]]]:
    """Per aim (admission, restart, late; chaos.workload.CANCEL_AIMS), the
    workload's cancels: ``outcome`` (ok or the final status), ``trigger``
    (what a restart-aimed one waited for) and ``landed`` (the gang's state as
    the recorder had last seen it when the cancel's first attempt began:
    the recorder sees writes late, so the gang may already have been one
    step further)."""
    gobs = gang_observations(h.etcd)
    out: dict[str, dict[str, Counter[str]]] = {}
    for o in h.outcomes:
        if o.op != "cancel" or o.probe:
            continue
        per = out.setdefault(o.aim or "unknown", {"outcome": Counter(), "trigger": Counter(), "landed": Counter()})
        per["outcome"]["ok" if o.acked else o.code] += 1
        if o.trigger:
            per["trigger"][o.trigger] += 1
        seen = [g for g in gobs.get(o.gang_id, []) if g.mono <= o.first_start]
        per["landed"][seen[-1].state if seen else "unseen"] += 1
    return out


def cancel_lines(h: History) -> list[str]:
    def fmt(c: Counter[str]) -> str:
        return ", ".join(f"{k} {n}" for k, n in sorted(c.items()))

    by_aim = cancels_by_aim(h)
    if not by_aim:
        return []
    lines = ["  cancels by aim (landed on: the gang's state as last seen when the cancel was sent):"]
    for aim in ("admission", "restart", "late", *sorted(set(by_aim) - {"admission", "restart", "late"})):
        per = by_aim.get(aim)
        if per is None:
            continue
        lines.append(f"    {aim}: {sum(per['outcome'].values())} ({fmt(per['outcome'])}); landed on {fmt(per['landed'])}"
                     + (f"; trigger {fmt(per['trigger'])}" if per["trigger"] else ""))
    return lines


def traceability(h: History) -> str:
    """How many gang writes that added events name the stimulus of the
    decision behind them (docs/chaos.md "Following a violation back"): all
    of them, unless a coordinator older than stimulus ids wrote some."""
    writes = [o for obs in gang_observations(h.etcd).values() for o in obs if o.kinds]
    named = [o for o in writes if o.stimuli]
    ids = {s for o in named for s in o.stimuli}
    return (f"Traceability: {len(named)} of {len(writes)} gang writes with events name their stimulus "
            f"({len(ids)} distinct stimulus ids)")


def _short_reason(r: str) -> str:
    import re

    return re.sub(r"[0-9a-f]{8}\b|\d+(\.\d+)?", "#", r)[:110]


def _fmt_az(d: Mapping[str, float]) -> str:
    return ", ".join(f"{az} {s:.1f}s" for az, s in sorted(d.items())) or "n/a"


# ---------------------------------------------------------------------------
# HTML timeline

_STATE_COLOURS = {
    "PENDING": "#c9c9c9", "RESERVING": "#f3d37a", "RESERVED": "#f3d37a", "STARTING": "#f0b44c",
    "RUNNING": "#5cb85c", "RESTARTING": "#e07b39", "SUCCEEDED": "#2e7d32", "FAILED": "#c62828",
    "CANCELLED": "#6d6d6d",
}
_LEADER_COLOURS = ("#1f77b4", "#9467bd", "#17becf", "#8c564b", "#bcbd22", "#e377c2")


def timeline(h: History, v: Verdict, metrics: RunMetrics | None = None) -> str:
    """A self-contained HTML page with the run's timeline as inline SVG
    (and, with ``metrics``, the per-run metrics beneath it)."""
    p = h.params
    t0 = p.started_at
    t_end = max([p.settle_at] + [e.mono for e in h.agents] + [e.mono for e in h.etcd if e.mono > 0])
    span = max(1.0, t_end - t0)
    left, width, row = 150, 1100, 14
    x = lambda t: left + max(0.0, min(1.0, ((t if math.isfinite(t) else t_end) - t0) / span)) * width  # noqa: E731
    esc = html.escape
    parts: list[str] = []
    y = 30
    # Axis
    step = 5 if span <= 60 else 10
    for s in range(0, int(span) + 1, step):
        xx = x(t0 + s)
        parts.append(f'<line x1="{xx:.1f}" y1="20" x2="{xx:.1f}" y2="__H__" class="grid"/>'
                     f'<text x="{xx:.1f}" y="14" class="tick">+{s}s</text>')
    # Fault bands and labels
    fault_rows: list[str] = []
    for i, (name, a, b, notes) in enumerate(fault_windows(h)):
        xa, xb = x(a), x(b)
        parts.append(f'<rect x="{xa:.1f}" y="20" width="{max(1.0, xb - xa):.1f}" height="__HB__" class="band">'
                     f'<title>{esc(name)} {_rel(h, a)}..{_rel(h, b)} {esc(notes)}</title></rect>')
        fault_rows.append(f'<rect x="{xa:.1f}" y="{y}" width="{max(1.0, xb - xa):.1f}" height="{row - 3}" class="fault">'
                          f'<title>{esc(name)} {_rel(h, a)}..{_rel(h, b)} {esc(notes)}</title></rect>'
                          f'<text x="{xa + 3:.1f}" y="{y + row - 5}" class="lbl">{esc(name)}</text>')
        y += row
    if fault_rows:
        parts.append(f'<text x="4" y="{30 + row - 5}" class="head">faults</text>')
        parts.extend(fault_rows)
    else:
        parts.append(f'<text x="4" y="{y + row - 5}" class="head">no fault</text>')
        y += row
    y += 6
    terms = leader_terms(h.etcd)
    gobs = gang_observations(h.etcd)
    ivs = member_intervals(h.agents)
    by_gang: dict[str, list[MemberInterval]] = defaultdict(list)
    for iv in ivs:
        by_gang[iv.gang].append(iv)
    colours: dict[str, str] = {}
    for az in p.azs:
        parts.append(f'<line x1="0" y1="{y - 3}" x2="{left + width}" y2="{y - 3}" class="sep"/>')
        parts.append(f'<text x="4" y="{y + row - 4}" class="head">AZ {esc(az)} leader</text>')
        for t in terms.get(az, []):
            c = colours.setdefault(t.coordinator, _LEADER_COLOURS[len(colours) % len(_LEADER_COLOURS)])
            xa, xb = x(max(t.start, t0)), x(t.end)
            parts.append(f'<rect x="{xa:.1f}" y="{y}" width="{max(1.0, xb - xa):.1f}" height="{row - 2}" fill="{c}">'
                         f'<title>{esc(t.coordinator)} epoch {t.epoch}: {_rel(h, t.start)}..{_rel(h, t.end)}</title></rect>'
                         f'<text x="{xa + 3:.1f}" y="{y + row - 4}" class="lbl w">{esc(t.coordinator)} e{t.epoch}</text>')
        y += row + 2
        gangs = sorted((g for g, obs in gobs.items() if obs and obs[0].owner_az == az), key=lambda g: gobs[g][0].rev)
        for gid in gangs:
            y = _gang_row(parts, h, gid, gobs[gid], by_gang.get(gid, []), x, y, left, row, t_end)
        y += 6
    # Violations
    for viol in v.violations:
        if viol.at is None or not math.isfinite(viol.at):
            continue
        xx = x(viol.at)
        parts.append(f'<path d="M{xx:.1f},22 l5,9 l-10,0 z" class="viol"><title>{esc(viol.render(t0))}</title></path>')
    height = y + 10
    svg = "".join(parts).replace("__HB__", str(height - 20)).replace("__H__", str(height))
    legend = " ".join(f'<span style="background:{c}">{s}</span>' for s, c in _STATE_COLOURS.items())
    res = "".join(f'<li class="{"pass" if r.passed else "fail"}">{"PASS" if r.passed else "FAIL"} '
                  f'{r.number}. {esc(r.name)} (checked {r.checked}, {len(r.violations)} violation(s))</li>'
                  for r in v.results)
    viols = "".join(f"<pre>{esc(x.render(t0))}</pre>" for x in v.violations)
    run_metrics = ("" if metrics is None else
                   f"<h3>Per-run metrics</h3><pre class=\"metrics\">{esc(chr(10).join(render_metrics(metrics)[1:]))}</pre>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>chaos {esc(p.scenario)} seed {p.seed}</title>
<style>
body {{ font: 13px sans-serif; margin: 16px; }}
svg text {{ font: 10px monospace; }} .tick {{ fill: #555; text-anchor: middle; }}
.head {{ fill: #000; font-weight: bold; }} .lbl {{ fill: #222; }} .w {{ fill: #fff; }}
.grid {{ stroke: #eee; }} .sep {{ stroke: #999; }}
.band {{ fill: #e53935; opacity: 0.08; }} .fault {{ fill: #e53935; opacity: 0.6; }}
.member {{ fill: #1565c0; }} .viol {{ fill: #d50000; }}
li.pass {{ color: #2e7d32; }} li.fail {{ color: #c62828; font-weight: bold; }}
.legend span {{ padding: 1px 6px; margin-right: 4px; color: #000; }}
pre {{ background: #fff3f3; padding: 6px; white-space: pre-wrap; }} pre.metrics {{ background: #f4f6fa; }}
</style></head><body>
<h2>Phalanx chaos: {esc(p.scenario)} seed {p.seed}</h2>
<p>{"no violation" if v.ok else f"<b>{len(v.violations)} violation(s)</b>"}; times in seconds since the cluster was ready.
Red bands: faults. Per AZ: leadership (colour per coordinator, label = epoch), then one row per gang
(state as etcd recorded it; thin blue bars: member processes, from the agents). Red triangles: violations. Hover for detail.</p>
<p class="legend">{legend}<span style="background:#1565c0;color:#fff">member</span></p>
<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}">{svg}</svg>
{run_metrics}
<h3>Invariants</h3><ul>{res}</ul>
{viols}
</body></html>
"""


def _gang_row(parts: list[str], h: History, gid: str, obs: Sequence[GangObservation], members: Iterable[MemberInterval],
              x: Any, y: int, left: int, row: int, t_end: float) -> int:
    esc = html.escape
    parts.append(f'<text x="4" y="{y + row - 5}" class="lbl">{esc(gid[:22])}</text>')
    for i, o in enumerate(obs):
        end = obs[i + 1].mono if i + 1 < len(obs) else (o.mono + 0.4 if o.state in _TERMINAL else t_end)
        xa, xb = x(o.mono), x(end)
        c = _STATE_COLOURS.get(o.state, "#999")
        parts.append(f'<rect x="{xa:.1f}" y="{y}" width="{max(1.5, xb - xa):.1f}" height="{row - 6}" fill="{c}">'
                     f'<title>{esc(gid)} {o.state} inc {o.incarnation} {_rel(h, o.mono)} (rev {o.rev}): {esc(o.reason)}'
                     + (f' [stimulus {esc(", ".join(o.stimuli))}]' if o.stimuli else '') + '</title></rect>')
    for iv in members:
        xa, xb = x(iv.start), x(iv.end)
        parts.append(f'<rect x="{xa:.1f}" y="{y + row - 5}" width="{max(1.0, xb - xa):.1f}" height="3" class="member">'
                     f'<title>{esc(iv.key)} on {esc(iv.node)} gpus {list(iv.gpus)} epoch {iv.epoch}: '
                     f'{_rel(h, iv.start)}..{_rel(h, iv.end)} {esc(str(iv.exit_phase or ""))}</title></rect>')
    return y + row


_TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def write(run_dir: Path, h: History, v: Verdict, wall_s: float | None = None,
          metrics: RunMetrics | None = None) -> None:
    """``report.txt`` and ``timeline.html`` into ``run_dir`` (and, with
    ``metrics``, ``metrics.json``)."""
    Path(run_dir, "report.txt").write_text(summary(h, v, wall_s, metrics))
    Path(run_dir, "timeline.html").write_text(timeline(h, v, metrics))
    if metrics is not None:
        Path(run_dir, "metrics.json").write_text(json.dumps(metrics.to_dict(), indent=2))


def matrix(results: Sequence[Any], wall_s: float) -> str:
    """The summary of several runs (``summary.txt``)."""
    lines = ["Phalanx chaos matrix", ""]
    lines.append(f"{'scenario':22} {'seed':8} {'wall':>7}  result")
    for r in results:
        lines.append(r.line())
    lines.append("")
    per_inv: Counter[str] = Counter()
    for r in results:
        if r.verdict is not None:
            for x in r.verdict.results:
                per_inv[f"{x.number}. {x.name}"] += len(x.violations)
    if per_inv:
        lines.append("violations per invariant, all runs: " +
                     ", ".join(f"[{k}] {n}" for k, n in sorted(per_inv.items())))
    ok = sum(r.as_expected for r in results)
    lines.append(f"{ok}/{len(results)} runs as expected; total wall time {wall_s:.0f}s")
    return "\n".join(lines) + "\n"
