"""Logging: peer, round and step on every line (ours and hivemind's), JSON lines for shippers."""

from __future__ import annotations

import io
import json
import logging
import re
import threading

import pytest

from diloco_p2p import logs
from diloco_p2p.logs import get_log_context, log_context, set_log_context, setup_logging

PEER = "12D3KooWQaBcDeFgHiJkLmNoPqRsTuVwXyZ123456789abcdefgh"


@pytest.fixture
def stream():
    """A fresh handler on a buffer; afterwards: our handler removed, levels and hivemind restored."""
    import hivemind.utils.logging as hv_logging

    root = logging.getLogger()
    hv = logging.getLogger("hivemind")
    saved = (root.level, hv.level, hv.propagate, hv_logging._current_mode)
    set_log_context(peer=None, round=None, step=None)
    buf = io.StringIO()
    yield buf
    for h in [h for h in root.handlers if getattr(h, "_diloco_handler", False)]:
        root.removeHandler(h)
    hv_logging.use_hivemind_log_handler(saved[3])
    root.setLevel(saved[0])
    hv.setLevel(saved[1])
    hv.propagate = saved[2]
    set_log_context(peer=None, round=None, step=None)


def lines(buf: io.StringIO) -> list[str]:
    return buf.getvalue().splitlines()


def test_text_line_has_peer_round_step(stream, monkeypatch):
    monkeypatch.delenv("HIVEMIND_LOGLEVEL", raising=False)
    setup_logging("INFO", json_format=False, stream=stream)
    set_log_context(peer=PEER, round=3, step=150)
    logging.getLogger("diloco_p2p.loop.node").info("round %d done", 3)
    (line,) = lines(stream)
    short = PEER[-logs.SHORT_PEER_CHARS:]
    pattern = rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}} INFO +\[peer={short} round=3 step=150\] diloco_p2p.loop.node: round 3 done"
    assert re.fullmatch(pattern, line), line


def test_unset_fields_show_a_dash_and_updates_are_partial(stream):
    setup_logging("INFO", json_format=False, stream=stream)
    logging.getLogger("diloco_p2p").info("before joining")
    set_log_context(peer=PEER)
    set_log_context(round=1)  # peer kept
    set_log_context(step=7)
    logging.getLogger("diloco_p2p").warning("after")
    first, second = lines(stream)
    assert "[peer=- round=- step=-]" in first
    assert f"WARNING [peer={PEER[-8:]} round=1 step=7]" in second


def test_json_lines_parse_with_the_fields(stream):
    setup_logging("DEBUG", json_format=True, stream=stream)
    set_log_context(peer=PEER, round=2, step=99)
    log = logging.getLogger("diloco_p2p.swarm.sync")
    log.debug("matchmaking for round %d", 3)
    log.info('a "quoted"\nmultiline message')
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("all-reduce failed")
    records = [json.loads(line) for line in lines(stream)]  # every line is one JSON object
    assert len(records) == 3
    for r in records:
        assert {"time", "level", "logger", "peer", "round", "step", "message"} <= set(r)
        assert (r["peer"], r["round"], r["step"], r["logger"]) == (PEER[-8:], 2, 99, "diloco_p2p.swarm.sync")
        assert r["time"].endswith("+00:00")
    assert [r["level"] for r in records] == ["DEBUG", "INFO", "ERROR"]
    assert records[0]["message"] == "matchmaking for round 3"
    assert records[1]["message"] == 'a "quoted"\nmultiline message'
    assert "RuntimeError: boom" in records[2]["exception"]


def test_extra_fields_win_over_the_context(stream):
    setup_logging("INFO", json_format=True, stream=stream)
    set_log_context(peer=PEER, round=2, step=99)
    logging.getLogger("diloco_p2p").info("catch-up", extra={"round": 5})
    assert json.loads(lines(stream)[0])["round"] == 5


def test_hivemind_goes_through_our_handler_at_warning(stream, monkeypatch):
    monkeypatch.delenv("HIVEMIND_LOGLEVEL", raising=False)
    from hivemind.utils.logging import get_logger

    hv = get_logger("hivemind.dht.node")  # as hivemind's modules create their loggers
    setup_logging("INFO", json_format=True, stream=stream)
    set_log_context(peer=PEER, round=4, step=200)
    hv.info("routine chatter")
    hv.warning("peer unreachable")
    (line,) = lines(stream)
    r = json.loads(line)
    assert (r["logger"], r["level"], r["message"], r["round"]) == ("hivemind.dht.node", "WARNING", "peer unreachable", 4)

    setup_logging("DEBUG", json_format=False, stream=stream)  # DEBUG opens hivemind up too
    hv.debug("detail")
    assert lines(stream)[-1].endswith("hivemind.dht.node: detail") and "round=4" in lines(stream)[-1]


def test_setup_twice_keeps_one_handler(stream):
    setup_logging("INFO", stream=stream)
    setup_logging("WARNING", stream=stream)
    ours = [h for h in logging.getLogger().handlers if getattr(h, "_diloco_handler", False)]
    assert len(ours) == 1
    logging.getLogger("diloco_p2p").info("dropped")
    logging.getLogger("diloco_p2p").warning("kept")
    assert len(lines(stream)) == 1 and lines(stream)[0].endswith("kept")
    with pytest.raises(ValueError):
        setup_logging("LOUD", stream=stream)


def test_log_context_overrides_only_its_thread():
    set_log_context(peer=PEER, round=1, step=10)
    seen = {}

    def other_thread():
        seen["ctx"] = get_log_context()

    try:
        with log_context(round=9):
            assert get_log_context() == {"peer": PEER[-8:], "round": 9, "step": 10}
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
        assert seen["ctx"]["round"] == 1  # the override stayed in this thread
        assert get_log_context()["round"] == 1  # and ended with the block
    finally:
        set_log_context(peer=None, round=None, step=None)
