"""phalanx.logfmt: the JSON and text formatters, the log context and how it
nests across asyncio tasks, stimulus ids, configure()."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
import threading
import warnings

import pytest

from coordinator.core.twophase_events import HoldWritten
from phalanx import logfmt
from phalanx.logfmt import bind, bind_event, current, log_context, new_stimulus


def record(msg: str = "m", *args, exc_info=None, **extra) -> logging.LogRecord:
    r = logging.LogRecord("phalanx.test", logging.INFO, __file__, 1, msg, args, exc_info)
    for k, v in extra.items():
        setattr(r, k, v)
    return r


def as_json(rec: logging.LogRecord, static=None) -> dict:
    line = logfmt.JsonFormatter("coordinator", static).format(rec)
    assert "\n" not in line  # one record, one line
    return json.loads(line)


@pytest.fixture
def clean_logging():
    """configure() changes the root logger, warnings capture and the
    excepthook: put them back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    hooks = sys.excepthook, threading.excepthook, sys.unraisablehook
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    sys.excepthook, threading.excepthook, sys.unraisablehook = hooks
    logging.captureWarnings(False)


# ------------------------------------------------------------------- json
@pytest.mark.parametrize(
    "bound,extra,expect",
    [
        ({}, {}, {"az": "a", "epoch": None}),
        ({"epoch": 7}, {}, {"az": "a", "epoch": 7}),
        ({"epoch": 7, "gang": "g-1", "incarnation": 2, "stimulus": "a-3"}, {},
         {"az": "a", "epoch": 7, "gang": "g-1", "incarnation": 2, "stimulus": "a-3"}),
        ({"gang": "g-1"}, {"gang": "g-2", "node": "n1"}, {"az": "a", "epoch": None, "gang": "g-2", "node": "n1"}),
        ({"az": "b"}, {}, {"az": "b", "epoch": None}),
    ],
    ids=["nothing bound: the process's az, epoch present as null", "bound epoch", "a decision's full context",
         "extra= on the call wins over the context", "a bound az wins over the process's"],
)
def test_json_fields(bound, extra, expect):
    with log_context(**bound):
        line = as_json(record(**extra), {"id": "c1", "az": "a"})
    assert line["component"] == "coordinator" and line["level"] == "INFO" and line["id"] == "c1"
    assert line["logger"] == "phalanx.test" and line["message"] == "m"
    for k in logfmt.FIELDS:
        if k in expect:
            assert line[k] == expect[k], k
        else:
            assert k not in line, k


def test_json_time_is_utc_rfc3339_with_milliseconds():
    r = record()
    r.created = 1764620000.25  # 2025-12-01T20:13:20.250Z
    assert as_json(r)["time"] == "2025-12-01T20:13:20.250Z"


def test_json_message_args_newlines_and_odd_values_stay_one_parsable_line(tmp_path):
    with log_context(gang=tmp_path):  # not a JSON type: written as its str
        line = as_json(record("two\nlines %s %d", "é", 3))
    assert line["message"] == "two\nlines é 3"
    assert line["gang"] == str(tmp_path)


def test_json_exception_in_exc_field():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        line = as_json(record("failed", exc_info=sys.exc_info()))
    assert line["message"] == "failed"
    assert "RuntimeError: boom" in line["exc"] and line["exc"].startswith("Traceback")


def test_static_fields_are_checked():
    with pytest.raises(TypeError, match="unknown field.*colour"):
        logfmt.JsonFormatter("agent", {"colour": "red"})


# ------------------------------------------------------------------- text
def test_text_line_appends_the_bound_context_in_field_order():
    f = logfmt.TextFormatter("c1")
    assert "[" not in f.format(record("plain"))
    with log_context(stimulus="a-9", gang="g-1", epoch=4):
        text = f.format(record("admitted"))
    assert text.endswith(" c1 INFO phalanx.test: admitted [epoch=4 gang=g-1 stimulus=a-9]")


def test_text_traceback_stays_below_the_line():
    try:
        raise ValueError("bad")
    except ValueError:
        r = record("oops", exc_info=sys.exc_info())
    with log_context(gang="g"):
        first, *rest = logfmt.TextFormatter("c1").format(r).split("\n")
    assert first.endswith("oops [gang=g]")
    assert rest[-1] == "ValueError: bad"


# ---------------------------------------------------------------- context
def test_nesting_overrides_and_restores():
    assert current() == {}
    with log_context(epoch=1, gang="outer"):
        with log_context(gang="inner", node=None):  # None: keep the outer value
            assert current() == {"epoch": 1, "gang": "inner"}
        assert current() == {"epoch": 1, "gang": "outer"}
        with pytest.raises(KeyError):
            with log_context(stimulus="s"):
                raise KeyError("x")
        assert current() == {"epoch": 1, "gang": "outer"}  # restored after an exception too
    assert current() == {}


def test_unknown_field_is_refused_with_the_known_ones():
    with pytest.raises(TypeError, match=r"unknown field\(s\) gangs .*known: az, epoch, gang"):
        with log_context(gangs="g"):
            pass


