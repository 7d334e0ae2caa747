"""Striped transfers: one state blob streamed from several donors at once, in verified stripes.

A donor's header lists the sha256 of every stripe (`Layout`); the joiner preallocates the blob
once (`Assembly`) and one worker per donor pulls stripes from a shared queue (`download`), so
fast donors serve more. Each stripe is hashed in a thread as it lands; a donor that dies or
stalls gives its stripes back to the queue, one whose stripe differs from its own header is
named, and a layout that does not make up the announced sha256 is caught by the whole-blob
check. Memory: the blob once; stripes are written in place.
The protocol: docs/protocol/state-transfer.md
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import inspect
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Optional

from diloco_p2p.swarm.state.announcements import PROTOCOL_VERSION, VERIFIED, StateAnnouncement
from diloco_p2p.swarm.transport import streams
from diloco_p2p.swarm.transport.streams import NETWORK_ERRORS, WireError

STRIPE_SIZE = 1 << 20  # a donor's default; the joiner takes whatever the layout says, within MAX_STRIPES
MAX_STRIPES = 1 << 16  # bounds the digest list a joiner reads (2 MiB)
DIGEST_BYTES = 32
PIPELINE = 3  # stripe requests a joiner keeps outstanding on one donor's stream
READ_SIZE = 1 << 20

Progress = Callable[[str, int, int], Optional[Awaitable[None]]]


def stripe_count(size: int, stripe_size: int) -> int:
    return -(-size // stripe_size)


def stripe_digests(blob: bytes | memoryview, stripe_size: int) -> bytes:
    """The sha256 digests of `blob`'s stripes, concatenated (what a donor's header carries)."""
    view = memoryview(blob)
    return b"".join(hashlib.sha256(view[a : a + stripe_size]).digest() for a in range(0, len(view), stripe_size))


@dataclass(frozen=True)
class Layout:
    """A blob's stripes as a donor describes them: the stripe size and each stripe's sha256."""

    size: int
    stripe_size: int
    digests: bytes

    @property
    def count(self) -> int:
        return len(self.digests) // DIGEST_BYTES

    def bounds(self, i: int) -> tuple[int, int]:
        return i * self.stripe_size, min(self.size, (i + 1) * self.stripe_size)

    def digest(self, i: int) -> bytes:
        return self.digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]


def check_header(reply: dict[str, Any], size: int) -> tuple[int, int] | str:
    """(stripe size, stripe count) from a donor's ``ok`` header for a blob of `size` bytes, or why
    the header is unacceptable (checked before the digest list is read: it bounds its length)."""
    stripe_size, count = reply.get("stripe_size"), reply.get("stripes")
    if reply.get("size") != size:
        return f"serves {reply.get('size')!r} bytes, announced {size}"
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (stripe_size, count)) or stripe_size <= 0:
        return f"bad stripe header ({stripe_size!r} x {count!r})"
    if count != stripe_count(size, stripe_size) or count > MAX_STRIPES:
        return f"bad stripe header ({count} stripes of {stripe_size} bytes for {size}; at most {MAX_STRIPES})"
    return stripe_size, count


@dataclass
class Assembly:
    """The joiner's copy of one blob under one layout: preallocated, stripes written in place,
    kept across passes (a later pass with the same layout fetches only the missing stripes)."""

    sha256: str
    layout: Layout
    buf: bytearray = field(init=False)
    source: list[str | None] = field(init=False)  # who served each stripe that matched
    hasher: Any = field(init=False)  # the whole blob's sha256 over stripes [0, hashed), fed as they land
    hashed: int = 0

    def __post_init__(self) -> None:
        self.buf = bytearray(self.layout.size)
        self.source = [None] * self.layout.count
        self.hasher = hashlib.sha256()

    async def hash_in_order(self, landed: asyncio.Event, stop: Callable[[], bool]) -> None:
        """Feed the whole-blob hash each run of stripes that landed in order (in a thread,
        overlapping the download), until every stripe is hashed or `stop()`; a pass that ends
        early leaves `hashed` where the next pass picks it up."""
        while self.hashed < self.layout.count:
            landed.clear()
            end = self.hashed
            while end < self.layout.count and self.source[end] is not None:
                end += 1
            if end == self.hashed:
                if stop():
                    return
                await landed.wait()
                continue
            view = memoryview(self.buf)[self.layout.bounds(self.hashed)[0] : self.layout.bounds(end - 1)[1]]
            await asyncio.to_thread(self.hasher.update, view)
            self.hashed = end

    async def mismatch(self, i: int, view: memoryview) -> str | None:
        """Why stripe `i` (its bytes, `view`) is not the layout's, hashed in a thread; None if it is."""
        if await asyncio.to_thread(lambda: hashlib.sha256(view).digest()) == self.layout.digest(i):
            return None
        a, b = self.layout.bounds(i)
        return f"stripe {i} (bytes {a}-{b}) does not match the sha256 in its own header"

    def missing(self) -> list[int]:
        return [i for i, peer in enumerate(self.source) if peer is None]

    def by_donor(self) -> dict[str, int]:
        """Bytes of the blob each donor served, most first."""
        out: dict[str, int] = {}
        for i, peer in enumerate(self.source):
            if peer is not None:
                a, b = self.layout.bounds(i)
                out[peer] = out.get(peer, 0) + b - a
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@dataclass
class DonorStream:
    """One donor's open v2 stream, after its header, and what it did for this pass."""

    ann: StateAnnouncement
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    layout: Layout
    received: int = 0  # bytes read from it, in this pass
    stripes: int = 0  # stripes it served that matched
    status: str = "ok"  # ok | failed | forged (a stripe differed from its own digest)
    reason: str = ""


