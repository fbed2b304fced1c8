"""The log line of each two-phase effect: its level and what it does. PURE.

The driver (coordinator/twophase/driver.py ``perform``) logs one line per
effect it performs, under the effect's gang, incarnation and stimulus id
(phalanx/logfmt.py), so every etcd write, peer call and dispatch of a cross-AZ
gang can be followed back to the event that caused it (docs/logging.md
"Effects"). Effects that change state (an etcd write, a dispatch, a gang's
end) are INFO; the chatty ones (messages between the roles, timers, a
pending reason) are DEBUG, so that INFO stays a few lines per admission.

Keyed by the effect's class name and read with ``getattr``: an effect added
later still gets a line (INFO, its name), never an error.
"""

from __future__ import annotations

import logging
from typing import Any

from phalanx.reservation import HoldState

# Effects that change nothing durable: messages, timers, in-memory notes.
CHATTY = frozenset({
    "SendPrepare", "SendVote", "SendCommit", "SendAbort", "SendFinish", "SendDecisionAck",
    "ScheduleTimeout", "MarkGangPending",
})


def _who(e: Any) -> str:
    gang = getattr(e, "gang", "") or "?"
    inc = getattr(e, "incarnation", None)
    return f"{gang}#{inc}" if inc is not None else gang


def _what(name: str, e: Any) -> str:
    g = _who(e)
    to = getattr(e, "to_az", "")
    match name:
        case "WriteHold":
            state = HoldState.COMMITTED if getattr(e, "commit", False) else HoldState.PREPARED
            return f"write {state.value} hold of {g} in {getattr(e, 'az', '?')}"
        case "MarkCommitted":
            return f"mark the hold of {g} in {getattr(e, 'az', '?')} COMMITTED"
        case "ReleaseHold":
            return f"release the hold of {g} in {getattr(e, 'az', '?')} ({getattr(e, 'reason', '')})"
        case "CreateDecision":
            outcome = getattr(e, "outcome", "")
            return f"create decision {g} = {getattr(outcome, 'value', outcome)} ({getattr(e, 'reason', '')})"
        case "WriteAttempt":
            return f"write the attempt (plan) of {g}"
        case "MarkGangReserved":
            return f"mark {g} RESERVED"
        case "MarkGangFailed":
            return f"fail {g}: {getattr(e, 'reason', '')}"
        case "DispatchGang":
            return f"dispatch {g} in {getattr(e, 'az', '?')}"
        case "SendPrepare":
            return f"send prepare of {g} to {to}"
        case "SendVote":
            return f"send vote {'yes' if getattr(e, 'yes', False) else 'no'} on {g} to {to}"
        case "SendCommit" | "SendAbort" | "SendFinish":
            return f"send {name[len('Send'):].lower()} of {g} to {to}"
        case "SendDecisionAck":
            return f"send decision ack of {g} to {to} (applied={getattr(e, 'applied', '?')})"
        case "ScheduleTimeout":
            fired = getattr(e, "event", None)
            return f"schedule {type(fired).__name__} for {_who(fired)}"
        case "MarkGangPending":
            return f"note {g} pending: {getattr(e, 'reason', '')}"
    return f"{name} for {g}"


def effect_line(e: Any) -> tuple[int, str]:
    """(logging level, message) of performing effect ``e``."""
    name = type(e).__name__
    return (logging.DEBUG if name in CHATTY else logging.INFO), _what(name, e)