async def test_tasks_inherit_the_context_they_were_created_in_and_keep_their_own():
    seen: dict[str, dict] = {}
    both_bound = asyncio.Event()
    n_bound = 0

    async def member(name: str) -> None:
        nonlocal n_bound
        seen[f"{name}-start"] = current()
        bind(gang=name, stimulus=new_stimulus("t"))
        n_bound += 1
        if n_bound == 2:
            both_bound.set()
        await both_bound.wait()  # the sibling has bound its own by now
        seen[name] = current()

    with log_context(epoch=5):
        tasks = [asyncio.create_task(member("g1")), asyncio.create_task(member("g2"))]
    # The block has ended: the tasks still carry the epoch they were created with.
    assert current() == {}
    await asyncio.gather(*tasks)
    assert seen["g1-start"] == seen["g2-start"] == {"epoch": 5}
    assert seen["g1"]["gang"] == "g1" and seen["g2"]["gang"] == "g2"
    assert seen["g1"]["stimulus"] != seen["g2"]["stimulus"]
    assert seen["g1"]["epoch"] == seen["g2"]["epoch"] == 5
    assert current() == {}  # what the tasks bound never reached their parent


async def test_a_context_entered_inside_a_task_ends_with_it_while_another_task_runs():
    inside = asyncio.Event()
    release = asyncio.Event()

    async def holder() -> None:
        with log_context(gang="held"):
            inside.set()
            await release.wait()
            assert current() == {"gang": "held"}

    t = asyncio.create_task(holder())
    await inside.wait()
    assert current() == {}  # the other task's block is not ours
    release.set()
    await t


def test_bind_event_takes_gang_incarnation_and_stimulus_of_a_two_phase_event():
    async def run() -> dict:
        bind_event(HoldWritten(stimulus_id="submit:g-1:2", gang="g-1", incarnation=2))
        return current()

    assert asyncio.run(run()) == {"gang": "g-1", "incarnation": 2, "stimulus": "submit:g-1:2"}
    assert current() == {}  # bound inside asyncio.run's task only


def test_stimulus_ids_are_prefixed_and_unique():
    ids = [new_stimulus("a") for _ in range(1000)] + [new_stimulus("node-1") for _ in range(10)]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith(("a-", "node-1-")) and i.rsplit("-", 1)[1].isdigit() for i in ids)


# -------------------------------------------------------------- configure
def test_configure_json_sends_every_record_and_warning_as_json(clean_logging):
    out = io.StringIO()
    logfmt.configure("info", "json", "agent", static={"id": "n1", "az": "a", "node": "n1"}, stream=out)
    log = logging.getLogger("agent.test")
    with log_context(gang="g-1", incarnation=1):
        log.info("launched")
    log.debug("not at INFO")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("deprecated thing", DeprecationWarning)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["message"] for x in lines][0] == "launched"
    assert len(lines) == 2 and "deprecated thing" in lines[1]["message"]
    assert lines[0]["node"] == "n1" and lines[0]["gang"] == "g-1" and lines[0]["incarnation"] == 1
    assert all(x["component"] == "agent" and x["az"] == "a" for x in lines)


def test_configure_json_logs_an_uncaught_exception_as_json(clean_logging):
    out = io.StringIO()
    logfmt.configure("info", "json", "coordinator", stream=out)
    try:
        raise OSError("disk gone")
    except OSError:
        sys.excepthook(*sys.exc_info())
    line = json.loads(out.getvalue())
    assert line["level"] == "CRITICAL" and "disk gone" in line["message"] and "OSError" in line["exc"]


def test_configure_json_logs_thread_and_unraisable_exceptions_as_json(clean_logging):
    out = io.StringIO()
    logfmt.configure("info", "json", "agent", stream=out)

    def fail() -> None:
        raise RuntimeError("in a thread")

    t = threading.Thread(target=fail, name="scraper")
    t.start()
    t.join()

    class Bad:
        def __del__(self) -> None:
            raise ValueError("in __del__")

    Bad()  # collected at once (CPython refcounting): "Exception ignored in ..."
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["level"] for x in lines] == ["ERROR", "WARNING"]
    assert "scraper" in lines[0]["message"] and "RuntimeError: in a thread" in lines[0]["exc"]
    assert "in __del__" in lines[1]["message"] and "ValueError" in lines[1]["exc"]


def test_configure_text_keeps_the_classic_line(clean_logging):
    out = io.StringIO()
    logfmt.configure("info", "text", "coordinator", name="c1", stream=out)
    logging.getLogger("coordinator.leader").warning("hello")
    assert out.getvalue().rstrip().endswith(" c1 WARNING coordinator.leader: hello")


def test_configure_leaves_logging_someone_else_set_up_alone(clean_logging):
    theirs = logging.StreamHandler(io.StringIO())
    logging.getLogger().handlers[:] = [theirs]
    assert logfmt.configure("info", "json", "coordinator") is None
    assert logging.getLogger().handlers == [theirs]


@pytest.mark.parametrize("fmt,level,match", [
    ("xml", "info", "--log-format: 'xml' is not one of text, json"),
    ("json", "loud", "--log-level: 'loud' is not a logging level"),
])
def test_configure_bad_input_names_the_flag(clean_logging, fmt, level, match):
    with pytest.raises(ValueError, match=match):
        logfmt.configure(level, fmt, "coordinator", stream=io.StringIO())
