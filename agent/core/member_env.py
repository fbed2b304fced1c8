"""What a member's process is given, pure: its environment, its argv, the
fencing shim's own environment, and the member a marked environment names
(docs/launcher.md "Environment contract"). ``agent.process`` performs it.

No I/O: the agent's own environment comes in as ``base``.
"""

from __future__ import annotations

from typing import Mapping

from agent.core.run_as import Account
from agent.launcher import MemberKey, MemberLaunch

# Built-in member used when a spec has no command (``phalanx up --launch`` with
# specs written for simulated agents): sleeps for run.duration_s. coreutils'
# sleep rather than this interpreter: the member's user (nobody by default)
# may not be able to reach the agent's Python (a virtualenv under /root).
SLEEP_ARGV = ("sleep",)

# Environment variables owned by Phalanx: set on every member, after the spec's
# env and the agent's extra env, so a spec cannot override them (a spec that set
# RANK or CUDA_VISIBLE_DEVICES could break the gang or use devices reserved for
# another member).
ENV_GANG = "PHALANX_GANG"
ENV_INCARNATION = "PHALANX_INCARNATION"
ENV_AGENT_ID = "PHALANX_AGENT_ID"
ENV_NODE = "PHALANX_NODE"
ENV_PLACEMENT = "PHALANX_PLACEMENT"
ENV_EPOCH = "PHALANX_EPOCH"
ENV_WORK_DIR = "PHALANX_WORK_DIR"
OWNED_ENV: frozenset[str] = frozenset({
    ENV_GANG, ENV_INCARNATION, ENV_AGENT_ID, ENV_NODE, ENV_PLACEMENT, ENV_EPOCH, ENV_WORK_DIR, "HOME",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_IB_HCA",
})

# What of a member's environment its shim carries too: the markers a
# restarted agent reads from /proc/<pid>/environ to adopt the member (its
# ``PHALANX_AGENT_ID``) and to name an orphan (``member_key_from_env``). All
# of them are Phalanx-owned (``OWNED_ENV``): no spec can set them.
ADOPTION_ENV = (ENV_AGENT_ID, ENV_GANG, ENV_INCARNATION, "RANK")
# The shim's PATH: a fixed value, never the agent's or the spec's.
SHIM_PATH_VAR = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def member_environment(
    launch: MemberLaunch,
    *,
    agent_id: str,
    base: Mapping[str, str],
    node_addr: str = "127.0.0.1",
    extra_env: Mapping[str, str] | None = None,
    work_dir: str | None = None,
    account: Account | None = None,
) -> dict[str, str]:
    """The environment of one member, lowest precedence first: ``base`` (the
    agent's own environment), ``extra_env`` (node operator), ``launch.env``
    (the spec), then the Phalanx-owned variables, which always win.

    ``work_dir``: the member's own directory, exported as ``PHALANX_WORK_DIR``
    and ``HOME`` (the agent's home is no place for a member's files).
    ``account``: the user it runs as, for ``USER``/``LOGNAME`` (None: the
    agent's own user, whose variables it inherits)."""
    env: dict[str, str] = dict(base)
    env.update(extra_env or {})
    env.update(launch.env)
    key = launch.key
    if work_dir is not None:
        env.update({ENV_WORK_DIR: str(work_dir), "HOME": str(work_dir)})
    if account is not None:
        env.update({"USER": account.name, "LOGNAME": account.name})
    env.update({
        ENV_GANG: key.gang,
        ENV_INCARNATION: str(key.incarnation),
        ENV_AGENT_ID: agent_id,
        ENV_NODE: launch.node or agent_id,
        ENV_PLACEMENT: launch.placement,
        ENV_EPOCH: str(launch.epoch),
        "RANK": str(key.rank),
        "WORLD_SIZE": str(launch.world_size),
        "LOCAL_RANK": str(launch.local_rank),
        "LOCAL_WORLD_SIZE": str(launch.local_world_size),
        # A gang on one node may come without a rendezvous address; this node is
        # then the right one.
        "MASTER_ADDR": launch.master_addr or node_addr,
        "MASTER_PORT": str(launch.master_port),
        # GPU indices come from NVML, which numbers GPUs in PCI bus order; CUDA's
        # default order is "fastest first", which can differ, so without this the
        # member could open GPUs reserved for someone else.
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in launch.gpus),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        # NCCL matches HCA names by prefix ("mlx5_1" also selects mlx5_10..19);
        # the leading "=" asks for exact names, so only the reserved NICs.
        "NCCL_IB_HCA": ("=" + ",".join(launch.nics)) if launch.nics else "",
    })
    return env


def member_command(launch: MemberLaunch) -> list[str]:
    """The argv of a member; the built-in sleeper when the spec has no command."""
    if launch.command:
        return list(launch.command)
    return [*SLEEP_ARGV, repr(float(launch.duration_s))]


def shim_environment(member_env: Mapping[str, str]) -> dict[str, str]:
    """The shim's whole environment, built from scratch: a fixed ``PATH``
    and the member's adoption markers (``ADOPTION_ENV``, which the agent
    owns). Nothing else of the agent's, the operator's or the spec's
    environment: the shim may run as root, and the loader reads ``LD_*``,
    ``GCONV_PATH`` and the like before any code of ours runs."""
    return {"PATH": SHIM_PATH_VAR, **{name: member_env[name] for name in ADOPTION_ENV}}


def member_key_from_env(env: Mapping[str, str]) -> MemberKey | None:
    """The member a process's Phalanx markers name, or None when they do not
    parse (an orphan is killed either way; the key only names it in logs)."""
    try:
        return MemberKey(env[ENV_GANG], int(env[ENV_INCARNATION]), int(env["RANK"]))
    except (KeyError, ValueError):
        return None
