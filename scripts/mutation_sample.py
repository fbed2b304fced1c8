#!/usr/bin/env python3
"""A mutation sample of the safety checks (docs/testing.md "Mutation sample").

Each entry of ``MUTATIONS`` is a plausible one-line bug in a safety check:
a file, the line as it is (matched stripped of indentation; it must occur
exactly as often as the entry says) and the line as the bug would have it.
First it runs every test it will use once without any mutant (they must
pass, or a broken test would "catch" every mutant). Then, one at a time, it
writes the bug into the file in place, runs the tests that should catch it
(first the unit and driver-level integration tests of that code, then the
whole unit suite; ``-x``, each run bounded by ``--timeout-s``), and
restores the file in a ``finally`` (also on Ctrl-C or SIGTERM); then it
prints a table: caught (and by which test) or survived.

Run it in a clone of your own, never in a working tree that others (or an
editor) use, since it edits tracked files:

    git clone /work/main /tmp/mut && cd /tmp/mut && ln -s /work/main/.venv .venv
    .venv/bin/python scripts/mutation_sample.py            # every entry
    .venv/bin/python scripts/mutation_sample.py --check    # entries still match the code
    .venv/bin/python scripts/mutation_sample.py --only O1 W1
    .venv/bin/python scripts/mutation_sample.py --only W1 --tests tests/integration/test_leader_perform.py

It refuses to start when a file it would edit has uncommitted changes (the
restore must give back exactly what git has), and checks after each entry
that it did. The tests run with this tree first on PYTHONPATH, so a clone
sharing another tree's virtualenv (an editable install of that tree) tests
its own code.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNIT = "tests/unit"
PERFORM = "tests/integration/test_leader_perform.py"
LAUNCHER = "tests/integration/test_process_launcher.py"
AGENT = ("tests/integration/test_agent_enforcement.py", "tests/integration/test_agent_session_messages.py")
SHIM = "tests/integration/test_fence_shim.py"
LIFECYCLE = "tests/integration/test_lifecycle.py"


@dataclass(frozen=True)
class Mutation:
    id: str
    path: str
    check: str
    """What the line guards, in words."""
    lines: tuple[tuple[str, str], ...]
    """(original, mutated) pairs; one pair but where a check is two lines."""
    tests: tuple[str, ...] = ()
    """Integration tests of this code, run with its own unit tests (``OWN``)
