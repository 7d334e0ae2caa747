"""The joiner's side of state sharing: find donors, stream the state from several, verify it.

The protocol and the failure handling: docs/protocol/state-transfer.md
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import hivemind
from hivemind.p2p import P2P, PeerID

from diloco_p2p.logs import short_peer
from diloco_p2p.swarm.state import stripes
from diloco_p2p.swarm.state.announcements import (
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    StateAnnouncement,
    handler_name,
    list_donors,
    order_candidates,
    state_key,
)
from diloco_p2p.swarm.state.stripes import DonorStream, Progress
from diloco_p2p.swarm.transport import streams
from diloco_p2p.swarm.transport.streams import NETWORK_ERRORS, WireError

logger = logging.getLogger(__name__)

DEFAULT_DONORS = 4  # donors of the same blob a joiner streams from at once (`sync.state_donors`)


class StateUnavailable(RuntimeError):
    """No donor could provide a valid state; the message says what was tried and why it failed.
    `forged`: donors caught lying (a stripe or state unlike what they announced; donor -> why)."""

    forged: dict[str, str] = {}


@dataclass
class FetchedState:
    blob: bytes
    round: int
    sha256: str
    donor: str  # the donor that served the most bytes of it (`by_donor`)
    seconds: float
    attempts: int  # donor streams opened, the successful ones included
    bytes: int  # bytes received over the wire, discarded ones included
    params_hash: str | None = None
    failures: list[str] = field(default_factory=list)  # one line per failed attempt
    forged: dict[str, str] = field(default_factory=dict)  # donors caught lying, and why
    by_donor: dict[str, int] = field(default_factory=dict)  # bytes of the blob each donor served, most first


@dataclass
class _Refused:
    status: str  # busy | failed
    reason: str


async def _open(
    p2p: P2P, run_id: str, ann: StateAnnouncement, *, stall: float, deadline: float
) -> DonorStream | _Refused:
    """A v2 stream to `ann`'s donor, past its header: the donor then serves stripes on request."""
    loop = asyncio.get_running_loop()

    def budget() -> float:
        return max(0.0, min(stall, deadline - loop.time()))

    def silent(what: str) -> str:
        return f"overall timeout {what}" if deadline - loop.time() <= 0 else f"stalled: nothing for {stall:g} s {what}"

    try:
        async with asyncio.timeout(budget()):
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(ann.peer_id), handler_name(run_id))
    except TimeoutError:
        return _Refused("failed", silent("while connecting"))
    except NETWORK_ERRORS as e:
        if "protocol" in str(e).lower() and "not supported" in str(e).lower():
            return _Refused("failed", f"speaks no state protocol v{PROTOCOL_VERSION} (an older release: upgrade it)")
        return _Refused("failed", f"unreachable ({type(e).__name__}: {' '.join(str(e).split())[:80]})")
    try:
        async with asyncio.timeout(budget()):
            streams.write_json(writer, {"sha256": ann.sha256}, version=PROTOCOL_VERSION)
            await writer.drain()
            reply = await streams.read_json(reader, MAX_HEADER_BYTES, version=PROTOCOL_VERSION)
            if reply.get("ok") is not True:
                writer.close()
                reason = reply.get("reason") if reply.get("reason") in ("gone", "busy", "bad-request") else "refused"
                detail = str(reply.get("detail", ""))[:120]
                return _Refused("busy" if reason == "busy" else "failed", f"{reason}: {detail}" if detail else reason)
            layout = await stripes.read_layout(reader, reply, ann.size)
    except TimeoutError:
        writer.close()
        return _Refused("failed", silent("waiting for the header"))
    except WireError as e:
        writer.close()
        return _Refused("failed", f"protocol error: {e}")
    except NETWORK_ERRORS as e:
        writer.close()
        return _Refused("failed", f"died before its header ({type(e).__name__})")
    if isinstance(layout, str):
        writer.close()
        return _Refused("failed", layout)
    return DonorStream(ann, reader, writer, layout)


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
    max_donors: int = DEFAULT_DONORS,
    max_size: int | None = None,
) -> FetchedState:
    """Download and verify the newest state announced for `run_id` (see `diloco_p2p.swarm.state`).

    `min_round`: ignore older states. `params_hash`: accept only donors announcing this θ hash.
    `exclude`: peer ids never to ask. `prefer`: peer ids to ask first, in this order (e.g. the
    peers we averaged with last). `wait`: keep looking this long for a qualifying announcement
    before giving up (default: fail at once). `max_donors`: stream the state from up to this
    many donors of the same blob at once, in stripes (`stripes`). `progress(donor, received,
    size)` is called after every read, `received` counting the bytes from that donor; if it
    returns an awaitable, that is awaited (tests pause or kill a donor there).
    `verify(blob, announcement)`: a check of a blob whose sha256 matched, beyond it (e.g. that
    its θ is one the swarm vouches for, `codec.StateCheck`): None accepts it; (reason, lied)
    refuses it and the next donors are tried; `lied` (the blob is not what the donors announced)
    also names the donors that served it in `FetchedState.forged`. `accept(announcement)`:
    whether to try a donor at all (before downloading anything). `max_size`: the most bytes a
    state of this model can take (`codec.Layout.max_size`); a donor announcing more is named in
    `forged` and never asked, so nothing is allocated for it. Raises `StateUnavailable` when
    no donor provides a valid state within `timeout` seconds.
    """
    if max_donors < 1:
        raise ValueError(f"max_donors must be >= 1, got {max_donors}")
    fetch = _Fetch(dht, p2p, run_id, min_round, params_hash, frozenset(exclude), tuple(prefer), timeout, max_donors,
                   max_size)
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
        group = fetch.group(candidates)
        if not group:  # every candidate answered busy last time: ask again after a pause
            fetch.busy.clear()
            await asyncio.sleep(min(backoff, max(0.0, fetch.remaining())))
            backoff = min(2 * backoff, 1.0)
            continue
        part = await fetch.striped(group, stall_timeout, progress)
        if part is None:
            continue
        if verify is not None and (refused := await asyncio.to_thread(verify, part.buf, group[0])) is not None:
            fetch.refuse(group, *refused)
            continue
        return fetch.fetched(group[0], part.buf, part.by_donor())


