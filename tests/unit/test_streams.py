"""Framing shared by matchmaking, the all-reduce and state sharing: exact bytes, bounded reads,
JSON frames with and without a version, and the linger close."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import struct
from types import SimpleNamespace

import pytest

from diloco_p2p.swarm.collective import wire
from diloco_p2p.swarm.transport import streams
from diloco_p2p.swarm.transport.streams import WireError


class _Writer:
    """Collects what a protocol writes (an asyncio.StreamWriter needs a transport)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_frames_are_hivemind_frames_8_byte_big_endian_length_then_bytes():
    w = _Writer()
    assert streams.write_frame(w, b"abc") == 11
    assert bytes(w.data) == b"\x00\x00\x00\x00\x00\x00\x00\x03abc"


def test_matchmaking_join_frames_keep_their_4_byte_length():
    w = _Writer()
    streams.write_json(w, {"s": "wait"}, prefix=4, allow_nan=False)
    assert bytes(w.data) == struct.pack(">I", 12) + b'{"s":"wait"}'
    with pytest.raises(ValueError):  # matchmaking never puts NaN on the wire
        streams.write_json(_Writer(), {"w": math.nan}, prefix=4, allow_nan=False)


def test_versioned_json_puts_v_first_and_compact():
    w = _Writer()
    streams.write_json(w, {"ok": True, "size": 7}, version=1)
    assert bytes(w.data[8:]) == b'{"v":1,"ok":true,"size":7}'
    assert wire.pack_header({"kind": "ping"}) == b'{"v":%d,"kind":"ping"}' % wire.PROTOCOL_VERSION  # the all-reduce's alike


def test_read_frame_refuses_an_oversized_declared_length_before_reading_it():
    async def scenario():
        with pytest.raises(WireError, match="exceeds"):
            await streams.read_frame(_reader((10**12).to_bytes(8, "big"), eof=False), 1024)
        assert await streams.read_frame(_reader((3).to_bytes(8, "big") + b"abc"), 1024) == b"abc"
        assert await streams.read_frame(_reader(b"\x00\x03abc"), 3, prefix=2) == b"abc"
        with pytest.raises(asyncio.IncompleteReadError):  # the peer died mid-frame
            await streams.read_frame(_reader((5).to_bytes(8, "big") + b"abc"), 1024)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("raw", "version", "error"),
    [
        (b"not json", None, "not JSON"),
        (b"\xff\xfe", None, "not JSON"),
        (b"[1, 2]", None, "not a JSON object"),
        (b'{"v": 2}', 1, "not a v1 object"),
        (b'{"ok": true}', 1, "not a v1 object"),
    ],
)
def test_load_json_refuses_what_is_not_our_object(raw, version, error):
    with pytest.raises(WireError, match=error):
        streams.load_json(raw, version=version)


def test_json_frames_round_trip():
    async def scenario():
        w = _Writer()
        streams.write_json(w, {"sha256": "a" * 64, "offset": 3}, version=1)
        streams.write_json(w, {"s": "group", "w": {"p": 1.5}})
        reader = _reader(bytes(w.data))
        first = await streams.read_json(reader, 4096, version=1)
        second = await streams.read_json(reader, 4096)
        return first, second

    assert asyncio.run(scenario()) == ({"v": 1, "sha256": "a" * 64, "offset": 3}, {"s": "group", "w": {"p": 1.5}})


def test_json_frame_over_the_bound_is_refused():
    async def scenario():
        data = json.dumps({"x": "y" * 100}).encode()
        with pytest.raises(WireError):
            await streams.read_json(_reader(len(data).to_bytes(8, "big") + data), 64)

    asyncio.run(scenario())


def test_linger_returns_when_the_peer_closes_and_otherwise_at_the_timeout():
    async def scenario():
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        loop.call_later(0.05, reader.feed_eof)
        t0 = loop.time()
        await streams.linger(reader, 10.0)
        closed_after = loop.time() - t0
        t0 = loop.time()
        await streams.linger(asyncio.StreamReader(), 0.1)  # a peer that never closes
        return closed_after, loop.time() - t0

    closed_after, timed_out_after = asyncio.run(scenario())
    assert closed_after < 5.0
    assert 0.09 <= timed_out_after < 5.0