before the whole unit suite."""
    nth: int = 0
    count: int = 1
    """The original line occurs ``count`` times; the ``nth`` (from 0) is mutated."""
    equivalent: str = ""
    """Why this mutant cannot change behaviour (another line checks the same)."""


def m(id: str, path: str, check: str, original: str, mutated: str, *tests: str, **kw: object) -> Mutation:
    return Mutation(id, path, check, ((original, mutated),), tests, **kw)  # type: ignore[arg-type]


OWNER = "coordinator/core/twophase_owner.py"
PART = "coordinator/core/twophase_participant.py"
FX = "coordinator/core/gang_effects.py"
LIFE = "coordinator/core/lifecycle.py"
PEERS = "coordinator/twophase/peer_calls.py"
PEER_CORE = "coordinator/core/peer_calls.py"
SESSION = "agent/session.py"
PROCESS = "agent/process.py"

# Each file's own unit tests, run first for its entries.
OWN: dict[str, tuple[str, ...]] = {
    OWNER: ("tests/unit/test_twophase_owner.py", "tests/unit/test_twophase_model.py"),
    PART: ("tests/unit/test_twophase_participant.py", "tests/unit/test_twophase_model.py"),
    FX: ("tests/unit/test_gang_effects_core.py",),
    LIFE: ("tests/unit/test_lifecycle_core.py",),
    "coordinator/core/admission.py": ("tests/unit/test_admission.py", "tests/unit/test_admission_one_order.py"),
    "coordinator/core/admission_rules.py": ("tests/unit/test_admission_rules.py", "tests/unit/test_admission.py",
                                            "tests/unit/test_admission_one_order.py"),
    "coordinator/core/capacity.py": ("tests/unit/test_capacity_view.py",),
    "agent/core/enforcement.py": ("tests/unit/test_enforcement.py",),
    "agent/shim.py": ("tests/unit/test_fence_lease.py",),
    PEER_CORE: ("tests/unit/test_peer_calls.py",),
}

MUTATIONS: tuple[Mutation, ...] = (
    # two-phase owner
    m("O1", OWNER, "a vote counts only for the incarnation it was cast in",
      "if ev.incarnation != self.incarnation or self.phase is not OwnerPhase.PREPARING:",
      "if self.phase is not OwnerPhase.PREPARING:", PERFORM),
    m("O2", OWNER, "a vote counts only from an AZ of the plan",
      "if ev.from_az not in self.participants:", "if False:", PERFORM),
    m("O3", OWNER, "COMMIT only when every participant voted YES",
      "if all(self.votes.get(az) for az in self.participants):",
      "if any(self.votes.get(az) for az in self.participants):", PERFORM),
    m("O4", OWNER, "the retry after an ABORT is a new incarnation",
      "return self._start_attempt(ev.stimulus_id, self.incarnation + 1)",
      "return self._start_attempt(ev.stimulus_id, self.incarnation)", PERFORM),
    m("O5", OWNER, "a decision applies only to its own incarnation",
      "if incarnation != self.incarnation or self.decision is not None or self.phase not in open_phases:",
      "if self.decision is not None or self.phase not in open_phases:", PERFORM),
    # two-phase participant
    m("P1", PART, "a Prepare older than one already seen is refused",
      "if inc < highest:", "if False:", PERFORM),
    m("P2", PART, "a Prepare older than the held incarnation is refused",
      "if hold.incarnation > inc:", "if False:", PERFORM,
      equivalent="P1's check refuses every such Prepare first: a hold's incarnation is never above the highest "
                 "seen (set when it is prepared and on recovery)"),
    m("P3", PART, "devices of a COMMITTED hold are never preempted",
      "if other.state is HoldState.COMMITTED:", "if False:", PERFORM),
    m("P4", PART, "a younger gang never preempts an older one",
      "elif is_older(other.order_key, mine):", "elif False:", PERFORM),
    m("P5", PART, "an Abort never releases a COMMITTED hold",
      "if held and hold is not None and hold.state is HoldState.COMMITTED:", "if False:", PERFORM),
    # single-AZ gang effects
    m("G1", FX, "a reported member not on a COMMITTED reservation is revoked",
      "if verdict is lifecycle.Reported.ADOPT:", "if True:", PERFORM, LIFECYCLE),
    m("G2", FX, "a reservation is dispatched only once its write applied",
      "if isinstance(event, GangWritten):", "if True:", PERFORM, LIFECYCLE),
    m("G3", FX, "a member reported on a node it was not placed on is only logged",
      "if refused is not None:", "if False:", PERFORM, LIFECYCLE),
    # lifecycle
    m("L1", LIFE, "a member of a torn-down gang is not adopted",
      "and not torn_down(g.state)):", "and True):", PERFORM, LIFECYCLE),
    m("L2", LIFE, "devices are released only once no member may run",
      "if any(reports.get(m.rank, MemberReport(MemberPhase.RUNNING)).phase.live for m in g.placement):",
      "if False:", PERFORM, LIFECYCLE),
    m("L3", LIFE, "a reservation stays RELEASING while a member may run",
      "if reservation is not None and live_nodes:", "if False:", PERFORM, LIFECYCLE),
    m("L4", LIFE, "a member not heard from counts as running",
      "if rep is None or rep.phase.live:", "if rep is not None and rep.phase.live:", PERFORM, LIFECYCLE),
    m("L5", LIFE, "only the owner AZ cancels a gang",
      "if g.owner_az != az:", "if False:", PERFORM, LIFECYCLE),
    # admission and the free view
    m("A1", "coordinator/core/admission_rules.py", "devices placed in a cycle leave its view",
      "self.free[key] = replace(v, free_gpus=v.free_gpus - set(m.gpus), free_nics=v.free_nics - set(m.nics))", "pass"),
    m("A2", "coordinator/core/admission.py", "attempts in flight leave the view",
      "out.append(v if t is None else replace(v, free_gpus=v.free_gpus - set(t[0]), free_nics=v.free_nics - set(t[1])))",
      "out.append(v)"),
    m("A3", "coordinator/core/capacity.py", "held GPUs are not free",
      "free_gpus=frozenset(topo.gpu_indices) - frozenset(used.gpus),", "free_gpus=frozenset(topo.gpu_indices),"),
    m("A4", "coordinator/core/capacity.py", "an unusable NIC is not free",
      "free_nics=frozenset(n.name for n in topo.nics if n.usable) - frozenset(used.nics),",
      "free_nics=frozenset(n.name for n in topo.nics) - frozenset(used.nics),"),
    # the leader's gang writer
    m("W1", "coordinator/gang_writer.py", "a gang write loses against a newer record (or an existing one)",
      "guard = [unchanged_since(keys.gang(new.id), old.mod_revision)] if old else [absent(keys.gang(new.id))]",
      "guard = []", PERFORM),
    # the checks of a peer caller (the peer calls' driver and their core)
    m("D1", PEERS, "a Prepare's caller is its AZ's current leader (read path)",
      "_refuse(decide.caller_refusal(caller, _revision(res.results[0])))", "pass", PERFORM, nth=0, count=2),
    m("D2", PEERS, "a Commit/Abort's caller is its AZ's current leader (read path)",
      "_refuse(decide.caller_refusal(caller, _revision(res.results[0])))", "pass", PERFORM, nth=1, count=2),
    m("D3", PEER_CORE, "a Prepare's caller is its AZ's current leader (watched path)",
      "if record is None or not caller.az or watched_epoch != caller.epoch:",
      "if record is None or not caller.az:", PERFORM),
    m("D4", PEER_CORE, "a Commit/Abort's caller is its AZ's current leader (watched path)",
      "return bool(caller.az) and watched_epoch == caller.epoch and known is want",
      "return bool(caller.az) and known is want", PERFORM),
    m("D5", PEER_CORE, "a Prepare comes from the AZ that owns the gang",
      "if g.owner_az != caller.az:", "if False:", PERFORM),
    # the agent: epoch rule, token check, self-fencing
    m("T1", "agent/core/enforcement.py", "a message older than the highest epoch seen is ignored",
      "if epoch < self.highest:", "if False:", *AGENT),
    m("T2", SESSION, "token: the sender's epoch is still the leader's",
      'if (not leader or leader[0].create_revision != epoch) and not failpoints.on("agent.ignore_stale_epoch"):',
      'if (not leader) and not failpoints.on("agent.ignore_stale_epoch"):', *AGENT),
    m("T3", SESSION, "token: the reservation is COMMITTED for this incarnation",
      "if not hold.holds(gang, incarnation):", "if False:", *AGENT),
    m("T4", SESSION, "token: the reservation gives these GPUs on this node",
      "if self.refusal is not None or (self.granted is not None and set(gpus) <= self.granted):",
      "if True:", *AGENT),
    m("T5", SESSION, "the agent fences its members after fence_after_s without a leader",
      'if live and self.fence.overdue(now) and not failpoints.on("agent.no_fencing"):', "if False:", *AGENT),
    # the shim's own fencing
    m("S1", "agent/shim.py", "the shim fences its member when the lease is stale",
      "if silent > fence_after:", "if False:", SHIM),
    m("S2", "agent/shim.py", "a lease of inf or nan is no lease",
      "return value if math.isfinite(value) else None", "return value", SHIM),
    m("S3", "agent/shim.py", "no readable lease counts as silence from the start",
      "silent = now - (last_contact if last_contact is not None else started)",
      "silent = now - (last_contact if last_contact is not None else now)", SHIM),
    # adoption after an agent restart
    m("R1", PROCESS, "adoption: the process carries this agent's marker",
      "if env is None or env.get(ENV_AGENT_ID) != self._agent_id:", "if env is None:", LAUNCHER),
    Mutation("R2", PROCESS, "adoption: the pid was not reused (its start time is the recorded one)",
             (("if st is None or not st.alive or st.start_ticks != rec.start_ticks:", "if st is None or not st.alive:"),
              ("if not same_process_alive(rec.pid, rec.start_ticks):", "if False:")), (LAUNCHER,)),
    m("R2a", PROCESS, "R2's first compare alone",
      "if st is None or not st.alive or st.start_ticks != rec.start_ticks:", "if st is None or not st.alive:",
      LAUNCHER, equivalent="the re-check after opening the pidfd compares the same start time"),
    m("R2b", PROCESS, "R2's re-check alone",
      "if not same_process_alive(rec.pid, rec.start_ticks):", "if False:",
      LAUNCHER, equivalent="the first compare of _attach compares the same start time"),
)


class Refused(Exception):
    pass


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def mutate(text: str, mut: Mutation) -> str:
    """``text`` with ``mut`` applied; Refused when a line does not match as
    the entry says (the code moved on: update the entry)."""
    lines = text.splitlines(keepends=True)
    for original, mutated in mut.lines:
        hits = [i for i, line in enumerate(lines) if line.strip() == original.strip()]
        if len(hits) != mut.count:
            raise Refused(f"{mut.id}: {mut.path} has {len(hits)} line(s) {original.strip()!r}, expected {mut.count}")
        i = hits[mut.nth]
        line = lines[i]
        indent = line[:len(line) - len(line.lstrip())]
        ending = line[len(line.rstrip("\r\n")):]
        lines[i] = indent + mutated.strip() + ending
    out = "".join(lines)
    compile(out, mut.path, "exec")  # a mutant that does not compile would be "caught" for nothing
    return out


FAILED = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", re.M)  # a test id may hold spaces


def run_tests(tests: list[str], timeout_s: float) -> tuple[str, str, float]:
    """(result, first failing test, seconds): result is caught, survived or
    timeout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x", "-q", "-rfE", "--no-header", *tests]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "timeout", "", time.monotonic() - started
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    took = time.monotonic() - started
    if proc.returncode == 0:
        return "survived", "", took
    found = FAILED.search(out)
    if proc.returncode != 1 or found is None:
        raise Refused(f"pytest exited {proc.returncode} without a failing test:\n{out[-3000:]}")
    return "caught", found.group(1), took


