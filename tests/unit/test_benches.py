"""The benchmarks run from a clone as the docs show them: the placement bench's
default fabric is in the repository, a missing fabric file falls back to the
generated fabric with one line saying so, and every bench prints the machine
it ran on above its tables. (The numbers themselves are never asserted.)"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from bench import placement
from bench.machine import cpu_model, machine_line

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--jobs", "60", "--load", "0.9", "--timing-runs", "2"]
MACHINE = re.compile(r"^machine: \d+( of \d+)? cores \(.+\), \S+ \S+ \S+, Python \d+\.\d+\.\d+$")


def test_placement_default_fabric_is_the_shipped_lingjun_file(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # the default must not depend on where it is run from
    placement.main(TINY)
    lines = capsys.readouterr().out.splitlines()
    assert MACHINE.match(lines[0]), lines[0]
    assert lines[1].startswith("fabric: lingjun2023-topo.csv: 847 nodes, 6776 GPUs, 119 leaves, 3 spines"), lines[1]
    assert not any(ln.startswith("note:") for ln in lines)
    assert placement.DEFAULT_FABRIC.is_relative_to(ROOT) and placement.DEFAULT_FABRIC.is_file()


def test_placement_falls_back_to_the_generated_fabric_with_one_note(capsys: pytest.CaptureFixture[str],
                                                                    tmp_path: Path) -> None:
    missing = tmp_path / "no-such-topo.csv"
    placement.main(["--fabric", str(missing), *TINY])
    lines = capsys.readouterr().out.splitlines()
    assert MACHINE.match(lines[0])
    assert lines[1] == f"note: no fabric file {missing}; using the generated fabric of the same shape instead"
    assert lines[2].startswith("fabric: generated (seed 1): 847 nodes")
    assert [ln for ln in lines if ln.startswith("note:")] == [lines[1]]
    assert "placer" in "\n".join(lines[3:])  # and the tables follow


def test_placement_generated_fabric_on_request(capsys: pytest.CaptureFixture[str]) -> None:
    placement.main(["--fabric", "generated", "--seed", "4", *TINY])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("fabric: generated (seed 4): ")


@pytest.mark.parametrize("text,model", [
    ("processor\t: 0\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n", "AMD EPYC 7B13 64-Core Processor"),
    ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t:   Intel(R)  Xeon(R) \nprocessor : 1\n", "Intel(R) Xeon(R)"),
    ("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\n", ""),  # arm64: no model name
    ("", ""),
])
def test_cpu_model_from_proc_cpuinfo(text: str, model: str) -> None:
    assert cpu_model(text) == model


def test_machine_line_without_proc_cpuinfo_still_names_cores_and_python(tmp_path: Path) -> None:
    line = machine_line(tmp_path / "missing")
    assert MACHINE.match(line), line
    assert f"{len(os.sched_getaffinity(0))} " in line


@pytest.mark.parametrize("content,why", [
    ("{not a csv\n", "not a fabric CSV: no column ip, DSW, PSW, ASW"),
    ("ip,DSW,PSW\n1,G1,P1\n", "not a fabric CSV: no column ASW"),
    ("ip,DSW,PSW,ASW\n", "no nodes"),
    ("ip,DSW,PSW,ASW\n1,G1,P1,S1\n2,G1,,S1\n", "line 3: empty PSW"),
])
def test_placement_refuses_a_file_that_is_not_a_fabric_in_one_line(content: str, why: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """An existing file that is not a fabric CSV is named with the reason, not a traceback from an empty fabric."""
    bad = tmp_path / "fabric.csv"
    bad.write_text(content)
    with pytest.raises(SystemExit) as exc:
        placement.main(["--fabric", str(bad), *TINY])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f": error: --fabric: {bad}: {why}" in err, err


@pytest.mark.parametrize("flag", ["--jobs", "--load", "--timing-runs"])
def test_placement_refuses_nothing_to_measure(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        placement.main([*TINY, flag, "0"])
    assert exc.value.code == 2
    assert f"argument {flag}: must be more than 0, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("tls,plain,shown", [
    (50.0, 100.0, "0.50"),
    (13.9, 10.8, "1.29"),
    (5.0, 0.0, "-"),  # nothing admitted in plaintext: no ratio, not a ZeroDivisionError
    (float("nan"), 10.0, "-"),  # no latency sample (pct of nothing)
    (10.0, float("nan"), "-"),
])
def test_admission_ratio_of_tls_to_plaintext(tls: float, plain: float, shown: str) -> None:
    from bench.admission import ratio

    assert ratio(tls, plain) == shown


def test_admission_medians_per_rate_over_repeats() -> None:
    from bench.admission import median_rows

    runs = [[{"offered": 20.0, "p50": 5.0, "errors": 0}, {"offered": 100.0, "p50": 40.0, "errors": 2}],
            [{"offered": 20.0, "p50": 9.0, "errors": 1}, {"offered": 100.0, "p50": 60.0, "errors": 0}],
            [{"offered": 20.0, "p50": 7.0, "errors": 0}, {"offered": 100.0, "p50": 30.0, "errors": 0}]]
    assert median_rows(runs) == [{"offered": 20.0, "p50": 7.0, "errors": 0},
                                 {"offered": 100.0, "p50": 40.0, "errors": 0}]


@pytest.mark.parametrize("args,why", [
    (["--repeat", "0"], "argument --repeat: must be more than 0, got 0"),
    (["--tls", "maybe"], "argument --tls: invalid choice: 'maybe'"),
])
def test_admission_refuses_bad_arguments_before_starting_anything(args: list[str], why: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    from bench import admission

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        asyncio.run(admission.main(args))
    assert exc.value.code == 2
    assert why in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no etcd dir, no certificates
