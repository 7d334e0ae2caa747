"""The joiner's side of state sharing: find donors, stream the state from one, verify it.
See `diloco_p2p.swarm.state` for the protocol and the failure handling."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Optional

import hivemind
from hivemind.p2p import P2P, PeerID

from diloco_p2p.logs import short_peer
from diloco_p2p.swarm.state.announcements import (
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    REJECTED,
    VERIFIED,
    StateAnnouncement,
    handler_name,
    list_donors,
    order_candidates,
    state_key,
)
from diloco_p2p.swarm.transport import streams
from diloco_p2p.swarm.transport.streams import NETWORK_ERRORS, WireError

logger = logging.getLogger(__name__)

READ_SIZE = 1 << 20

Progress = Callable[[str, int, int], Optional[Awaitable[None]]]


class StateUnavailable(RuntimeError):
    """No donor could provide a valid state; the message says what was tried and why it failed.
    `forged`: donors whose verified bytes `verify` refused (donor -> why)."""

    forged: dict[str, str] = {}


@dataclass
class FetchedState:
    blob: bytes
    round: int
    sha256: str
    donor: str  # the donor that served the last byte
    seconds: float
    attempts: int  # donors contacted, the successful one included
    bytes: int  # bytes received over the wire, discarded ones included
    params_hash: str | None = None
    failures: list[str] = field(default_factory=list)  # one line per failed attempt
    forged: dict[str, str] = field(default_factory=dict)  # donors whose state `verify` refused, and why


@dataclass
class _Partial:
    """Bytes received so far for one blob, with the running hash and who served them."""

    sha256: str
    size: int
    buf: bytearray = field(default_factory=bytearray)
    hasher: Any = field(default_factory=hashlib.sha256)
    sources: set[str] = field(default_factory=set)

    def add(self, data: bytes, donor: str) -> None:
        self.buf += data
        self.hasher.update(data)
        self.sources.add(donor)


@dataclass
class _Outcome:
    status: str  # ok | busy | corrupt | failed | forged (`verify` refused it)
    reason: str = ""
    received: int = 0


async def _attempt(
    p2p: P2P, run_id: str, ann: StateAnnouncement, part: _Partial, *, stall: float, deadline: float,
    progress: Progress | None,
) -> _Outcome:
    loop = asyncio.get_running_loop()
    got = 0

    def budget() -> float:
        return max(0.0, min(stall, deadline - loop.time()))

    def silent(what: str) -> str:
        if deadline - loop.time() <= 0:
            return f"overall timeout {what}"
        return f"stalled: nothing for {stall:g} s {what}"

    try:
        async with asyncio.timeout(budget()):
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(ann.peer_id), handler_name(run_id))
    except TimeoutError:
        return _Outcome("failed", silent("while connecting"))
    except NETWORK_ERRORS as e:
        return _Outcome("failed", f"unreachable ({type(e).__name__}: {' '.join(str(e).split())[:80]})")
    try:
        try:
            async with asyncio.timeout(budget()):
                request = {"sha256": ann.sha256, "offset": len(part.buf)}
                streams.write_json(writer, request, version=PROTOCOL_VERSION)
                await writer.drain()
                reply = await streams.read_json(reader, MAX_HEADER_BYTES, version=PROTOCOL_VERSION)
        except TimeoutError:
            return _Outcome("failed", silent("waiting for the reply"))
        if reply.get("ok") is not True:
            reason = reply.get("reason") if reply.get("reason") in ("gone", "busy", "bad-request") else "refused"
            detail = str(reply.get("detail", ""))[:120]
            return _Outcome("busy" if reason == "busy" else "failed", f"{reason}: {detail}" if detail else reason)
        if reply.get("size") != ann.size:
            return _Outcome("failed", f"serves {reply.get('size')!r} bytes, announced {ann.size}")
        while len(part.buf) < ann.size:
            try:
                async with asyncio.timeout(budget()):
                    data = await reader.read(min(READ_SIZE, ann.size - len(part.buf)))
            except TimeoutError:
                return _Outcome("failed", silent(f"after {_mb(got)}"), got)
            if not data:
                return _Outcome("failed", f"died: stream ended after {_mb(got)}", got)
            part.add(data, ann.peer_id)
            got += len(data)
            if progress is not None and inspect.isawaitable(r := progress(ann.peer_id, len(part.buf), ann.size)):
                await r
        ok = part.hasher.hexdigest() == ann.sha256
        with suppress(TimeoutError, *NETWORK_ERRORS):  # the blob is ours already; this is courtesy
            async with asyncio.timeout(min(budget(), 5.0)):
                writer.write(VERIFIED if ok else REJECTED)
                await writer.drain()
                await reader.readexactly(1)
        if not ok:
            return _Outcome("corrupt", "sha256 mismatch: corrupt bytes", got)
        return _Outcome("ok", received=got)
    except WireError as e:
        return _Outcome("failed", f"protocol error: {e}", got)
    except NETWORK_ERRORS as e:
        return _Outcome("failed", f"died: connection lost after {_mb(got)} ({type(e).__name__})", got)
    finally:
        writer.close()


async def fetch_state(
    dht: hivemind.DHT,
    p2p: P2P,
    *,
    run_id: str,
    min_round: int | None = None,
    timeout: float = 120.0,
    stall_timeout: float = 10.0,
    exclude: Iterable[str] = frozenset(),
    params_hash: str | None = None,
    prefer: Sequence[str] = (),
    wait: float = 0.0,
    progress: Progress | None = None,
    verify: Callable[[bytes, StateAnnouncement], tuple[str, bool] | None] | None = None,
    accept: Callable[[StateAnnouncement], Awaitable[bool]] | None = None,
) -> FetchedState:
    """Download and verify the newest state announced for `run_id` (see `diloco_p2p.swarm.state`).

    `min_round`: ignore older states. `params_hash`: accept only donors announcing this θ hash.
    `exclude`: peer ids never to ask. `prefer`: peer ids to ask first, in this order (e.g. the
    peers we averaged with last). `wait`: keep looking this long for a qualifying announcement
    before giving up (default: fail at once). `progress(donor, received, size)` is called after
    every read; if it returns an awaitable, that is awaited (tests pause or kill a donor there).
    `verify(blob, announcement)`: a check of a blob whose sha256 matched, beyond it (e.g. that
    its θ is one the swarm vouches for, `codec.StateCheck`): None accepts it; (reason, lied)
    refuses it and the next donor is tried; `lied` (the blob is not what the donor announced)
    also names the donor in `FetchedState.forged`. `accept(announcement)`: whether to try a
    donor at all (before downloading anything). Raises `StateUnavailable` when no donor provides a valid state within `timeout` seconds.
    """
    fetch = _Fetch(dht, p2p, run_id, min_round, params_hash, frozenset(exclude), tuple(prefer), timeout)
    backoff = 0.1
    while True:
        fetch.check_deadline()
        announced, lookup_error = await fetch.lookup()
        candidates = fetch.candidates(announced)
        if accept is not None:
            candidates = [a for a in candidates if await accept(a)]
        if not candidates:
            if fetch.elapsed() < wait and fetch.remaining() > backoff:
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 1.0)
                continue
            raise fetch.nothing_to_try(announced, lookup_error)
        busy = False
        for ann in candidates:
            fetch.check_deadline()
            outcome = await fetch.attempt(ann, stall_timeout, progress)
            if outcome.status == "ok" and verify is not None:
                assert fetch.part is not None
                if (refused := await asyncio.to_thread(verify, bytes(fetch.part.buf), ann)) is not None:
                    why, lied = refused
                    if lied:
                        fetch.forged[ann.peer_id] = why
                    outcome = _Outcome("forged", why, outcome.received)
            if outcome.status == "ok":
                return fetch.fetched(ann)
            busy = fetch.record_failure(ann, outcome) or busy
        if busy:  # come back to the donors that were busy after a pause
            await asyncio.sleep(min(backoff, max(0.0, fetch.remaining())))
            backoff = min(2 * backoff, 1.0)


class _Fetch:
    """What one `fetch_state` call has tried so far: failures, the partial blob, counters."""

    def __init__(
        self, dht: hivemind.DHT, p2p: P2P, run_id: str, min_round: int | None, params_hash: str | None,
        exclude: frozenset[str], prefer: tuple[str, ...], timeout: float,
    ):
        self.dht, self.p2p, self.run_id = dht, p2p, run_id
        self.min_round, self.params_hash, self.exclude, self.prefer = min_round, params_hash, exclude, prefer
        self.me = p2p.peer_id.to_base58()
        self.loop = asyncio.get_running_loop()
        self.t0, self.timeout = self.loop.time(), timeout
        self.deadline = self.t0 + timeout
        self.failed: dict[tuple[str, str], str] = {}  # (donor, sha256) -> why: never asked again
        self.no_resume: set[str] = set()  # sha256s whose mixed-source blob failed: fetch from one donor only
        self.failures: list[str] = []
        self.attempts = self.received = self.busy_refusals = 0
        self.part: _Partial | None = None
        self.forged: dict[str, str] = {}

    def elapsed(self) -> float:
        return self.loop.time() - self.t0

    def remaining(self) -> float:
        return self.deadline - self.loop.time()

    def check_deadline(self) -> None:
        if self.remaining() <= 0:
            raise self.unavailable(f"timed out after {self.timeout:g} s")

    def unavailable(self, why: str) -> StateUnavailable:
        what = f"run {self.run_id!r}" + (f", round >= {self.min_round}" if self.min_round is not None else "")
        tried = f"; {self.attempts} attempts" if self.attempts else ""
        tried += f" ({self.busy_refusals} answered busy)" if self.busy_refusals else ""
        tried += ": " + "; ".join(self.failures) if self.failures else ""
        e = StateUnavailable(f"no valid state for {what} after {self.elapsed():.1f} s: {why}{tried}")
        e.forged = dict(self.forged)
        return e

    async def lookup(self) -> tuple[list[StateAnnouncement], str | None]:
        """The announcements in the DHT, and why the lookup failed if it did."""
        try:
            return await list_donors(self.dht, self.run_id, timeout=max(0.1, min(10.0, self.remaining()))), None
        except (TimeoutError, *NETWORK_ERRORS) as e:
            return [], f"DHT lookup failed ({type(e).__name__})"

    def candidates(self, announced: list[StateAnnouncement]) -> list[StateAnnouncement]:
        """The donors to try now, in order: qualifying, and not failed for that state yet."""
        eligible = [
            a for a in announced
            if a.peer_id != self.me and a.peer_id not in self.exclude
            and (self.min_round is None or a.round >= self.min_round)
            and (self.params_hash is None or a.params_hash == self.params_hash)
        ]
        ordered = order_candidates(eligible, self.me, self.prefer)
        return [a for a in ordered if (a.peer_id, a.sha256) not in self.failed]

    def nothing_to_try(self, announced: list[StateAnnouncement], lookup_error: str | None) -> StateUnavailable:
        if self.failures:
            return self.unavailable("every donor failed")
        if lookup_error:
            return self.unavailable(lookup_error)
        if not announced:
            return self.unavailable(f"no peer announces a state (DHT key {state_key(self.run_id)!r})")
        newest = max(announced, key=lambda a: a.round)
        return self.unavailable(
            f"no announcement qualifies (newest: round {newest.round} from {short_peer(newest.peer_id)})"
        )

    async def attempt(self, ann: StateAnnouncement, stall: float, progress: Progress | None) -> _Outcome:
        """Ask `ann`'s donor for its state, resuming the partial blob when it is the same one."""
        part = self.part
        if part is None or part.sha256 != ann.sha256 or part.size != ann.size or ann.sha256 in self.no_resume:
            part = self.part = _Partial(ann.sha256, ann.size)
        self.attempts += 1
        outcome = await _attempt(
            self.p2p, self.run_id, ann, part, stall=stall, deadline=self.deadline, progress=progress
        )
        self.received += outcome.received
        return outcome

    def fetched(self, ann: StateAnnouncement) -> FetchedState:
        assert self.part is not None
        seconds = self.elapsed()
        logger.info(
            "fetched state round %d (%s) from %s in %.2f s, %d attempt(s)",
            ann.round, _mb(ann.size), short_peer(ann.peer_id), seconds, self.attempts,
        )
        return FetchedState(
            bytes(self.part.buf), ann.round, ann.sha256, ann.peer_id, seconds, self.attempts, self.received,
            ann.params_hash, self.failures, self.forged,
        )

    def record_failure(self, ann: StateAnnouncement, outcome: _Outcome) -> bool:
        """Note a failed attempt; True if the donor was only busy (worth asking again later)."""
        line = f"{short_peer(ann.peer_id)} round {ann.round}: {outcome.reason}"
        logger.info("state fetch attempt %d failed: %s", self.attempts, line)
        if outcome.status == "busy":  # not a failure: come back to it after the others
            self.busy_refusals += 1
            return True
        self.failures.append(line)
        if outcome.status == "corrupt":
            assert self.part is not None
            if len(self.part.sources) > 1:  # cannot tell who lied: refetch this sha from one donor alone
                self.no_resume.add(ann.sha256)
                self.failures[-1] += f" (assembled from {len(self.part.sources)} donors; retrying from one)"
            else:
                self.failed[(ann.peer_id, ann.sha256)] = outcome.reason
            self.part = None
        else:
            self.failed[(ann.peer_id, ann.sha256)] = outcome.reason
            if outcome.status == "forged":  # the bytes are what was announced: that state is not for us
                self.part = None
        return False


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"
