"""The state donor: serves this node's state blob to joiners over a libp2p stream and keeps it
announced in the DHT. See `diloco_p2p.swarm.state` for the protocol."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import hivemind
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from diloco_p2p.swarm.state.announcements import (
    DEFAULT_ANNOUNCE_TTL,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    VERIFIED,
    AnnouncementValue,
    StateAnnouncement,
    handler_name,
    state_key,
)
from diloco_p2p.swarm.transport import streams
from diloco_p2p.swarm.transport.streams import NETWORK_ERRORS, AnnouncedHandler, WireError
from diloco_p2p.swarm.trust.signing import own_subkey

logger = logging.getLogger(__name__)


class StateServer:
    """Serves this node's current state blob to joiners and keeps it announced in the DHT.

    `throttle_bytes_per_s` caps each transfer's rate (a volunteer's uplink; tests use it to
    make a transfer slow enough to kill the donor in the middle). `max_concurrent` caps the
    transfers served at once; past it, joiners are told ``busy`` and go to another donor.
    """

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
    ):
        if chunk_size <= 0 or max_concurrent <= 0 or announce_ttl <= 0 or send_timeout <= 0:
            raise ValueError("chunk_size, max_concurrent, announce_ttl and send_timeout must be positive")
        if throttle_bytes_per_s is not None and throttle_bytes_per_s <= 0:
            raise ValueError("throttle_bytes_per_s must be positive or None")
        self.dht, self.p2p, self.run_id = dht, p2p, run_id
        self.chunk_size, self.throttle, self.max_concurrent = chunk_size, throttle_bytes_per_s, max_concurrent
        self.announce_ttl, self.send_timeout = announce_ttl, send_timeout
        self.peer_id = p2p.peer_id.to_base58()
        self.served_count = 0  # transfers the joiner verified
        self.rejected_count = 0  # transfers the joiner received in full and rejected by hash
        self.refused_count = 0  # requests answered busy or gone
        self.bytes_served = 0
        self.active = 0
        self._blob: bytes | None = None
        self._announcement: StateAnnouncement | None = None
        self._expiration: float | None = None  # of the last record we stored
        self._lock = asyncio.Lock()
        self._served = AnnouncedHandler(p2p, handler_name(run_id), self._handle, self._refresh, announce_ttl / 3)
        # Whether to serve a peer (its id proven by p2pd): a closed run serves its members only
        # (`diloco_p2p.swarm.trust.admission.Admission.check_stream`); None serves everyone.
        self.admit: Callable[[str, str], Awaitable[bool]] | None = None

    @property
    def announcement(self) -> StateAnnouncement | None:
        return self._announcement

    async def start(self) -> None:
        """Register the stream handler; announce the state if one is already set."""
        if await self._served.start() and self._announcement is not None:
            await self._announce()

    async def stop(self) -> None:
        """Withdraw the announcement and unregister the handler (transfers in flight may finish)."""
        await self._served.stop(self.withdraw)

    async def set_state(self, round: int, blob: bytes, params_hash: str | None = None) -> None:
        """Serve `blob` as the state of `round` from now on (announced at once if started).

        Transfers of the previous blob in flight finish; new requests for it are told ``gone``."""
        if not _is_int(round) or round < 0:
            raise ValueError(f"round must be a non-negative int, got {round!r}")
        blob = blob if isinstance(blob, bytes) else bytes(blob)
        digest = await asyncio.to_thread(lambda: hashlib.sha256(blob).hexdigest())
        ann = StateAnnouncement(self.peer_id, round, digest, len(blob), params_hash)
        AnnouncementValue.parse_obj(ann.value())  # a bad params_hash fails here, not on every peer
        self._blob, self._announcement = blob, ann
        if self._served.started:
            await self._announce()

    async def withdraw(self, timeout: float = 10.0) -> bool:
        """Stop serving the state (a node that fell behind must not hand out a stale one) and
        replace our record with a tombstone that outlives it. False if no peer took it."""
        self._blob = self._announcement = None
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
        try:
            if self.admit is not None and not await self.admit(info.peer_id.to_base58(), "state"):
                self.refused_count += 1
                return  # closing the stream is all a stranger gets
            await self._serve(reader, writer)
        except (TimeoutError, WireError, *NETWORK_ERRORS) as e:
            logger.debug("state transfer ended early: %r", e)
        except Exception:
            logger.exception("state transfer failed")
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(self.send_timeout):
            request = await streams.read_json(reader, MAX_HEADER_BYTES, version=PROTOCOL_VERSION)
        blob, ann = self._blob, self._announcement
        sha, offset = request.get("sha256"), request.get("offset")
        if blob is None or ann is None or sha != ann.sha256:
            self.refused_count += 1
            now = f"it now serves round {ann.round}" if ann else "it serves no state now"
            return await _refuse(writer, "gone", f"the donor no longer holds it; {now}")
        if not _is_int(offset) or not 0 <= offset <= len(blob):
            return await _refuse(writer, "bad-request", f"offset {offset!r} out of range")
        if self.active >= self.max_concurrent:
            self.refused_count += 1
            return await _refuse(writer, "busy", f"{self.active} transfers running")
        self.active += 1
        try:
            await self._stream(reader, writer, blob, offset)
        finally:
            self.active -= 1

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, blob: bytes, offset: int):
        loop = asyncio.get_running_loop()
        streams.write_json(writer, {"ok": True, "size": len(blob)}, version=PROTOCOL_VERSION)
        view, sent, t0 = memoryview(blob), 0, loop.time()
        for start in range(offset, len(blob), self.chunk_size):
            chunk = view[start : start + self.chunk_size]
            writer.write(self._outgoing(chunk))
            async with asyncio.timeout(self.send_timeout):
                await writer.drain()
            sent += len(chunk)
            self.bytes_served += len(chunk)
            if self.throttle is not None and (ahead := sent / self.throttle - (loop.time() - t0)) > 0:
                await asyncio.sleep(ahead)
        await writer.drain()
        async with asyncio.timeout(self.send_timeout):
            verdict = await reader.readexactly(1)
        if verdict == VERIFIED:
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


async def _refuse(writer: asyncio.StreamWriter, reason: str, detail: str) -> None:
    streams.write_json(writer, {"ok": False, "reason": reason, "detail": detail}, version=PROTOCOL_VERSION)
    await writer.drain()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
