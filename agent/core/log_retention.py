"""Which member log directories to delete, pure (docs/launcher.md "Logs");
``agent.member_files`` lists them and deletes the ones chosen here."""

from __future__ import annotations

from typing import Collection, Iterable


def stale_log_dirs(listing: Iterable[tuple[str, int, float]], *, live: Collection[tuple[str, int]],
                   now: float, retention_s: float) -> list[tuple[str, int]]:
    """Of ``(gang, incarnation, newest mtime)`` log directories, those to
    delete: not a running member's, and untouched for ``retention_s``. A
    directory whose mtime lies in the future (clock step) is kept."""
    return sorted((gang, inc) for gang, inc, newest in listing
                  if (gang, inc) not in live and now - newest > retention_s)
