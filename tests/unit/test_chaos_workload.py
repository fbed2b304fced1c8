"""The chaos workload plan and scenario catalogue: pure, reproducible from a seed."""

from __future__ import annotations

import json
from pathlib import Path

from chaos.scenarios import MATRIX, SCENARIOS, schedule_seed
from chaos.workload import (
    ADMISSION_WINDOW_S,
    CANCEL_AIMS,
    CROSS_AZ_SHAPES,
    GPU_CHOICES,
    PROBE_PRIORITY,
    FaultWatch,
    plan,
    probe_plan,
)
from phalanx import wire
from phalanx.spec import parse_spec

AZS = ("a", "b", "c")


def test_the_same_seed_gives_the_same_workload() -> None:
    assert plan(7, 30, 1.0, AZS) == plan(7, 30, 1.0, AZS)
    assert plan(7, 30, 1.0, AZS) != plan(8, 30, 1.0, AZS)


def test_every_planned_gang_is_small_valid_and_single_az_unless_marked() -> None:
    planned = plan(3, 200, 2.0, AZS, steady_s=20)
    assert len(planned) > 100
    for p in planned:
        spec = parse_spec(p.spec())
        wire.spec_to_pb(spec)  # what the workload sends
        assert p.az in AZS and p.key and p.name == spec.name
        if p.cross_az:
            assert (spec.members, spec.resources.gpus) in CROSS_AZ_SHAPES
        else:
            assert 1 <= spec.members <= 2 and spec.resources.gpus in GPU_CHOICES
        assert spec.topology.allow_cross_az == p.cross_az
        assert not spec.run.command  # the launcher's built-in sleeper
        if "steady" not in p.name and p.cancel_aim != "restart":
            assert 1.0 <= spec.run.duration_s <= 4.0
    assert len({p.name for p in planned}) == len(planned)
    assert len({p.key for p in planned}) == len(planned)
    assert any(p.cross_az for p in planned) and any(p.cancel_after for p in planned)
    assert any(p.cross_az and p.cancel_after for p in planned)  # cross-AZ gangs are ordinary gangs
    assert any(p.cross_az and p.max_restarts for p in planned)
    assert {p.az for p in planned if "steady" in p.name} == set(AZS)


def test_the_probe_is_one_high_priority_gang_per_az() -> None:
    probes = probe_plan(1, AZS)
    assert [p.az for p in probes] == list(AZS)
    assert all(p.priority == PROBE_PRIORITY and p.members == 1 and p.gpus == 1 for p in probes)


def test_the_matrix_holds_every_scenario_but_the_planted_bug() -> None:
    assert "fencing-disabled" in SCENARIOS and "fencing-disabled" not in MATRIX
    assert SCENARIOS["fencing-disabled"].expect_violations
    assert SCENARIOS["fencing-disabled"].agent_failpoints == "agent.no_fencing=on"
    assert set(MATRIX) >= {"partition-az", "leader-etcd-cut", "agents-cut", "one-way", "leader-pause",
                           "coordinator-crash", "etcd-member-restart", "etcd-quorum-loss", "agent-restart"}


def test_schedule_seeds_differ_per_scenario_and_repeat_per_seed() -> None:
    assert schedule_seed("leader-pause", 1) == schedule_seed("leader-pause", 1)
    assert schedule_seed("leader-pause", 1) != schedule_seed("partition-az", 1)


def test_run_main_returns_a_status_instead_of_exiting(capsys) -> None:  # noqa: ANN001
    from chaos.run import main

    assert main(["--list"]) == 0
    assert "fencing-disabled" in capsys.readouterr().out
    assert main([]) == 2  # nothing chosen: usage error, no SystemExit
    assert main(["--scenario", "no-such-scenario"]) == 2
    assert "unknown scenario" in capsys.readouterr().err


def test_a_meaningful_share_of_the_workload_is_cross_az_and_some_of_it_needs_two_azs() -> None:
    planned = [p for p in plan(5, 200, 1.0, AZS) if "steady" not in p.name]
    cross = [p for p in planned if p.cross_az]
    assert 0.15 < len(cross) / len(planned) < 0.35
    # an AZ of the chaos cluster has 2 nodes x 8 GPUs: 3 x 8 cannot fit in one
    assert any(p.members * p.gpus > 16 for p in cross)
    assert all(p.members * p.gpus <= 16 for p in planned if not p.cross_az)