class _TimedWriter(_Writer):
    """A `_Writer` that notes when (loop time) each write came, and drains at once."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[tuple[float, int]] = []

    def write(self, data: bytes) -> None:
        super().write(data)
        self.times.append((asyncio.get_running_loop().time(), len(data)))

    async def drain(self) -> None:
        return None


def test_a_pacer_shared_by_two_streams_holds_their_sum_to_its_rate_and_keeps_each_frame_whole():
    rate, burst = 200_000.0, 0.005  # bytes/s: 40 KB per stream takes 0.4 s for both
    pacer = streams.Pacer(rate, piece=4096, burst=burst)
    payloads = [bytes(range(256)) * 160, bytes(reversed(range(256))) * 160]  # 40 KiB each
    writers = [_TimedWriter(), _TimedWriter()]

    async def both() -> list[int]:
        paced = (streams.write_frame_paced(w, p, pacer) for w, p in zip(writers, payloads, strict=True))
        return await asyncio.gather(*paced)

    async def timed() -> tuple[float, list[int]]:
        start = asyncio.get_running_loop().time()
        sent = await both()
        return asyncio.get_running_loop().time() - start, sent

    elapsed, sent = asyncio.run(timed())
    assert sent == [8 + len(p) for p in payloads]
    for w, p in zip(writers, payloads, strict=True):  # each stream still carries one well-formed frame
        assert bytes(w.data) == len(p).to_bytes(8, "big") + p
        assert max(n for _, n in w.times) <= 4096
    # whatever the scheduling, the bytes released by any instant t are at most rate * t + a burst
    events = sorted((t, n) for w in writers for t, n in w.times)
    start, released = events[0][0], 0
    for t, n in events:
        released += n
        assert released <= rate * (t - start) + rate * burst + 4096 + 8, (t - start, released)
    assert elapsed >= sum(sent) / rate - burst - 4096 / rate
    with pytest.raises(ValueError):
        streams.Pacer(0)


@pytest.mark.parametrize("rate", [1e6, 25e6])
def test_a_pacer_slices_writes_into_2_ms_of_its_rate_but_no_less_than_16_kib(rate):
    """Each slice costs an event-loop turn: at 200 Mbit/s (25 MB/s) a 1 MB frame goes in 21
    writes of 2 ms each (50 kB), at 8 Mbit/s in 16 KiB ones (each 16 ms of that link)."""
    writer, frame = _TimedWriter(), bytes(1 << 20)
    slice_bytes = max(16 << 10, int(rate * 0.002))

    async def one() -> int:
        return await streams.write_frame_paced(writer, frame, streams.Pacer(rate, burst=10.0))  # no waits

    assert asyncio.run(one()) == 8 + len(frame)
    assert bytes(writer.data) == len(frame).to_bytes(8, "big") + frame
    assert [n for _, n in writer.times[1:]] == [slice_bytes] * (len(frame) // slice_bytes) + (
        [len(frame) % slice_bytes] if len(frame) % slice_bytes else [])


class _Closing(_Writer):
    closed = False

    def close(self) -> None:
        self.closed = True


def test_an_inbound_transfer_runs_for_an_admitted_peer_and_its_end_is_logged_by_whose_fault(caplog):
    """`serve_admitted`: a refused peer's transfer never starts; one that ends early (the peer's
    doing) is a debug line, any other exception is our error with its traceback; the stream is
    closed every time."""
    info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "peer"))
    asked, ran = [], []

    async def admit(peer: str, what: str) -> bool:
        asked.append((peer, what))
        return peer != "peer" or what == "data"

    async def serve(error: BaseException | None = None) -> None:
        ran.append(error)
        if error is not None:
            raise error

    async def one(what: str, error: BaseException | None = None, gate=admit) -> tuple[bool, bool]:
        writer = _Closing()
        admitted = await streams.serve_admitted(info, writer, serve(error), gate, what, logging.getLogger("t"))
        return admitted, writer.closed

    caplog.set_level(logging.DEBUG, logger="t")
    assert asyncio.run(one("state")) == (False, True) and asked == [("peer", "state")] and ran == []
    assert asyncio.run(one("data", WireError("bad frame"))) == (True, True)
    assert asyncio.run(one("state", RuntimeError("bug"), gate=None)) == (True, True)
    assert [type(e) for e in ran] == [WireError, RuntimeError]
    assert [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records] == [
        ("DEBUG", "data transfer ended early: WireError('bad frame')", False),
        ("ERROR", "state transfer failed", True),
    ]
