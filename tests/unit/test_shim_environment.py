"""The member's environment on its way to the shim (agent/shim.py ``--env-fd``)
and the shim's own (agent/core/member_env.py ``shim_environment``)."""

from __future__ import annotations

import os
import re

import pytest

from agent.core.member_env import ADOPTION_ENV, OWNED_ENV, SHIM_PATH_VAR, shim_environment
from agent.shim_call import environment_fd
from agent.shim import decode_environment, encode_environment, read_environment_fd


def test_environment_round_trips_through_a_descriptor() -> None:
    env = {"PLAIN": "x", "EMPTY": "", "EQUALS": "a=b=c", "SPACES": " two  words ", "UTF8": "Grüße",
           "NOT_UTF8": os.fsdecode(b"\xff\xfe"), "LD_PRELOAD": "/tmp/x.so"}
    fd = environment_fd(encode_environment(env))
    assert read_environment_fd(fd) == env
    with pytest.raises(OSError):
        os.fstat(fd)  # read_environment_fd closed it


def test_empty_environment_is_empty() -> None:
    assert encode_environment({}) == b""
    assert decode_environment(b"") == {}


@pytest.mark.parametrize(("env", "named"), [
    ({"A=B": "x"}, "'A=B'"),
    ({"": "x"}, "''"),
    ({"A\0B": "x"}, "'A\\x00B'"),
    ({"OK": "x", "BAD": "a\0b"}, "'BAD'"),
])
def test_what_exec_would_refuse_is_refused_by_name(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"environment variable {named}")):
        encode_environment(env)


@pytest.mark.parametrize("data", [b"NOEQUALS\0", b"A=1", b"=x\0"], ids=["no-equals", "unterminated", "no-name"])
def test_garbled_block_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_environment(data)


def test_shim_environment_is_a_fixed_path_and_the_agents_markers() -> None:
    member = {"PATH": "/tenant/bin", "LD_PRELOAD": "/tenant/x.so", "PHALANX_AGENT_ID": "a1",
              "PHALANX_GANG": "g", "PHALANX_INCARNATION": "3", "RANK": "2", "HOME": "/w"}
    assert shim_environment(member) == {"PATH": SHIM_PATH_VAR, "PHALANX_AGENT_ID": "a1", "PHALANX_GANG": "g",
                                        "PHALANX_INCARNATION": "3", "RANK": "2"}


def test_adoption_markers_are_phalanx_owned() -> None:
    # member_environment applies OWNED_ENV after the spec's env: no spec can
    # set what the shim carries, and so what adoption trusts.
    assert set(ADOPTION_ENV) <= OWNED_ENV
