"""Framing on hivemind's libp2p streams, shared by matchmaking, the all-reduce and state sharing.

A message is a sequence of length-prefixed frames, as hivemind's `P2P.send_raw_data` writes
them; every read states an upper bound and refuses a larger declared length before reading it.
JSON frames carry headers and small answers (never pickle). The side that answers last keeps
the stream open until the other side has read the answer and closed it (`linger`): closing at
once lost answers under CPU load. `AnnouncedHandler` serves a handler while its DHT
announcement is kept fresh; `serve_admitted` is how the state server and data sharing serve one
inbound transfer. The framing and the linger close: docs/protocol/wire.md
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import suppress
from typing import Any

from hivemind.p2p import P2PDaemonError

log = logging.getLogger(__name__)

LENGTH_PREFIX = 8  # = hivemind P2P.HEADER_LEN
# What a stream operation raises when the peer or its daemon goes away mid-way.
NETWORK_ERRORS = (OSError, asyncio.IncompleteReadError, P2PDaemonError)


class WireError(ValueError):
    """Bytes from a peer that do not follow our wire format."""


def write_frame(writer: asyncio.StreamWriter, data: bytes, *, prefix: int = LENGTH_PREFIX) -> int:
    """Queue one frame on `writer` (the caller drains); returns the bytes queued."""
    writer.write(len(data).to_bytes(prefix, "big"))
    writer.write(data)  # not concatenated: a chunk of the all-reduce is megabytes
    return prefix + len(data)


class Pacer:
    """Caps what a host writes to all its streams at `rate` bytes/s, in `piece`-byte slices (2 ms of
    the rate, at least 16 KiB) released at most `burst` seconds ahead. Why: docs/protocol/wire.md,
    "Pacing"."""

    def __init__(self, rate: float, *, piece: int | None = None, burst: float = 0.005):
        if rate <= 0:
            raise ValueError("the pacing rate must be > 0 bytes/s")
        if piece is None:  # 2 ms of the rate, at least 16 KiB: fewer writes (and event-loop turns) on a fast link
            piece = max(16 << 10, int(rate * 0.002))
        self.rate, self.piece, self.burst = rate, piece, burst
        self._free_at = 0.0  # when the bytes released so far have left at `rate`

    async def write(self, writer: asyncio.StreamWriter, data: bytes | memoryview) -> None:
        """Write `data` on `writer` at the rate, draining as it goes."""
        view = memoryview(data).cast("B")
        loop = asyncio.get_running_loop()
        for at in range(0, len(view), self.piece):
            piece = view[at:at + self.piece]
            now = loop.time()
            self._free_at = max(self._free_at, now) + len(piece) / self.rate
            if self._free_at - now > self.burst:
                await asyncio.sleep(self._free_at - now - self.burst)
            writer.write(piece)
            await writer.drain()


async def write_frame_paced(writer: asyncio.StreamWriter, data: bytes, pacer: Pacer | None,
                            *, prefix: int = LENGTH_PREFIX) -> int:
    """`write_frame` and drain, at `pacer`'s rate if there is one; returns the bytes written."""
    if pacer is None:
        n = write_frame(writer, data, prefix=prefix)
        await writer.drain()
        return n
    writer.write(len(data).to_bytes(prefix, "big"))  # leaves with the first slice: 8 bytes need no turn of their own
    await pacer.write(writer, data)
    return prefix + len(data)


async def read_frame(reader: asyncio.StreamReader, max_len: int, *, prefix: int = LENGTH_PREFIX) -> bytes:
    """Read one frame, refusing (WireError) a declared length above `max_len` before reading it."""
    length = int.from_bytes(await reader.readexactly(prefix), "big")
    if length > max_len:
        raise WireError(f"frame of {length} bytes exceeds the {max_len} expected")
    return await reader.readexactly(length)


