"""Which etcd advisories apply to which etcd version (phalanx/etcd_version.py;
docs/security.md "etcd versions and advisories"), by table."""

from __future__ import annotations

import logging

import pytest

from phalanx.etcd_version import ADVISORIES, advisories_for, advisory_line, minimum_versions, parse_version

LEASE, NESTED, PREVKV = "CVE-2026-33413", "CVE-2026-33343", "CVE-2026-44283"
ALL = (LEASE, NESTED, PREVKV)


@pytest.mark.parametrize("version, expected", [
    ("3.4.23", ALL),                    # what Debian ships (and the tests run)
    ("3.4.41", ALL),
    ("3.4.42", (PREVKV,)),              # the first two fixed, not the third
    ("3.4.43", (PREVKV,)),
    ("3.4.44", ()),
    ("3.4.50", ()),
    ("3.5.0", ALL),
    ("3.5.27", ALL),
    ("3.5.28", (PREVKV,)),
    ("3.5.29", (PREVKV,)),
    ("3.5.30", ()),
    ("3.6.0", ALL),
    ("3.6.8", ALL),
    ("3.6.9", (PREVKV,)),
    ("3.6.9-rc.0", ALL),                # a pre-release of 3.6.9 comes before it
    ("3.6.10", (PREVKV,)),
    ("3.6.11", ()),
    ("3.6.11-rc.1", (PREVKV,)),
    ("3.6.11+git", ()),                 # build metadata does not change the release
    ("v3.6.12", ()),
    ("3.3.27", ALL),                    # an unmaintained branch gets no fix
    ("2.3.8", ALL),
    ("3.7.0", ()),                      # released after the fixes
    ("4.0.0", ()),
])
def test_advisories_by_version(version: str, expected: tuple[str, ...]) -> None:
    assert tuple(a.id for a in advisories_for(version)) == expected


@pytest.mark.parametrize("bad", ["", "3.4", "3.4.x", "latest", "3.4.23.1", "3.4.23 extra"])
def test_a_version_that_cannot_be_read_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match="etcd version: .* is not MAJOR.MINOR.PATCH"):
        parse_version(bad)
    level, line = advisory_line(bad, "agent n1")
    assert level == logging.WARNING
    assert "cannot tell which etcd advisories apply" in line and all(a in line for a in ALL)


def test_minimum_versions_are_the_last_fix_of_each_branch() -> None:
    assert minimum_versions() == "3.4.44 / 3.5.30 / 3.6.11"
    assert {a.id for a in ADVISORIES} == set(ALL)


def test_the_line_names_each_advisory_and_the_minimums() -> None:
    level, line = advisory_line("3.4.23", "coordinator c0")
    assert level == logging.WARNING
    assert line.startswith("coordinator c0: etcd 3.4.23 lacks fixes for 3 advisories: ")
    for a in ALL:
        assert a in line
    assert "fixed in 3.4.44 / 3.5.30 / 3.6.11" in line and "Production needs 3.4.44 / 3.5.30 / 3.6.11" in line
    level, line = advisory_line("3.5.28", "up")
    assert level == logging.WARNING and PREVKV in line and LEASE not in line and NESTED not in line
    level, line = advisory_line("3.6.11", "up")
    assert level == logging.INFO and "none of the known etcd advisories apply" in line