class _Fetch:
    """What one `fetch_state` call has tried so far: failures, the partial blob, counters."""

    def __init__(
        self, dht: hivemind.DHT, p2p: P2P, run_id: str, min_round: int | None, params_hash: str | None,
        exclude: frozenset[str], prefer: tuple[str, ...], timeout: float, max_donors: int,
        max_size: int | None = None,
    ):
        self.dht, self.p2p, self.run_id = dht, p2p, run_id
        self.min_round, self.params_hash, self.exclude, self.prefer = min_round, params_hash, exclude, prefer
        self.max_donors, self.max_size = max_donors, max_size
        self.me = p2p.peer_id.to_base58()
        self.loop = asyncio.get_running_loop()
        self.t0, self.timeout = self.loop.time(), timeout
        self.deadline = self.t0 + timeout
        self.failed: dict[tuple[str, str], str] = {}  # (donor, sha256) -> why: never asked again
        self.busy: set[str] = set()  # donors that answered busy in the last pass
        self.failures: list[str] = []
        self.attempts = self.received = self.busy_refusals = 0
        self.part: stripes.Assembly | None = None
        self.served: list[DonorStream] = []  # the donors of the last blob downloaded
        self.sent_by: dict[str, int] = {}  # bytes received per donor (what `progress` reports)
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
        """The donors to try now, in order: qualifying, not caught lying, not failed for that state yet."""
        for a in announced:
            if self.max_size is not None and a.size > self.max_size and a.peer_id not in self.forged:
                self.forged[a.peer_id] = f"announces a state of {a.size} bytes; this model's is at most {self.max_size}"
        eligible = [
            a for a in announced
            if a.peer_id != self.me and a.peer_id not in self.exclude and a.peer_id not in self.forged
            and (self.min_round is None or a.round >= self.min_round)
            and (self.params_hash is None or a.params_hash == self.params_hash)
        ]
        ordered = order_candidates(eligible, self.me, self.prefer)
        return [a for a in ordered if (a.peer_id, a.sha256) not in self.failed]

    def group(self, candidates: list[StateAnnouncement]) -> list[StateAnnouncement]:
        """The donors of the next pass: up to `max_donors` announcing exactly what the first
        candidate not busy announces (the same blob), in candidate order."""
        free = [a for a in candidates if a.peer_id not in self.busy]
        if not free:
            return []
        same = _blob_of(free[0])
        return [a for a in free if _blob_of(a) == same][: self.max_donors]

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

    async def striped(self, group: list[StateAnnouncement], stall: float,
                      progress: Progress | None) -> stripes.Assembly | None:
        """One pass: open every donor of `group`, stream the stripes still missing from those
        that agree on the layout, check the whole blob against the announced sha256. The whole
        blob, or None (the failures are noted; verified stripes are kept for the next pass)."""
        ann = group[0]
        opened = await asyncio.gather(
            *(_open(self.p2p, self.run_id, a, stall=stall, deadline=self.deadline) for a in group)
        )
        self.attempts += len(group)
        self.busy = set()
        donors = [d for d in opened if isinstance(d, DonorStream)]
        for a, d in zip(group, opened, strict=True):
            if isinstance(d, _Refused):
                self.record_failure(a, d.status, d.reason)
        try:
            if not donors:
                return None
            layout = _most_common_layout(donors)
            for d in donors:
                if d.layout != layout:  # set aside, not failed: if the majority's layout is a lie, it is next
                    n = sum(o.layout == layout for o in donors)
                    line = f"{short_peer(d.ann.peer_id)} round {d.ann.round}: its stripe digests differ from {n} other donor(s)'"
                    self.failures.append(line)
                    logger.info("state fetch: %s", line)
            donors = [d for d in donors if d.layout == layout]
            if self.part is None or self.part.sha256 != ann.sha256 or self.part.layout != layout:
                self.part = stripes.Assembly(ann.sha256, layout)
            part = self.part
            await stripes.download(donors, part, stall=stall, deadline=self.deadline, progress=progress,
                                   sent_by=self.sent_by)
            self.received += sum(d.received for d in donors)
            for d in donors:
                if d.status != "ok":
                    self.record_failure(d.ann, d.status, d.reason)
            if part.missing():
                return None
            ok = part.hasher.hexdigest() == ann.sha256  # fed during the download (`Assembly.hash_in_order`)
            await stripes.finish(donors, ok, timeout=max(0.1, min(5.0, self.remaining())))
            self.part, self.served = None, donors
            if not ok:  # every stripe matched the layout and the whole does not: the layout is a lie
                for d in donors:
                    self.record_failure(d.ann, "forged", "its stripe digests do not make up the sha256 it announced")
                return None
            return part
        finally:
            for d in opened:
                if isinstance(d, DonorStream):
                    d.writer.close()

    def refuse(self, group: list[StateAnnouncement], why: str, lied: bool) -> None:
        """`verify` refused the blob of `group`: nobody is asked for it again; if it is not what
        they announced, the donors that served it lied."""
        for d in self.served:
            self.record_failure(d.ann, "forged" if lied else "failed", why)
        for a in group:
            self.failed[(a.peer_id, a.sha256)] = why

    def fetched(self, ann: StateAnnouncement, blob: bytearray, by_donor: dict[str, int]) -> FetchedState:
        seconds = self.elapsed()
        donor = next(iter(by_donor), self.served[0].ann.peer_id)  # (an empty blob has no stripes)
        logger.info(
            "fetched state round %d (%s) from %d donor(s) (%s) in %.2f s, %d attempt(s)",
            ann.round, _mb(ann.size), len(by_donor), ", ".join(map(short_peer, by_donor)), seconds, self.attempts,
        )
        return FetchedState(
            blob, ann.round, ann.sha256, donor, seconds, self.attempts, self.received,
            ann.params_hash, self.failures, self.forged, by_donor,
        )

    def record_failure(self, ann: StateAnnouncement, status: str, reason: str) -> None:
        """Note a failed attempt: a busy donor is asked again after a pause, a failed one is not
        asked for that state again, a lying one (``forged``) not at all."""
        line = f"{short_peer(ann.peer_id)} round {ann.round}: {reason}"
        logger.info("state fetch attempt failed: %s", line)
        if status == "busy":
            self.busy_refusals += 1
            self.busy.add(ann.peer_id)
            return
        self.failures.append(line)
        self.failed[(ann.peer_id, ann.sha256)] = reason
        if status == "forged":
            self.forged[ann.peer_id] = reason


def _blob_of(ann: StateAnnouncement) -> tuple:
    return ann.round, ann.sha256, ann.size, ann.params_hash


def _most_common_layout(donors: list[DonorStream]) -> stripes.Layout:
    """The layout most donors sent (ties: the first donor's in candidate order)."""
    counts = Counter(d.layout for d in donors)
    return max((d.layout for d in donors), key=lambda layout: counts[layout])


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"
