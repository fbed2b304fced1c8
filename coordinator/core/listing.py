"""Pages of a gang list: which gangs one ListGangs reply carries.

Pure: the caller reads the gangs (in pages from etcd), filters them, and sorts
them by ``(submitted_at, id)``; this module picks the slice after a page token
that fits the reply's byte budget and says where the next page starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

SortKey = tuple[float, str]


class BadPageToken(ValueError):
    """A page token this module did not make; the message says why."""


def token_of(key: SortKey) -> str:
    submitted_at, gang_id = key
    return f"{submitted_at!r}|{gang_id}"


def parse_token(token: str) -> SortKey:
    at, sep, gang_id = token.partition("|")
    if not sep or not gang_id:
        raise BadPageToken("not a token from a previous ListGangs reply (want '<time>|<gang id>')")
    try:
        submitted_at = float(at)
    except ValueError:
        raise BadPageToken(f"time part {at[:32]!r} is not a number") from None
    if submitted_at != submitted_at or submitted_at in (float("inf"), float("-inf")):
        raise BadPageToken("time part is not finite")
    return submitted_at, gang_id


def page(items: Sequence[T], key: Callable[[T], SortKey], size: Callable[[T], int],
         budget: int, after: SortKey | None = None) -> tuple[list[T], str]:
    """The items after ``after`` (all when None), in order, as many as fit in
    ``budget`` bytes (at least one, so a page always makes progress), and the
    token of the last one when more remain ("" when this is the last page).
    ``items`` must be sorted by ``key``."""
    start = 0
    if after is not None:
        while start < len(items) and key(items[start]) <= after:
            start += 1
    out: list[T] = []
    used = 0
    for item in items[start:]:
        n = size(item)
        if out and used + n > budget:
            return out, token_of(key(out[-1]))
        out.append(item)
        used += n
    return out, ""
