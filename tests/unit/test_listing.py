"""Table tests of ListGangs paging (coordinator/core/listing.py)."""

from __future__ import annotations

import pytest

from coordinator.core.listing import BadPageToken, page, parse_token, token_of

# (submitted_at, id, bytes)
G = [(1.0, "a", 10), (2.0, "b", 10), (2.0, "c", 30), (3.5, "d", 10)]


def key(g):
    return g[0], g[1]


def size(g):
    return g[2]


@pytest.mark.parametrize("budget, after, want_ids, want_next", [
    (100, None, ["a", "b", "c", "d"], ""),            # all fit
    (20, None, ["a", "b"], token_of((2.0, "b"))),     # budget reached exactly
    (25, None, ["a", "b"], token_of((2.0, "b"))),     # c would pass the budget
    (5, None, ["a"], token_of((1.0, "a"))),           # one item always, progress
    (100, (2.0, "b"), ["c", "d"], ""),                # same time, later id
    (30, (2.0, "b"), ["c"], token_of((2.0, "c"))),
    (100, (3.5, "d"), [], ""),                        # past the end
    (100, (0.0, "z"), ["a", "b", "c", "d"], ""),      # before the start
])
def test_page(budget, after, want_ids, want_next):
    got, nxt = page(G, key, size, budget, after)
    assert [g[1] for g in got] == want_ids
    assert nxt == want_next


def test_pages_cover_everything_once():
    seen, after = [], None
    while True:
        got, nxt = page(G, key, size, 15, after)
        seen += [g[1] for g in got]
        if not nxt:
            break
        after = parse_token(nxt)
    assert seen == ["a", "b", "c", "d"]


@pytest.mark.parametrize("token", [1722500000.123456, 0.0, 1e-9])
def test_token_round_trip(token):
    assert parse_token(token_of((token, "g-1"))) == (token, "g-1")


@pytest.mark.parametrize("bad", ["", "x", "abc|g", "1.0|", "nan|g", "inf|g"])
def test_bad_tokens_are_refused(bad):
    with pytest.raises(BadPageToken):
        parse_token(bad)