def dump_json(obj: dict[str, Any], *, version: int | None = None, allow_nan: bool = True) -> bytes:
    """Compact JSON bytes of `obj`, with ``"v": version`` first when a version is given."""
    if version is not None:
        obj = {"v": version, **obj}
    return json.dumps(obj, separators=(",", ":"), allow_nan=allow_nan).encode()


def load_json(raw: bytes, *, version: int | None = None) -> dict[str, Any]:
    """The JSON object in `raw` (with ``"v": version`` when a version is given), else WireError."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WireError("frame is not JSON") from None
    if not isinstance(obj, dict):
        raise WireError("frame is not a JSON object")
    if version is not None and obj.get("v") != version:
        raise WireError(f"frame is not a v{version} object")
    return obj


def write_json(
    writer: asyncio.StreamWriter,
    obj: dict[str, Any],
    *,
    prefix: int = LENGTH_PREFIX,
    version: int | None = None,
    allow_nan: bool = True,
) -> int:
    """Queue `obj` as one JSON frame (see `dump_json`); returns the bytes queued."""
    return write_frame(writer, dump_json(obj, version=version, allow_nan=allow_nan), prefix=prefix)


async def read_json(
    reader: asyncio.StreamReader, max_len: int, *, prefix: int = LENGTH_PREFIX, version: int | None = None
) -> dict[str, Any]:
    """Read one JSON-object frame of at most `max_len` bytes (see `load_json`)."""
    return load_json(await read_frame(reader, max_len, prefix=prefix), version=version)


async def linger(reader: asyncio.StreamReader, timeout: float, *, drain: bool = False) -> None:
    """Keep the stream open until the peer closes it (or sends anything), at most `timeout` seconds;
    with `drain`, read and drop what it still sends. Why: docs/protocol/wire.md, "The linger close"."""
    with suppress(TimeoutError, *NETWORK_ERRORS):
        async with asyncio.timeout(timeout):
            while await reader.read(1 << 16) and drain:
                pass


async def serve_admitted(
    info: Any, writer: asyncio.StreamWriter, serve: Coroutine[Any, Any, None],
    admit: Callable[[str, str], Awaitable[bool]] | None, what: str, logger: logging.Logger,
) -> bool:
    """Run `serve`, one inbound `what` transfer, if `admit` lets the peer in, then close the stream; an
    early end is logged at debug, anything else with its traceback. False only for a refused peer."""
    try:
        if admit is not None and not await admit(info.peer_id.to_base58(), what):
            serve.close()
            return False
        await serve
    except (TimeoutError, WireError, *NETWORK_ERRORS) as e:
        logger.debug("%s transfer ended early: %r", what, e)
    except Exception:
        logger.exception("%s transfer failed", what)
    finally:
        writer.close()
    return True


class AnnouncedHandler:
    """A stream handler served while its DHT announcement is refreshed every `period` seconds; `stop`
    cancels the refresh, awaits the withdrawal, then unregisters (transfers in flight may finish)."""

    def __init__(self, p2p: Any, name: str, handle: Callable[..., Awaitable[None]],
                 refresh: Callable[[], Awaitable[Any]], period: float):
        self.p2p, self.name, self.handle, self.refresh, self.period = p2p, name, handle, refresh, period
        self.started = False
        self._task: asyncio.Task | None = None

    async def start(self) -> bool:
        """False if it was already started."""
        if self.started:
            return False
        await self.p2p.add_binary_stream_handler(self.name, self.handle)
        self.started = True
        self._task = asyncio.create_task(self._refresh_loop(), name=f"announce {self.name}")
        return True

    async def stop(self, withdraw: Callable[[], Awaitable[Any]]) -> None:
        if not self.started:
            return
        self.started = False
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
        await withdraw()
        with suppress(*NETWORK_ERRORS):
            await self.p2p.remove_binary_stream_handler(self.name)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                await self.refresh()
            except Exception:
                log.exception("refreshing the announcement of %s failed", self.name)
