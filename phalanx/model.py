"""Domain enums shared by the client, the coordinator and the agent.

Pure: no I/O, no protobuf. Integer values match the wire enums in
``proto/phalanx/v1/types.proto`` so conversion is a cast.
"""

from __future__ import annotations

import enum


class Level(enum.IntEnum):
    """Network levels, leaf to root (docs/design.md §11). Ordering is meaningful:
    a smaller level is a tighter domain."""

    NVLINK_DOMAIN = 1
    NODE = 2
    LEAF = 3
    SPINE = 4
    AZ = 5
    REGION = 6

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> "Level":
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(
                f"unknown topology level {text!r}; expected one of "
                + ", ".join(level.label for level in cls)
            ) from None


class GangState(enum.IntEnum):
    PENDING = 1
    RESERVING = 2
    RESERVED = 3
    STARTING = 4
    RUNNING = 5
    SUCCEEDED = 6
    FAILED = 7
    CANCELLED = 8
    RESTARTING = 9

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES

    @property
    def holds_devices(self) -> bool:
        """States in which the gang owns a committed reservation."""
        return self in (GangState.RESERVED, GangState.STARTING, GangState.RUNNING)

    @classmethod
    def parse(cls, text: str) -> "GangState":
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(
                f"unknown gang state {text!r}; expected one of "
                + ", ".join(s.name for s in cls)
            ) from None


TERMINAL_STATES = frozenset({GangState.SUCCEEDED, GangState.FAILED, GangState.CANCELLED})


class PcieDistance(enum.IntEnum):
    """GPU↔NIC relation as ``nvidia-smi topo -m`` prints it; smaller is closer."""

    PIX = 1
    PXB = 2
    PHB = 3
    NODE = 4
    SYS = 5


class MemberPhase(enum.IntEnum):
    STARTING = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4
    STOPPED = 5
    REJECTED = 6

    @property
    def live(self) -> bool:
        return self in (MemberPhase.STARTING, MemberPhase.RUNNING)


class EventKind(str, enum.Enum):
    """Kinds of a gang's events (coordinator/core/events.py, docs/events.md).
    Strings on the wire and in etcd, so a newer kind still reads as text."""

    SUBMITTED = "submitted"
    PLACED = "placed"
    RESERVED = "reserved"
    STARTED = "started"
    MEMBER_EXITED = "member_exited"
    RESTARTING = "restarting"
    FENCED = "fenced"
    ADOPTED = "adopted"
    CANCELLED = "cancelled"
    FINISHED = "finished"
    DROPPED = "dropped"  # the marker standing for the oldest events, dropped to keep the bound
