"""State sharing ("checkpoints through the DHT"): donors announce the state they can serve,
joiners stream it from one of them and verify it before using it.

The state is an opaque blob to this module. A node builds it with `pack_state` (safetensors
bytes of the global fp32 parameters θ, the outer momentum and, optionally, its inner optimizer
state, plus a small JSON metadata with the round) and reads it back with `unpack_state`; no
pickle on either side. Put only swarm-wide values in the metadata: safetensors output is
deterministic, so nodes that agree on θ and m at a round produce byte-identical blobs, announce
the same sha256, and a joiner can resume a transfer on another donor where the first stopped.
(A blob that carries a node's own inner optimizer state differs per donor; that still works,
only without cross-donor resume.)

Protocol:

- **Announce.** A `StateServer` stores ``{round, sha256, size, params_hash}`` under DHT key
  ``f"{run_id}.state"``, subkey = its peer id, with an expiration it refreshes in the
  background while it serves. A donor that dies without withdrawing stays listed until the
  expiration (60 s by default); joiners that try it fail fast and move on. Withdrawing stores a
  tombstone (``None``) that outlives the record, as hivemind cannot delete a value.
- **Fetch.** One libp2p stream per attempt (handler ``f"{run_id}.state.v1"``): the joiner sends
  a JSON request ``{sha256, offset}``; the donor answers with a JSON header (``ok`` and the
  size, or ``gone`` / ``busy`` / ``bad-request``), then the raw bytes from `offset`. Headers are
  length-prefixed like hivemind's `P2P.send_raw_data` and read with an upper bound. After the
  last byte the joiner sends one byte of verdict (sha256 matched or not) and the donor one byte
  back, so both sides know the transfer is complete (`served_count` counts verified ones).
- **Choosing a donor.** hivemind's `DecentralizedAverager.load_state_from_peers` sorts donors by
  an announced priority (`hivemind.Optimizer` sets it to the local epoch), random only among
  equal priorities: every joiner goes to the peer with the highest number (one that is an epoch
  ahead, or that announces a bogus priority, gets them all), donors are tried one by one with
  no resume, and whatever arrives is used unchecked (no hash; a failure ends in `None`). Here a
  joiner orders the donors of the newest state by rendezvous hashing (highest random weight,
  Thaler & Ravishankar 1998): score = H(joiner ‖ donor). Every joiner gets its own uniformly
  random order without coordination, and when a donor leaves, only the joiners that ranked it
  first change their choice. A donor also caps its concurrent transfers (`max_concurrent`);
  past it, it answers ``busy`` and the joiner tries the next one, so a burst of joiners
  spreads over the donors even when the hash sends two to the same one.
- **Failures.** A donor that cannot be reached, dies (the stream ends), stalls (no byte for
  `stall_timeout`), says it no longer holds that state, or serves bytes whose sha256 differs
  from its announcement is dropped for the rest of the fetch and the next one is tried,
  resuming from the bytes already received when it announces the same sha256. A verification
  failure on a blob assembled from several donors cannot be blamed on one of them, so that
  sha256 is then fetched again from a single donor. When the listing is exhausted the joiner
  lists again (donors may have moved to a newer round); the whole fetch is bounded by
  `timeout`, and ends in `StateUnavailable` whose one-line message says what was tried and why
  each attempt failed.

What this does not defend against: a donor that announces a state it made up, with a matching
hash. Among donors of the newest round a joiner prefers the θ hash (`params_hash`) that most
donors announce; a caller that knows the swarm's θ hash from the progress records should pass
it as `params_hash` to fetch only a state with that θ.

Costs: the blob lives in memory on both sides (the joiner briefly holds it twice when it hands
it over), fine for the small and 150M presets; a 1B state (θ and m in fp32, 8 GB) would want a
donor serving from its checkpoint file and a joiner writing to disk. Measured on loopback
(two p2pd daemons on a loaded 2-core box, noise-encrypted yamux streams): ~40 MB/s for 4 MB
(dominated by the DHT lookup), 100-200 MB/s for 16-256 MB.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Optional

import hivemind
import pydantic.v1 as pydantic
import safetensors.torch
import torch
from hivemind.dht.schema import SchemaValidator
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
DEFAULT_ANNOUNCE_TTL = 60.0
MAX_HEADER_BYTES = 4096  # our JSON request/reply headers
MAX_SAFETENSORS_HEADER = 100 << 20  # what safetensors itself accepts
READ_SIZE = 1 << 20
LENGTH_PREFIX = 8  # = hivemind P2P.HEADER_LEN, big-endian like P2P.BYTEORDER
VERIFIED, REJECTED = b"\x01", b"\x00"
_NETWORK_ERRORS = (OSError, asyncio.IncompleteReadError, P2PDaemonError)

Progress = Callable[[str, int, int], Optional[Awaitable[None]]]


class StateError(ValueError):
    """A state blob that is not a well-formed diloco-p2p state."""


class StateUnavailable(RuntimeError):
    """No donor could provide a valid state; the message says what was tried and why it failed."""


class _ProtocolError(Exception):
    """A peer that does not follow the state protocol."""


# ----------------------------------------------------------------------------- the blob


def pack_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> bytes:
    """Safetensors bytes of `tensors` with `meta` as JSON under the ``diloco`` metadata key.

    Tensors are stored as they are (dtype and shape; non-contiguous or GPU tensors are copied to
    contiguous CPU tensors first); `meta` must be JSON-serializable without NaN/Inf."""
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a mapping, not {type(meta).__name__}")
    flat = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    return safetensors.torch.save(flat, metadata={"diloco": json.dumps(dict(meta), sort_keys=True, allow_nan=False)})


def unpack_state(blob: bytes | bytearray | memoryview) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Inverse of `pack_state`. Raises `StateError` for anything that is not a complete
    diloco-p2p state (truncated, garbage, a safetensors file without our metadata)."""
    data = bytes(blob)
    if len(data) < LENGTH_PREFIX:
        raise StateError(f"state of {len(data)} bytes is truncated: no safetensors header")
    n = int.from_bytes(data[:LENGTH_PREFIX], "little")
    if n > MAX_SAFETENSORS_HEADER or LENGTH_PREFIX + n > len(data):
        raise StateError(f"state of {len(data)} bytes is truncated or not safetensors (header length {n})")
    try:
        header = json.loads(data[LENGTH_PREFIX : LENGTH_PREFIX + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StateError("state is not safetensors: its header is not JSON") from None
    raw_meta = header.get("__metadata__", {}).get("diloco") if isinstance(header, dict) else None
    if not isinstance(raw_meta, str):
        raise StateError("not a diloco-p2p state: the safetensors metadata has no 'diloco' entry")
    try:
        meta = json.loads(raw_meta)
    except json.JSONDecodeError:
        raise StateError("state metadata 'diloco' is not JSON") from None
    if not isinstance(meta, dict):
        raise StateError("state metadata 'diloco' is not a JSON object")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own Rust-side error types
        raise StateError(f"state tensors do not load: {' '.join(str(e).split()) or type(e).__name__}") from None
    return tensors, meta


# ----------------------------------------------------------------------------- announcements


def state_key(run_id: str) -> str:
    return f"{run_id}.state"


def handler_name(run_id: str) -> str:
    return f"{run_id}.state.v{PROTOCOL_VERSION}"


@dataclass(frozen=True)
class StateAnnouncement:
    peer_id: str
    round: int
    sha256: str
    size: int
    params_hash: str | None = None

    def value(self) -> dict[str, Any]:
        """What goes into the DHT (the peer id is the subkey)."""
        return {"round": self.round, "sha256": self.sha256, "size": self.size, "params_hash": self.params_hash}


Hex64 = pydantic.constr(strict=True, regex=r"^[0-9a-f]{64}$")
PeerB58 = pydantic.constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")


class _AnnouncementValue(pydantic.BaseModel):
    """The announcement as stored: strict types (hivemind's validator rejects conversions)."""

    round: pydantic.conint(strict=True, ge=0)
    sha256: Hex64
    size: pydantic.conint(strict=True, ge=0)
    params_hash: Optional[Hex64] = None

    class Config:
        extra = pydantic.Extra.forbid


class _SchemaBase(pydantic.BaseModel):
    class Config:  # our own, so SchemaValidator's patch does not reach pydantic.v1's global config
        extra = pydantic.Extra.forbid


def state_validator(run_id: str) -> SchemaValidator:
    """A hivemind validator for this run's state key; pass it to `start_dht(record_validators=...)`
    so storing peers reject malformed announcements (readers check them again anyway)."""
    schema = pydantic.create_model(
        "StateSchema",
        __base__=_SchemaBase,
        **{state_key(run_id): (Optional[dict[PeerB58, Optional[_AnnouncementValue]]], None)},
    )
    return SchemaValidator(schema, allow_extra_keys=True)


def parse_announcements(found: Any, now: float | None = None) -> list[StateAnnouncement]:
    """Announcements from the result of `dht.get(state_key)`, newest round first: drops
    tombstones, expired and malformed entries (a storing peer may not validate our key)."""
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        return []
    now = get_dht_time() if now is None else now
    out = []
    for subkey, item in entries.items():
        value, expiration = getattr(item, "value", None), getattr(item, "expiration_time", None)
        if value is None or expiration is None or expiration < now or not isinstance(subkey, str):
            continue
        try:
            PeerID.from_base58(subkey)
            v = _AnnouncementValue.parse_obj(value)
        except Exception as e:
            logger.debug("dropping a malformed state announcement under %r: %s", subkey, e)
            continue
        out.append(StateAnnouncement(subkey, v.round, v.sha256, v.size, v.params_hash))
    return sorted(out, key=lambda a: (-a.round, a.peer_id))


async def list_donors(dht: hivemind.DHT, run_id: str, timeout: float = 10.0) -> list[StateAnnouncement]:
    """Every live announcement of the run, newest round first (raises TimeoutError past `timeout`)."""
    found = await asyncio.wait_for(dht.get(state_key(run_id), latest=True, return_future=True), timeout)
    return parse_announcements(found)


def rendezvous_order(joiner: str, donors: Iterable[str]) -> list[str]:
    """Donors in this joiner's order: by H(joiner ‖ donor), highest first (rendezvous hashing)."""

    def score(donor: str) -> bytes:
        return hashlib.sha256(f"{joiner}\n{donor}".encode()).digest()

    return sorted(set(donors), key=lambda d: (score(d), d), reverse=True)


def order_candidates(
    announcements: Sequence[StateAnnouncement], joiner: str, prefer: Sequence[str] = ()
) -> list[StateAnnouncement]:
    """The order a joiner tries donors in.

    States are grouped by (round, θ hash, or the blob's sha256 without one); groups go newest
    round first, then most donors first (agreement among donors is the best evidence we have),
    then by hash so every joiner ranks groups alike. Within a group: the donors in `prefer`
    first (in that order), then the rest in this joiner's rendezvous order."""
    groups: dict[tuple[int, str], list[StateAnnouncement]] = {}
    for a in announcements:
        groups.setdefault((a.round, a.params_hash or a.sha256), []).append(a)
    rank = {p: i for i, p in enumerate(prefer)}
    out: list[StateAnnouncement] = []
    for (_, _), members in sorted(groups.items(), key=lambda kv: (-kv[0][0], -len(kv[1]), kv[0][1])):
        by_peer = {a.peer_id: a for a in members}
        hashed = {p: i for i, p in enumerate(rendezvous_order(joiner, by_peer))}
        out += sorted(by_peer.values(), key=lambda a: (rank.get(a.peer_id, len(rank)), hashed[a.peer_id]))
    return out


# ----------------------------------------------------------------------------- framing


def _write_json(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    data = json.dumps({"v": PROTOCOL_VERSION, **obj}, separators=(",", ":")).encode()
    writer.write(len(data).to_bytes(LENGTH_PREFIX, "big") + data)


async def _read_json(reader: asyncio.StreamReader) -> dict[str, Any]:
    length = int.from_bytes(await reader.readexactly(LENGTH_PREFIX), "big")
    if length > MAX_HEADER_BYTES:
        raise _ProtocolError(f"header of {length} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        obj = json.loads(await reader.readexactly(length))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _ProtocolError("header is not JSON") from None
    if not isinstance(obj, dict) or obj.get("v") != PROTOCOL_VERSION:
        raise _ProtocolError("header is not a v1 object")
    return obj


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(peer_id: str) -> str:
    return "…" + peer_id[-8:]


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


# ----------------------------------------------------------------------------- the donor


class StateServer:
    """Serves this node's current state blob to joiners and keeps it announced in the DHT.

    `throttle_bytes_per_s` caps each transfer's rate (a volunteer's uplink; tests use it to
    make a transfer slow enough to kill the donor in the middle). `max_concurrent` caps the
    transfers served at once; past it, joiners are told ``busy`` and go to another donor.
    `corrupt` is a fault-injection knob for tests: every chunk served has its first byte
    flipped, so joiners must reject the state by its hash.
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
        corrupt: bool = False,
    ):
        if chunk_size <= 0 or max_concurrent <= 0 or announce_ttl <= 0 or send_timeout <= 0:
            raise ValueError("chunk_size, max_concurrent, announce_ttl and send_timeout must be positive")
        if throttle_bytes_per_s is not None and throttle_bytes_per_s <= 0:
            raise ValueError("throttle_bytes_per_s must be positive or None")
        self.dht, self.p2p, self.run_id = dht, p2p, run_id
        self.chunk_size, self.throttle, self.max_concurrent = chunk_size, throttle_bytes_per_s, max_concurrent
        self.announce_ttl, self.send_timeout, self.corrupt = announce_ttl, send_timeout, corrupt
        self.peer_id = p2p.peer_id.to_base58()
        self.served_count = 0  # transfers the joiner verified
        self.rejected_count = 0  # transfers the joiner received in full and rejected by hash
        self.refused_count = 0  # requests answered busy or gone
        self.bytes_served = 0
        self.active = 0
        self._blob: bytes | None = None
        self._announcement: StateAnnouncement | None = None
        self._expiration: float | None = None  # of the last record we stored
        self._refresh: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._started = False

    @property
    def announcement(self) -> StateAnnouncement | None:
        return self._announcement

    async def start(self) -> None:
        """Register the stream handler; announce the state if one is already set."""
        if self._started:
            return
        await self.p2p.add_binary_stream_handler(handler_name(self.run_id), self._handle)
        self._started = True
        self._refresh = asyncio.create_task(self._refresh_loop(), name=f"announce {state_key(self.run_id)}")
        if self._announcement is not None:
            await self._announce()

    async def stop(self) -> None:
        """Withdraw the announcement and unregister the handler (transfers in flight may finish)."""
        if not self._started:
            return
        self._started = False
        if self._refresh is not None:
            self._refresh.cancel()
            with suppress(asyncio.CancelledError):
                await self._refresh
        await self.withdraw()
        with suppress(*_NETWORK_ERRORS):
            await self.p2p.remove_binary_stream_handler(handler_name(self.run_id))

    async def set_state(self, round: int, blob: bytes, params_hash: str | None = None) -> None:
        """Serve `blob` as the state of `round` from now on (announced at once if started).

        Transfers of the previous blob in flight finish; new requests for it are told ``gone``."""
        if not _is_int(round) or round < 0:
            raise ValueError(f"round must be a non-negative int, got {round!r}")
        blob = blob if isinstance(blob, bytes) else bytes(blob)
        digest = await asyncio.to_thread(lambda: hashlib.sha256(blob).hexdigest())
        ann = StateAnnouncement(self.peer_id, round, digest, len(blob), params_hash)
        _AnnouncementValue.parse_obj(ann.value())  # a bad params_hash fails here, not on every peer
        self._blob, self._announcement = blob, ann
        if self._started:
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
                future = self.dht.store(
                    state_key(self.run_id), None, expiration, subkey=self.peer_id, return_future=True
                )
                ok = bool(await asyncio.wait_for(future, timeout))
            except (TimeoutError, *_NETWORK_ERRORS) as e:
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
                future = self.dht.store(
                    state_key(self.run_id), ann.value(), expiration, subkey=self.peer_id, return_future=True
                )
                ok = bool(await asyncio.wait_for(future, timeout))
            except (TimeoutError, *_NETWORK_ERRORS) as e:
                ok = False
                logger.debug("announcing state round %d failed: %r", ann.round, e)
            self._expiration = max(self._expiration or 0.0, expiration)
            if not ok:
                logger.warning("no DHT peer accepted our state announcement (round %d); retrying later", ann.round)
            return ok

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.announce_ttl / 3)
            if self._announcement is not None:
                try:
                    await self._announce()
                except Exception:
                    logger.exception("refreshing the state announcement failed")

    # ------------------------------------------------------------------------- serving

    async def _handle(self, _info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        except (TimeoutError, _ProtocolError, *_NETWORK_ERRORS) as e:
            logger.debug("state transfer ended early: %r", e)
        except Exception:
            logger.exception("state transfer failed")
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(self.send_timeout):
            request = await _read_json(reader)
        blob, ann = self._blob, self._announcement
        sha, offset = request.get("sha256"), request.get("offset")
        if blob is None or ann is None or sha != ann.sha256:
            self.refused_count += 1
            now = f"it now serves round {ann.round}" if ann else "it serves no state now"
            _write_json(writer, {"ok": False, "reason": "gone", "detail": f"the donor no longer holds it; {now}"})
            return await writer.drain()
        if not _is_int(offset) or not 0 <= offset <= len(blob):
            _write_json(writer, {"ok": False, "reason": "bad-request", "detail": f"offset {offset!r} out of range"})
            return await writer.drain()
        if self.active >= self.max_concurrent:
            self.refused_count += 1
            _write_json(writer, {"ok": False, "reason": "busy", "detail": f"{self.active} transfers running"})
            return await writer.drain()
        self.active += 1
        try:
            await self._stream(reader, writer, blob, offset)
        finally:
            self.active -= 1

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, blob: bytes, offset: int):
        loop = asyncio.get_running_loop()
        _write_json(writer, {"ok": True, "size": len(blob)})
        view, sent, t0 = memoryview(blob), 0, loop.time()
        for start in range(offset, len(blob), self.chunk_size):
            chunk = view[start : start + self.chunk_size]
            if self.corrupt:
                chunk = bytes([chunk[0] ^ 0xFF]) + bytes(chunk[1:])
            writer.write(chunk)
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


# ----------------------------------------------------------------------------- the joiner


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
    status: str  # ok | busy | corrupt | failed
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
    except _NETWORK_ERRORS as e:
        return _Outcome("failed", f"unreachable ({type(e).__name__}: {' '.join(str(e).split())[:80]})")
    try:
        try:
            async with asyncio.timeout(budget()):
                _write_json(writer, {"sha256": ann.sha256, "offset": len(part.buf)})
                await writer.drain()
                reply = await _read_json(reader)
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
        with suppress(TimeoutError, *_NETWORK_ERRORS):  # the blob is ours already; this is courtesy
            async with asyncio.timeout(min(budget(), 5.0)):
                writer.write(VERIFIED if ok else REJECTED)
                await writer.drain()
                await reader.readexactly(1)
        if not ok:
            return _Outcome("corrupt", "sha256 mismatch: corrupt bytes", got)
        return _Outcome("ok", received=got)
    except _ProtocolError as e:
        return _Outcome("failed", f"protocol error: {e}", got)
    except _NETWORK_ERRORS as e:
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
) -> FetchedState:
    """Download and verify the newest state announced for `run_id` (see the module docstring).

    `min_round`: ignore older states. `params_hash`: accept only donors announcing this θ hash.
    `exclude`: peer ids never to ask. `prefer`: peer ids to ask first, in this order (e.g. the
    peers we averaged with last). `wait`: keep looking this long for a qualifying announcement
    before giving up (default: fail at once). `progress(donor, received, size)` is called after
    every read; if it returns an awaitable, that is awaited (tests pause or kill a donor there).
    Raises `StateUnavailable` when no donor provides a valid state within `timeout` seconds.
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = t0 + timeout
    me, excluded = p2p.peer_id.to_base58(), set(exclude)
    failed: dict[tuple[str, str], str] = {}
    no_resume: set[str] = set()  # sha256s whose mixed-source blob failed: fetch from one donor only
    failures: list[str] = []
    attempts, received, busy_refusals, backoff = 0, 0, 0, 0.1
    part: _Partial | None = None
    what = f"run {run_id!r}" + (f", round >= {min_round}" if min_round is not None else "")

    def unavailable(why: str) -> StateUnavailable:
        tried = f"; {attempts} attempts" if attempts else ""
        tried += f" ({busy_refusals} answered busy)" if busy_refusals else ""
        tried += ": " + "; ".join(failures) if failures else ""
        return StateUnavailable(f"no valid state for {what} after {loop.time() - t0:.1f} s: {why}{tried}")

    while True:
        if loop.time() >= deadline:
            raise unavailable(f"timed out after {timeout:g} s")
        try:
            announced = await list_donors(dht, run_id, timeout=max(0.1, min(10.0, deadline - loop.time())))
        except (TimeoutError, *_NETWORK_ERRORS) as e:
            announced, lookup_error = [], f"DHT lookup failed ({type(e).__name__})"
        else:
            lookup_error = None
        eligible = [
            a for a in announced
            if a.peer_id != me and a.peer_id not in excluded
            and (min_round is None or a.round >= min_round)
            and (params_hash is None or a.params_hash == params_hash)
        ]
        candidates = [a for a in order_candidates(eligible, me, prefer) if (a.peer_id, a.sha256) not in failed]
        if not candidates:
            if loop.time() - t0 < wait and loop.time() + backoff < deadline:
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 1.0)
                continue
            if failures:
                raise unavailable("every donor failed")
            if lookup_error:
                raise unavailable(lookup_error)
            if not announced:
                raise unavailable(f"no peer announces a state (DHT key {state_key(run_id)!r})")
            newest = max(announced, key=lambda a: a.round)
            raise unavailable(f"no announcement qualifies (newest: round {newest.round} from {_short(newest.peer_id)})")

        busy = False
        for ann in candidates:
            if loop.time() >= deadline:
                raise unavailable(f"timed out after {timeout:g} s")
            if part is None or part.sha256 != ann.sha256 or part.size != ann.size or ann.sha256 in no_resume:
                part = _Partial(ann.sha256, ann.size)
            attempts += 1
            outcome = await _attempt(p2p, run_id, ann, part, stall=stall_timeout, deadline=deadline, progress=progress)
            received += outcome.received
            if outcome.status == "ok":
                seconds = loop.time() - t0
                logger.info(
                    "fetched state round %d (%s) from %s in %.2f s, %d attempt(s)",
                    ann.round, _mb(ann.size), _short(ann.peer_id), seconds, attempts,
                )
                blob = bytes(part.buf)
                return FetchedState(blob, ann.round, ann.sha256, ann.peer_id, seconds, attempts, received,
                                    ann.params_hash, failures)
            line = f"{_short(ann.peer_id)} round {ann.round}: {outcome.reason}"
            logger.info("state fetch attempt %d failed: %s", attempts, line)
            if outcome.status == "busy":  # not a failure: come back to it after the others
                busy, busy_refusals = True, busy_refusals + 1
                continue
            failures.append(line)
            if outcome.status == "corrupt":
                if len(part.sources) > 1:  # cannot tell who lied: refetch this sha from one donor alone
                    no_resume.add(ann.sha256)
                    failures[-1] += f" (assembled from {len(part.sources)} donors; retrying from one)"
                else:
                    failed[(ann.peer_id, ann.sha256)] = outcome.reason
                part = None
                continue
            failed[(ann.peer_id, ann.sha256)] = outcome.reason
        if busy:
            await asyncio.sleep(min(backoff, max(0.0, deadline - loop.time())))
            backoff = min(2 * backoff, 1.0)
