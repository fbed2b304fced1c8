"""``--etcd`` or ``--coordinators`` (agent/coordinator_reads.py): exactly one;
with --coordinators only --tls-dir is needed and --etcd-tls-dir is refused.
One ``error:`` line, exit 2, for ``python -m agent`` and ``agent.sim``."""

from __future__ import annotations

import pytest

from agent.__main__ import main as agent_main
from agent.sim import main as sim_main

BASE = {"agent": (agent_main, ["--az", "a", "--node", "h1"]), "agent.sim": (sim_main, ["--az", "a"])}


@pytest.mark.parametrize("process", sorted(BASE))
@pytest.mark.parametrize("flags, words", [
    ([], "one of the arguments --etcd --coordinators is required"),
    (["--etcd", "127.0.0.1:1", "--coordinators", "127.0.0.1:2"], "not allowed with argument"),
    (["--coordinators", "127.0.0.1:2", "--tls-dir", "T", "--etcd-tls-dir", "E"],
     "--coordinators: not with --etcd-tls-dir"),
    (["--coordinators", "127.0.0.1:2"], "--tls-dir: required (pass --insecure to connect in plaintext)"),
    (["--etcd", "127.0.0.1:1", "--tls-dir", "T"], "--etcd-tls-dir: required"),
])
def test_where_the_agent_reads(process: str, flags: list[str], words: str, capsys) -> None:
    main, base = BASE[process]
    try:
        rc = main([*base, *flags])
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