def sample(muts: list[Mutation], timeout_s: float, tests: list[str] | None = None,
           baseline: bool = True) -> list[tuple[Mutation, str, str, float]]:
    paths = sorted({mut.path for mut in muts})
    dirty = git("status", "--porcelain", "--", *paths).strip()
    if dirty:
        raise Refused(f"uncommitted changes in files this would edit (run it in a clean clone):\n{dirty}")
    originals = {p: (ROOT / p).read_bytes() for p in paths}
    for mut in muts:  # every entry still matches before anything is edited
        mutate(originals[mut.path].decode(), mut)
    if baseline:
        # A test that fails without any mutant would "catch" every one.
        every = tests or [UNIT, *sorted({t for mut in muts for t in mut.tests})]
        result, by, took = run_tests(every, timeout_s)
        print(f"base {result:8} {took:6.0f}s {by}", file=sys.stderr, flush=True)
        if result != "survived":
            raise Refused(f"the tests fail without a mutant ({result}: {by}); fix that first")
    rows = []
    for mut in muts:
        target = ROOT / mut.path
        original = originals[mut.path]
        try:
            target.write_text(mutate(original.decode(), mut))
            result, by, took = "survived", "", 0.0
            # The tests of this code first: a caught bug costs seconds, not
            # the unit suite up to the first failure.
            for stage in ([tests] if tests else [[*OWN.get(mut.path, ()), *mut.tests], [UNIT]]):
                if stage and result == "survived":
                    result, by, spent = run_tests(stage, timeout_s)
                    took += spent
        finally:
            target.write_bytes(original)
        if git("status", "--porcelain", "--", mut.path).strip():
            raise Refused(f"{mut.path} not restored after {mut.id}: see git diff")
        rows.append((mut, result, by, took))
        print(f"{mut.id:4} {result:8} {took:6.0f}s {by}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[tuple[Mutation, str, str, float]]) -> str:
    out = ["| id | file | check the line makes | result | first failing test | s |", "|---|---|---|---|---|---|"]
    for mut, result, by, took in rows:
        if result == "survived" and mut.equivalent:
            result = f"survived (equivalent: {mut.equivalent})"
        out.append(f"| {mut.id} | {mut.path} | {mut.check} | {result} | {by.replace('|', '/')} | {took:.0f} |")
    counted = [r for r in rows if not r[0].equivalent]
    caught = sum(1 for r in counted if r[1] == "caught")
    out.append("")
    out.append(f"{caught} of {len(counted)} caught"
               + (f" ({len(rows) - len(counted)} equivalent mutants listed apart)" if len(counted) < len(rows) else ""))
    return "\n".join(out)


def _interrupted(signum: int, frame: object) -> None:
    """SIGTERM: unwind like Ctrl-C, so the edited file is restored."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="ID", help="run these entries only")
    p.add_argument("--check", action="store_true", help="only check that every entry matches the code")
    p.add_argument("--tests", nargs="+", metavar="PATH",
                   help="run these tests for every entry instead of the unit suite and the entry's own "
                        "(to see one test fail with its check removed)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the first run of the tests without any mutant (which must pass)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on one entry's test run (default 900)")
    args = p.parse_args(argv)
    muts = list(MUTATIONS)
    if args.only:
        unknown = set(args.only) - {mut.id for mut in muts}
        if unknown:
            p.error(f"no entries {sorted(unknown)}")
        muts = [mut for mut in muts if mut.id in args.only]
    signal.signal(signal.SIGTERM, _interrupted)
    # Started in the background, a shell hands us SIGINT ignored, and the
    # tests' children would inherit that (a test that interrupts one fails);
    # a handler of our own is reset to the default in every child.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if args.check:
            for mut in muts:
                mutate((ROOT / mut.path).read_text(), mut)
            print(f"{len(muts)} entries match the code")
            return 0
        print(table(sample(muts, args.timeout_s, args.tests, baseline=not args.no_baseline)))
    except Refused as exc:
        print(f"mutation_sample: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