def test_cross_az_shapes_do_not_change_the_rest_of_the_plan() -> None:
    # the shapes come from a per-gang stream: arrivals, AZs, durations, cancels
    # and restarts are those of the single-AZ plan, and so are the other gangs' sizes
    base = plan(7, 60, 1.0, AZS, cross_az_fraction=0.0)
    mixed = plan(7, 60, 1.0, AZS)
    assert not any(p.cross_az for p in base) and any(p.cross_az for p in mixed)
    assert [(p.at, p.az, p.duration_s, p.cancel_after, p.max_restarts) for p in base] == \
        [(p.at, p.az, p.duration_s, p.cancel_after, p.max_restarts) for p in mixed]
    assert all((b.members, b.gpus) == (m.members, m.gpus) for b, m in zip(base, mixed) if not m.cross_az)


PLANTED = {"fencing-disabled": "agent.no_fencing", "stale-epoch-accepted": "agent.ignore_stale_epoch",
           "fence-compare-skipped": "leader.skip_fence_compare", "decision-overwrite": "twophase.decision_overwrite"}


def test_every_planted_bug_expects_violations_and_stays_out_of_the_matrix() -> None:
    planted = {n for n, s in SCENARIOS.items() if s.expect_violations}
    assert planted == set(PLANTED)
    assert not planted & set(MATRIX)
    for name, point in PLANTED.items():
        sc = SCENARIOS[name]
        # each one names its failpoint, and its fault fits in the run (scheduled at all)
        assert point in sc.description or point in sc.agent_failpoints, name
        assert sc.gap[1] + sc.hold[1] <= sc.duration - 1.0, name


def test_planted_bug_failpoints_are_off_unless_armed() -> None:
    from phalanx import failpoints

    failpoints.disarm_all()
    try:
        assert not any(failpoints.on(p) for p in PLANTED.values())
        failpoints.arm("leader.skip_fence_compare", "on")
        assert failpoints.on("leader.skip_fence_compare")
        assert not failpoints.on("twophase.decision_overwrite")
    finally:
        failpoints.disarm_all()


def test_cancels_aim_at_the_admission_window_restarts_and_later() -> None:
    planned = [p for p in plan(11, 400, 1.0, AZS) if "steady" not in p.name]
    cancelled = [p for p in planned if p.cancel_after is not None]
    assert all(p.cancel_aim in CANCEL_AIMS for p in cancelled)
    assert all(not p.cancel_aim for p in planned if p.cancel_after is None)
    by_aim = {a: [p for p in cancelled if p.cancel_aim == a] for a in CANCEL_AIMS}
    # half of the cancels land inside the admission window, a quarter at a restart
    assert 0.35 < len(by_aim["admission"]) / len(cancelled) < 0.65
    assert 0.12 < len(by_aim["restart"]) / len(cancelled) < 0.38
    assert all(0.0 <= p.cancel_after <= ADMISSION_WINDOW_S for p in by_aim["admission"] + by_aim["restart"])
    assert all(0.1 <= p.cancel_after <= 3.0 for p in by_aim["late"])
    # a restart-aimed gang is running, and restartable, whenever a fault strikes
    assert all(p.at + p.duration_s >= 400 - 0.01 and p.max_restarts >= 1 for p in by_aim["restart"])
    # the aims come from a per-gang stream: the rest of the plan is what it was
    assert [(p.at, p.az, p.duration_s, p.cancel_after is None) for p in planned] == \
        [(p.at, p.az, p.duration_s, p.cancel_after is None) for p in plan(11, 400, 1.0, AZS)
         if "steady" not in p.name]


def test_the_fault_watch_follows_the_runner_events_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    watch = FaultWatch(str(path))
    assert not watch.since(0.0)  # no file yet
    inject = json.dumps({"src": "fault", "mono": 10.0, "name": "pause", "action": "inject"})
    path.write_text(json.dumps({"src": "process", "mono": 9.0, "action": "started", "name": "x"}) + "\n"
                    + inject[:20])  # the runner is half-way through a line
    assert not watch.since(0.0)
    with path.open("a") as f:
        f.write(inject[20:] + "\n")
    assert watch.since(0.0) and watch.since(10.5)  # injected after 0; still in effect at 10.5
    with path.open("a") as f:
        f.write(json.dumps({"src": "fault", "mono": 12.0, "name": "pause", "action": "heal"}) + "\n")
    assert watch.since(9.9) and not watch.since(10.0)  # healed: only an injection after the time counts
    assert not FaultWatch("").since(0.0)
