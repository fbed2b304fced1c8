"""The README's blocks run as written, in their order, the way a newcomer
runs them: against a cluster started by ``phalanx up`` (simulated agents,
TLS and etcd auth on, as in the README), each command in a new ``bash`` whose
environment holds nothing of this test's (a plain system PATH, an empty HOME)
but the one ``export`` line ``phalanx up`` printed. No ``phalanx`` or Phalanx
``python3`` is found without that line, so a README that forgets it fails.

Every ``sh`` block of the README is either run here or named in NOT_RUN with
the reason; a new block is one or the other. docs/cli.md's parse test
(tests/unit/test_doc_commands.py) checks every ``phalanx`` line of every doc
against the real parser.
"""

from __future__ import annotations

import re
import subprocess
import uuid
from pathlib import Path

import pytest

from phalanx.etcd_server import EtcdServer
from phalanx.up import UpProcess
from phalanx.up.credentials import ACTIVATION_LINE
from tests.conftest import etcdctl
from tests.pki import EtcdPki, unprovision

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# What a fresh Debian login shell has: nothing of the clone's .venv.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# README sh blocks (by their first line) this test does not run, and why.
NOT_RUN = {
    "scripts/up.sh": "the first command itself: `phalanx up` is started below with a test etcd",
    ".venv/bin/python bench/admission.py": "benchmarks: minutes of load, run by tests/unit/test_benches.py",
}


def readme_blocks(lang: str) -> list[str]:
    """The README's fenced blocks of language ``lang``, in order."""
    return re.findall(rf"```{lang}\n(.*?)```", (REPO / "README.md").read_text(), re.S)


def block_starting(blocks: list[str], prefix: str) -> list[str]:
    (found,) = [b for b in blocks if b.startswith(prefix)]
    return [ln for ln in found.splitlines() if ln.strip()]


def test_every_readme_block_is_run_or_named() -> None:
    run_here = ("export PATH=", "phalanx top", "phalanx certs init")
    for block in readme_blocks("sh"):
        first = block.splitlines()[0].split("#")[0].strip()
        assert first.startswith(run_here) or any(first.startswith(k) for k in NOT_RUN), \
            f"README block starting {first!r} is neither run by test_readme.py nor named in its NOT_RUN"


def test_readme_blocks_run_in_order_in_new_shells(etcd_server: EtcdServer, etcd_pki: EtcdPki, tmp_path: Path) -> None:
    sh = readme_blocks("sh")
    submitting = block_starting(sh, "export PATH=")
    # The README shows the line as `up` prints it; the test uses the one this `up` printed.
    assert ACTIVATION_LINE.match(submitting[0].split("  #")[0].strip()), submitting[0]
    assert any(c.startswith("phalanx submit examples/llama-pretrain.yaml") for c in submitting)
    watching = block_starting(sh, "phalanx top")
    securing = [ln for ln in block_starting(sh, "phalanx certs init") if ln.startswith("phalanx certs ")]
    (python_block,) = [b for b in readme_blocks("python") if "from phalanx.client import Client" in b]

    cluster = "readme" + uuid.uuid4().hex[:8]
    up = UpProcess([
        "--no-workload", "--etcd", etcd_server.endpoint, "--etcd-pki", str(etcd_pki.dir), "--cluster", cluster,
        "--azs", "1", "--coordinators-per-az", "1", "--nodes-per-az", "4", "--spines", "1",
        "--base-port", "0", "--state-dir", str(tmp_path / "up"),
    ])
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(REPO / "examples")
    home = tmp_path / "home"
    home.mkdir()
    # Only what a new login shell has: no venv on PATH, no PHALANX_* of this test's.
    clean = {"PATH": SYSTEM_PATH, "HOME": str(home), "LANG": "C.UTF-8"}
    outputs: list[str] = []

    def shell(command: str, *, activate: bool = True, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        script = f"{up.activation}\n{command}" if activate else command
        done = subprocess.run(["bash", "-c", script], cwd=work, env=clean, capture_output=True, text=True,
                              timeout=timeout)
        outputs.append(f"$ {command}\n{done.stdout}{done.stderr}")
        return done

    try:
        up.start()
        assert f"PHALANX_CONFIG={up.config} " in up.activation, up.activation
        # Without the line a new shell has no phalanx: the line is what makes the README work.
        assert shell("command -v phalanx", activate=False).returncode != 0, outputs[-1]
        for command in submitting[1:]:
            assert shell(command).returncode == 0, "\n".join(outputs)
        watched = next(o for o in outputs if o.startswith("$ phalanx watch llama-pretrain"))
        assert "SUCCEEDED" in watched.splitlines()[-1], watched
        saved = (work / "llama.yaml").read_text()
        assert "state: RUNNING" in saved and "spec:" in saved, saved
        cancelled = next(o for o in outputs if "phalanx cancel tiny" in o)
        assert "CANCELLED" in cancelled, cancelled

        # From Python, with the python3 the line put first on PATH.
        assert shell(f"python3 - <<'EOF'\n{python_block}EOF\n").returncode == 0, "\n".join(outputs)

        for command in securing:
            assert shell(command).returncode == 0, "\n".join(outputs)
        assert (work / "pki" / "ca.crt").is_file()

        for command in watching:
            assert shell(command).returncode == 0, "\n".join(outputs)
        described = next(o for o in outputs if o.startswith("$ phalanx describe llama-pretrain"))
        assert "events:" in described and "SUCCEEDED" in described, described
        print("\n".join(outputs))

        # Over TLS, as the admin certificate up issued: the gang records it.
        gang = shell("phalanx get llama-pretrain")
        assert "submitted by: admin/" in gang.stdout, gang.stdout
        # Without the config: refused, not silently plaintext.
        path_only = up.activation.split(" PHALANX_CONFIG=")[0]
        bare = shell(f"{path_only}\nphalanx --address {up.address} status", activate=False, timeout=60)
        assert bare.returncode != 0 and "--insecure" in bare.stderr, bare.stderr
    finally:
        code = up.stop()
        prefix = f"/phalanx/{cluster}/"
        etcdctl(etcd_server.endpoint, "del", "--prefix", prefix)
        unprovision(etcd_server.endpoint, etcd_pki, cluster)
    assert code == 0, "\n".join(up.lines[-40:])
