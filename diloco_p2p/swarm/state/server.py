"""The state donor: serves this node's state blob to joiners and keeps it announced.

The blob goes over a libp2p stream; the announcement is refreshed in the DHT while it serves.
The protocol: docs/protocol/state-transfer.md
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import suppress
from typing import Any

import hivemind
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from diloco_p2p.swarm.state.announcements import (
    DEFAULT_ANNOUNCE_TTL,
    LEGACY_VERSION,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    VERIFIED,
    AnnouncementValue,
    StateAnnouncement,
    handler_name,
    state_key,
)
from diloco_p2p.swarm.state.stripes import STRIPE_SIZE, stripe_count, stripe_digests
from diloco_p2p.swarm.transport import streams
from diloco_p2p.swarm.transport.streams import NETWORK_ERRORS, AnnouncedHandler
from diloco_p2p.swarm.trust.signing import own_subkey

logger = logging.getLogger(__name__)


class StateServer:
    """Serves this node's state blob to joiners (protocol v2 stripes, v1 from an offset) and keeps it
    announced; `throttle_bytes_per_s` caps each transfer, `max_concurrent` their number (``busy``)."""

    def __init__(
        self,
        dht: hivemind.DHT,
        p2p: P2P,
        *,
        run_id: str,
        chunk_size: int = 1 << 20,
        throttle_bytes_per_s: float | None = None,
        max_concurrent: int = 4,
        announce_ttl: float = DEFAULT_ANNOUNCE_TTL,
        send_timeout: float = 30.0,
        stripe_size: int = STRIPE_SIZE,
    ):
        if min(chunk_size, max_concurrent, announce_ttl, send_timeout, stripe_size) <= 0:
            raise ValueError("chunk_size, max_concurrent, announce_ttl, send_timeout and stripe_size must be positive")
        if throttle_bytes_per_s is not None and throttle_bytes_per_s <= 0:
            raise ValueError("throttle_bytes_per_s must be positive or None")
        self.dht, self.p2p, self.run_id = dht, p2p, run_id
        self.chunk_size, self.throttle, self.max_concurrent = chunk_size, throttle_bytes_per_s, max_concurrent
        self.announce_ttl, self.send_timeout = announce_ttl, send_timeout
        self.stripe_size = stripe_size
        self.peer_id = p2p.peer_id.to_base58()
        self.served_count = 0  # transfers the joiner verified
        self.rejected_count = 0  # transfers the joiner received in full and rejected by hash
        self.refused_count = 0  # requests answered busy or gone
        self.bytes_served = 0
        self.active = 0
        self._blob: bytes | None = None
        self._digests = b""  # of the blob's stripes (`stripes.stripe_digests`)
        self._announcement: StateAnnouncement | None = None
        self._expiration: float | None = None  # of the last record we stored
        self._lock = asyncio.Lock()
        self._served = AnnouncedHandler(p2p, handler_name(run_id), self._handle, self._refresh, announce_ttl / 3)
        self._legacy = handler_name(run_id, LEGACY_VERSION)
        # Whether to serve a peer (its id proven by p2pd): a closed run serves its members only
        # (`diloco_p2p.swarm.trust.admission.Admission.check_stream`); None serves everyone.
        self.admit: Callable[[str, str], Awaitable[bool]] | None = None

    @property
    def announcement(self) -> StateAnnouncement | None:
        return self._announcement

    async def start(self) -> None:
        """Register the stream handler; announce the state if one is already set."""
        if not await self._served.start():
            return
        await self.p2p.add_binary_stream_handler(self._legacy, self._handle_legacy)
        if self._announcement is not None:
            await self._announce()

    async def stop(self) -> None:
        """Withdraw the announcement and unregister the handlers (transfers in flight may finish)."""
        if self._served.started:
            with suppress(*NETWORK_ERRORS):
                await self.p2p.remove_binary_stream_handler(self._legacy)
        await self._served.stop(self.withdraw)

    async def set_state(self, round: int, blob: bytes, params_hash: str | None = None) -> None:
        """Serve `blob` as the state of `round` from now on (announced at once if started).

        Transfers of the previous blob in flight finish; new requests for it are told ``gone``."""
        if not _is_int(round) or round < 0:
            raise ValueError(f"round must be a non-negative int, got {round!r}")
        blob = blob if isinstance(blob, bytes) else bytes(blob)
        digest, stripes = await asyncio.to_thread(
            lambda: (hashlib.sha256(blob).hexdigest(), stripe_digests(blob, self.stripe_size))
        )
        ann = StateAnnouncement(self.peer_id, round, digest, len(blob), params_hash)
        AnnouncementValue.parse_obj(ann.value())  # a bad params_hash fails here, not on every peer
        self._blob, self._digests, self._announcement = blob, stripes, ann
        if self._served.started:
            await self._announce()

    async def withdraw(self, timeout: float = 10.0) -> bool:
        """Stop serving the state (a node that fell behind must not hand out a stale one) and
        replace our record with a tombstone that outlives it. False if no peer took it."""
        self._blob = self._announcement = None
        self._digests = b""
        if self._expiration is None:
            return True
        async with self._lock:
            expiration = max(self._expiration + 1e-3, get_dht_time() + 1.0)
            try:
                ok = await self._store(None, expiration, timeout)
            except (TimeoutError, *NETWORK_ERRORS) as e:
                logger.warning("could not withdraw the state announcement: %r", e)
                return False
            self._expiration = None
            return ok

    async def _announce(self, timeout: float = 10.0) -> bool:
        async with self._lock:
            ann = self._announcement
            if ann is None:
                return False
            expiration = get_dht_time() + self.announce_ttl
            try:
                ok = await self._store(ann.value(), expiration, timeout)
            except (TimeoutError, *NETWORK_ERRORS) as e:
                ok = False
                logger.debug("announcing state round %d failed: %r", ann.round, e)
            self._expiration = max(self._expiration or 0.0, expiration)
            if not ok:
                logger.warning("no DHT peer accepted our state announcement (round %d); retrying later", ann.round)
            return ok

    async def _store(self, value: dict[str, Any] | None, expiration: float, timeout: float) -> bool:
        subkey = own_subkey(self.dht, self.peer_id)  # signed: nobody else can announce for us
        future = self.dht.store(state_key(self.run_id), value, expiration, subkey=subkey, return_future=True)
        return bool(await asyncio.wait_for(future, timeout))

    async def _refresh(self) -> None:
        if self._announcement is not None:
            await self._announce()

    # ------------------------------------------------------------------------- serving

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._guarded(info, writer, self._serve_stripes(reader, writer))

    async def _handle_legacy(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._guarded(info, writer, self._serve_whole(reader, writer))

    async def _guarded(self, info: Any, writer: asyncio.StreamWriter, serve: Coroutine[Any, Any, None]) -> None:
        """Run `serve` for an admitted peer; a transfer's end, however early, is not our error."""
        if not await streams.serve_admitted(info, writer, serve, self.admit, "state", logger):
            self.refused_count += 1  # closing the stream is all a stranger gets

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     version: int) -> tuple[bytes, bytes, int] | None:
        """Read a request: the blob to serve, its stripe digests and the offset asked for; or
        None once the joiner was told why not."""
        async with asyncio.timeout(self.send_timeout):
            request = await streams.read_json(reader, MAX_HEADER_BYTES, version=version)
        blob, digests, ann = self._blob, self._digests, self._announcement
        offset = request.get("offset", 0)
        if blob is None or ann is None or request.get("sha256") != ann.sha256:
            self.refused_count += 1
            now = f"it now serves round {ann.round}" if ann else "it serves no state now"
            await _refuse(writer, "gone", f"the donor no longer holds it; {now}", version)
        elif not _is_int(offset) or not 0 <= offset <= len(blob):
            await _refuse(writer, "bad-request", f"offset {offset!r} out of range", version)
        elif self.active >= self.max_concurrent:
            self.refused_count += 1
            await _refuse(writer, "busy", f"{self.active} transfers running", version)
        else:
            return blob, digests, offset
        return None

    async def _serve_stripes(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """v2: the layout, then each stripe the joiner asks for, until its verdict on the whole."""
        if (admitted := await self._admit(reader, writer, PROTOCOL_VERSION)) is None:
            return
        blob, digests, _ = admitted
        stripe_size = self.stripe_size
        self.active += 1
        try:
            count = stripe_count(len(blob), stripe_size)
            header = {"ok": True, "size": len(blob), "stripe_size": stripe_size, "stripes": count}
            streams.write_json(writer, header, version=PROTOCOL_VERSION)
            streams.write_frame(writer, digests)
            pace = _Pace(self.throttle)
            while True:
                async with asyncio.timeout(self.send_timeout):
                    await writer.drain()
                    request = await streams.read_json(reader, MAX_HEADER_BYTES, version=PROTOCOL_VERSION)
                if "done" in request:
                    return await self._verdict(writer, request["done"] is True)
                i = request.get("stripe")
                if not _is_int(i) or not 0 <= i < count:
                    return await _refuse(writer, "bad-request", f"stripe {i!r} out of range", PROTOCOL_VERSION)
                await self._send(writer, memoryview(blob)[i * stripe_size : (i + 1) * stripe_size], pace)
        finally:
            self.active -= 1

    async def _serve_whole(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """v1 (joiners of older releases): the whole blob from an offset, then the verdict."""
        if (admitted := await self._admit(reader, writer, LEGACY_VERSION)) is None:
            return
        blob, _, offset = admitted
        self.active += 1
        try:
            streams.write_json(writer, {"ok": True, "size": len(blob)}, version=LEGACY_VERSION)
            await self._send(writer, memoryview(blob)[offset:], _Pace(self.throttle))
            await writer.drain()
            async with asyncio.timeout(self.send_timeout):
                verdict = await reader.readexactly(1)
            await self._verdict(writer, verdict == VERIFIED)
        finally:
            self.active -= 1

    async def _send(self, writer: asyncio.StreamWriter, view: memoryview, pace: _Pace) -> None:
        for start in range(0, len(view), self.chunk_size):
            chunk = view[start : start + self.chunk_size]
            writer.write(self._outgoing(chunk))
            async with asyncio.timeout(self.send_timeout):
                await writer.drain()
            self.bytes_served += len(chunk)
            await pace.sent(len(chunk))

    async def _verdict(self, writer: asyncio.StreamWriter, verified: bool) -> None:
        if verified:
            self.served_count += 1
        else:
            self.rejected_count += 1
            logger.warning("a joiner rejected our state by its sha256; our copy may be corrupt")
        writer.write(VERIFIED)  # the count above is done: lets the joiner (and tests) rely on it
        await writer.drain()

    def _outgoing(self, chunk: memoryview) -> bytes | memoryview:
        """The bytes served for `chunk`: itself. The point where a test's donor corrupts what it
        serves (`tests.faults.injection`)."""
        return chunk


class _Pace:
    """Sleeps a transfer down to `rate` bytes/s (None: no cap)."""

    def __init__(self, rate: float | None):
        self.rate, self.bytes = rate, 0
        self.t0 = asyncio.get_running_loop().time()

    async def sent(self, n: int) -> None:
        self.bytes += n
        if self.rate is not None and (ahead := self.bytes / self.rate - (asyncio.get_running_loop().time() - self.t0)) > 0:
            await asyncio.sleep(ahead)


async def _refuse(writer: asyncio.StreamWriter, reason: str, detail: str, version: int) -> None:
    streams.write_json(writer, {"ok": False, "reason": reason, "detail": detail}, version=version)
    await writer.drain()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