class _Queue:
    """The stripes still to fetch: the lowest index first; a failed donor's come back."""

    def __init__(self, missing: list[int]):
        self.pending = list(missing)
        heapq.heapify(self.pending)
        self.left = len(missing)
        self._changed = asyncio.Event()

    def take(self) -> int | None:
        return heapq.heappop(self.pending) if self.pending else None

    def give_back(self, stripes: Any) -> None:
        for i in stripes:
            heapq.heappush(self.pending, i)
        self._notify()

    def complete(self) -> None:
        self.left -= 1
        if self.left == 0:
            self._notify()

    async def wait(self) -> None:
        """Until a stripe is given back or every stripe is done."""
        changed = self._changed
        if not self.pending and self.left:
            await changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class _Failed(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


async def _bounded(aw: Awaitable[Any], seconds: float, why: Callable[[], str]) -> Any:
    """`aw`, or a failed donor saying `why()` once `seconds` have passed."""
    try:
        async with asyncio.timeout(seconds):
            return await aw
    except TimeoutError:
        raise _Failed("failed", why()) from None


async def download(
    donors: list[DonorStream], part: Assembly, *, stall: float, deadline: float, progress: Progress | None,
    sent_by: dict[str, int],
) -> None:
    """Fill `part`'s missing stripes from `donors` at once; returns when every stripe is in (and
    fed to `part.hasher`) or every donor failed (each `DonorStream` says how it ended).
    `sent_by` counts bytes per donor over the whole fetch (what `progress` reports)."""
    queue = _Queue(part.missing())
    loop = asyncio.get_running_loop()
    landed, stopped = asyncio.Event(), False
    checking: list[asyncio.Future] = []  # each stripe read, hashed in a thread

    def budget() -> float:
        return max(0.0, min(stall, deadline - loop.time()))

    def silent(what: str) -> str:
        return f"overall timeout {what}" if deadline - loop.time() <= 0 else f"stalled: nothing for {stall:g} s {what}"

    async def read_stripe(d: DonorStream, i: int) -> None:
        a, b = part.layout.bounds(i)
        view, pos, peer = memoryview(part.buf)[a:b], 0, d.ann.peer_id
        while pos < len(view):
            data = await _bounded(d.reader.read(min(READ_SIZE, len(view) - pos)), budget(),
                                  lambda: silent(f"after {_mb(d.received)}"))
            if not data:
                raise _Failed("failed", f"died: stream ended after {_mb(d.received)}")
            view[pos : pos + len(data)] = data
            pos += len(data)
            d.received += len(data)
            sent_by[peer] = sent_by.get(peer, 0) + len(data)
            if progress is not None and inspect.isawaitable(r := progress(peer, sent_by[peer], part.layout.size)):
                await r
        checking.append(asyncio.ensure_future(check(d, i, view)))

    async def check(d: DonorStream, i: int, view: memoryview) -> None:
        """A stripe's sha256 against the layout, in a thread while the donor's next stripes stream in."""
        if (why := await part.mismatch(i, view)) is not None:
            if d.status == "ok":  # its stream ends here; its worker gives back what it had asked for
                d.status, d.reason = "forged", why
                d.writer.close()
            queue.give_back([i])
            return
        part.source[i] = d.ann.peer_id
        d.stripes += 1
        queue.complete()
        landed.set()

    async def work(d: DonorStream) -> None:
        asked: deque[int] = deque()
        try:
            while d.status == "ok":
                while len(asked) < PIPELINE and (i := queue.take()) is not None:
                    streams.write_json(d.writer, {"stripe": i}, version=PROTOCOL_VERSION)
                    asked.append(i)
                if not asked:
                    if not queue.left:
                        return
                    await _bounded(queue.wait(), max(0.0, deadline - loop.time()),
                                   lambda: "overall timeout waiting for stripes")
                    continue
                await _bounded(d.writer.drain(), budget(), lambda: silent("sending a request"))
                await read_stripe(d, asked[0])
                asked.popleft()
        except (_Failed, WireError, *NETWORK_ERRORS) as e:
            if d.status == "ok":  # a lie caught by `check` is what it is named for
                d.status, d.reason = _failure(e, d.received)
        if d.status != "ok":  # a donor still ok keeps its stream open for the verdict (`finish`)
            queue.give_back(asked)
            d.writer.close()

    hashing = asyncio.ensure_future(part.hash_in_order(landed, lambda: stopped))
    try:
        await asyncio.gather(*(work(d) for d in donors))
    finally:
        await asyncio.shield(asyncio.gather(*checking))  # the workers have ended: their last stripes' checks
        stopped = True  # not cancelled: a thread may be feeding the hasher; let it finish
        landed.set()
        await asyncio.shield(hashing)


def _failure(e: BaseException, received: int) -> tuple[str, str]:
    """How a donor's stream ended, as (status, reason)."""
    if isinstance(e, _Failed):
        return e.status, e.reason
    if isinstance(e, WireError):
        return "failed", f"protocol error: {e}"
    return "failed", f"died: connection lost after {_mb(received)} ({type(e).__name__})"


async def read_layout(reader: asyncio.StreamReader, reply: dict[str, Any], size: int) -> Layout | str:
    """The stripe layout of a donor's ``ok`` header (`reply`, then its digest list), or why it
    is unacceptable."""
    shape = check_header(reply, size)
    if isinstance(shape, str):
        return shape
    stripe_size, count = shape
    digests = await streams.read_frame(reader, count * DIGEST_BYTES)
    if len(digests) != count * DIGEST_BYTES:
        return f"sent {len(digests)} bytes of stripe digests, expected {count * DIGEST_BYTES}"
    return Layout(size, stripe_size, digests)


async def finish(donors: list[DonorStream], verified: bool, timeout: float) -> None:
    """Tell the donors still streaming the verdict on the whole blob and wait for each one's
    acknowledgement (`served_count` on their side is then final), bounded; then close."""

    async def one(d: DonorStream) -> None:
        with suppress(TimeoutError, WireError, *NETWORK_ERRORS):
            async with asyncio.timeout(timeout):
                streams.write_json(d.writer, {"done": verified}, version=PROTOCOL_VERSION)
                await d.writer.drain()
                await d.reader.readexactly(len(VERIFIED))
        d.writer.close()

    await asyncio.gather(*(one(d) for d in donors if d.status == "ok"))


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"
