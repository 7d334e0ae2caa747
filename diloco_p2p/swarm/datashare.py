"""Training data through the swarm: serving and fetching a prepared corpus's manifest and shards.

Nodes that hold a prepared corpus announce which shards they hold (DHT key ``data.<id>``, not
per run) and serve them over libp2p streams to nodes that hold only its dataset id
(`diloco_p2p.data.cache`), as state sharing does. A fetcher tries donors in its rendezvous order
per shard, resumes from the bytes it has, and checks every byte: the manifest's hash is the
dataset id, a shard's sha256 is the manifest's; a donor that sent a bad shard is named and not
asked again. A donor caps its concurrent transfers and, in a closed run, serves admitted peers
only. Nothing is unpickled. The protocol: docs/protocol/state-transfer.md
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from diloco_p2p.data.cache import PartFile, ShardUnavailable, parse_manifest
from diloco_p2p.data.manifest import Manifest
from diloco_p2p.errors import UserError
from diloco_p2p.logs import short_peer
from diloco_p2p.swarm.state.announcements import rendezvous_order
from diloco_p2p.swarm.transport import streams
from diloco_p2p.swarm.transport.runner import BackgroundLoop
from diloco_p2p.swarm.transport.streams import NETWORK_ERRORS, AnnouncedHandler, WireError
from diloco_p2p.swarm.trust.schema import live_values
from diloco_p2p.swarm.trust.signing import own_subkey

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
HANDLER = f"diloco-data.v{PROTOCOL_VERSION}"
MAX_HEADER_BYTES = 4096
MAX_MANIFEST_BYTES = 64 << 20


def data_key(dataset: str) -> str:
    return f"data.{dataset}"


def bitmap(indices: Iterable[int], n: int) -> str:
    bits = bytearray((n + 7) // 8)
    for i in indices:
        bits[i // 8] |= 1 << (i % 8)
    return bits.hex()


def has_shard(have: str, index: int) -> bool:
    try:
        return bool(bytes.fromhex(have)[index // 8] >> (index % 8) & 1)
    except (ValueError, IndexError):
        return False


@dataclass
class _Served:
    manifest: Manifest
    raw: bytes  # manifest.json as served
    held: Callable[[], Iterable[int]]


class DataShare:
    """This node's side of data sharing: serves the datasets given to `serve` and fetches
    manifests and shards for a `ShardCache` (`fetch_manifest`, `fetch_shard`, called from any
    thread; they run on `loop`)."""

    def __init__(self, dht: hivemind.DHT, p2p: P2P, loop: BackgroundLoop, *, serving: bool = True,
                 max_concurrent: int = 4, chunk_size: int = 1 << 20, announce_ttl: float = 60.0,
                 stall: float = 15.0):
        self.dht, self.p2p, self.loop = dht, p2p, loop
        self.serving, self.max_concurrent, self.chunk_size = serving, max_concurrent, chunk_size
        self.announce_ttl, self.stall = announce_ttl, stall
        self.peer_id = p2p.peer_id.to_base58()
        self.datasets: dict[str, _Served] = {}
        self.refused: dict[str, str] = {}  # donors whose bytes failed their hash -> why
        self.active = self.served = self.bytes_served = 0
        self.admit: Callable[[str, str], Awaitable[bool]] | None = None
        self.admitted: Callable[[str], bool] = lambda peer: True  # a closed run fetches from members only
        self._served = AnnouncedHandler(p2p, HANDLER, self._handle, self._refresh, announce_ttl / 3)

    async def start(self) -> None:
        if self.serving:
            await self._served.start()

    async def stop(self) -> None:
        await self._served.stop(self._withdraw)

    async def _withdraw(self) -> None:
        with suppress(Exception):  # a tombstone each; else the records expire within announce_ttl
            await asyncio.wait_for(asyncio.gather(*(self._store(d, None) for d in self.datasets)), 3)

    # ------------------------------------------------------------------ serving

    def serve(self, manifest: Manifest, held: Callable[[], Iterable[int]]) -> None:
        """Serve `manifest` and the shards `held()` names (asked anew at each refresh)."""
        if not self.serving:
            return
        raw = (manifest.directory / "manifest.json").read_bytes()
        self.datasets[manifest.id] = _Served(manifest, raw, held)
        self.loop.run(self._announce(manifest.id), timeout=30)

    async def _announce(self, dataset: str) -> None:
        served = self.datasets[dataset]
        n = len(served.manifest.shards)
        value = {"n": n, "have": bitmap(served.held(), n)}
        try:
            await self._store(dataset, value)
        except (TimeoutError, *NETWORK_ERRORS) as e:
            log.debug("announcing dataset %s failed: %r", dataset[:12], e)

    async def _store(self, dataset: str, value: dict[str, Any] | None) -> None:
        expiration = get_dht_time() + (self.announce_ttl if value is not None else self.announce_ttl + 1)
        subkey = own_subkey(self.dht, self.peer_id)
        future = self.dht.store(data_key(dataset), value, expiration, subkey=subkey, return_future=True)
        await asyncio.wait_for(future, 10)

    async def _refresh(self) -> None:
        for dataset in list(self.datasets):
            await self._announce(dataset)

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # in a closed run, closing the stream is all a stranger gets
        await streams.serve_admitted(info, writer, self._request(reader, writer), self.admit, "data", log)

    async def _request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(self.stall):
            request = await streams.read_json(reader, MAX_HEADER_BYTES, version=PROTOCOL_VERSION)
        await self._serve(request, reader, writer)

    async def _serve(self, request: dict[str, Any], reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        served = self.datasets.get(request.get("dataset"))  # type: ignore[arg-type]
        if served is None:
            return await _refuse(writer, "gone", "this node does not serve that dataset")
        if request.get("kind") == "manifest":
            streams.write_json(writer, {"ok": True, "size": len(served.raw)}, version=PROTOCOL_VERSION)
            writer.write(served.raw)
            await writer.drain()
            return await streams.linger(reader, self.stall)
        index, offset = request.get("index"), request.get("offset")
        shards = served.manifest.shards
        if request.get("kind") != "shard" or not _is_int(index) or not 0 <= index < len(shards):
            return await _refuse(writer, "bad-request", f"no shard {index!r}")
        if index not in set(served.held()):
            return await _refuse(writer, "gone", f"this node no longer holds shard {index}")
        size = shards[index]["tokens"] * served.manifest.dtype.itemsize
        if not _is_int(offset) or not 0 <= offset <= size:
            return await _refuse(writer, "bad-request", f"offset {offset!r} out of range")
        if self.active >= self.max_concurrent:
            return await _refuse(writer, "busy", f"{self.active} transfers running")
        self.active += 1
        try:
            await self._stream(served.manifest.path(shards[index]), offset, size, reader, writer)
        finally:
            self.active -= 1

    async def _stream(self, path: Any, offset: int, size: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below; may be evicted meanwhile: then gone
        except FileNotFoundError:
            return await _refuse(writer, "gone", "the shard was evicted")
        with f:
            f.seek(offset)
            streams.write_json(writer, {"ok": True, "size": size}, version=PROTOCOL_VERSION)
            while chunk := await asyncio.to_thread(f.read, self.chunk_size):
                writer.write(self._outgoing(chunk))
                async with asyncio.timeout(self.stall):
                    await writer.drain()
                self.bytes_served += len(chunk)
        self.served += 1
        await streams.linger(reader, self.stall)

    def _outgoing(self, chunk: bytes) -> bytes:
        """The bytes served for `chunk`: itself. The point where a test's donor corrupts what it
        serves (`tests.faults.injection`)."""
        return chunk

    # ------------------------------------------------------------------ fetching

    async def donors(self, dataset: str, index: int | None = None) -> list[str]:
        """Peers announcing `dataset` (holding shard `index`), in this node's rendezvous order for
        that shard: a fetcher spreads its shards over the donors, and the fetchers over them too."""
        found = await asyncio.wait_for(self.dht.get(data_key(dataset), latest=True, return_future=True), 10)
        peers = []
        for peer, value in live_values(found):
            if peer == self.peer_id or not isinstance(value, dict) or not isinstance(value.get("have"), str) \
                    or not self.admitted(peer):
                continue
            if index is None or has_shard(value["have"], index):
                peers.append(peer)
        return rendezvous_order(self.peer_id if index is None else f"{self.peer_id}/{index}", peers)

    def fetch_manifest(self, dataset: str, timeout: float) -> bytes:
        """The manifest of `dataset`, from the first donor whose copy hashes to the id; UserError
        when no peer holds it within `timeout` (a wrong id, or no node serving it)."""
        return self.loop.run(self._fetch_manifest(dataset, timeout), timeout=timeout + 30)

    async def _fetch_manifest(self, dataset: str, timeout: float) -> bytes:
        loop = asyncio.get_running_loop()
        deadline, failures, tried = loop.time() + timeout, [], set()
        while loop.time() < deadline:
            for donor in [d for d in await self._donors_or_none(dataset, None) if d not in tried]:
                try:
                    raw = await self._download(donor, {"kind": "manifest", "dataset": dataset},
                                               MAX_MANIFEST_BYTES, deadline, None)
                    parse_manifest(raw, dataset, Path("."))  # hashes to the id, or ValueError
                    return raw
                except ValueError as e:  # WireError too
                    tried.add(donor)
                    log.warning("data: the manifest of dataset %s from %s is refused (%s); trying another peer",
                                dataset[:12], short_peer(donor), e)
                    failures.append(f"{short_peer(donor)}: {e}")
                except _Failed as e:
                    tried.add(donor)
                    failures.append(f"{short_peer(donor)}: {e}")
            await asyncio.sleep(min(1.0, max(0.0, deadline - loop.time())))
        why = f" (tried {'; '.join(failures)})" if failures else ""
        raise UserError(f"no peer in the swarm serves dataset {dataset} (waited {timeout:g} s){why}; check "
                        "data.dataset_id, and that a node training on that corpus is in this swarm")

    async def _donors_or_none(self, dataset: str, index: int | None) -> list[str]:
        try:
            return await self.donors(dataset, index)
        except (TimeoutError, *NETWORK_ERRORS) as e:
            log.debug("listing the donors of dataset %s failed: %r", dataset[:12], e)
            return []

    def fetch_shard(self, manifest: Manifest, index: int, part: PartFile, timeout: float) -> str:
        """Fetch shard `index` into `part` and commit it verified; returns the donor that served
        it. Raises ShardUnavailable when no donor served a verified copy within `timeout`."""
        return self.loop.run(self._fetch_shard(manifest, index, part, timeout), timeout=timeout + 30)

    async def _fetch_shard(self, manifest: Manifest, index: int, part: PartFile, timeout: float) -> str:
        loop = asyncio.get_running_loop()
        deadline, failures = loop.time() + timeout, {}
        mixed = part.offset > 0  # bytes from an earlier attempt: a bad hash blames no one
        while loop.time() < deadline:
            donors = [d for d in await self._donors_or_none(manifest.id, index)
                      if d not in failures and d not in self.refused]
            for donor in donors:
                request = {"kind": "shard", "dataset": manifest.id, "index": index, "offset": part.offset}
                try:
                    await self._download(donor, request, part.size, deadline, part)
                except _Failed as e:
                    part.pause()  # the next donor resumes from here
                    mixed = mixed or part.offset > 0
                    if not e.busy:
                        failures[donor] = str(e)
                    continue
                if part.commit():
                    return short_peer(donor)
                if not mixed and donor not in self.refused:  # one line per donor, however many shards
                    self.refused[donor] = f"shard {index} failed its sha256 check"
                    log.warning("data: shard %d of dataset %s from %s failed its sha256 check; refusing that "
                                "peer and fetching the shard from another", index, manifest.id[:12], short_peer(donor))
                mixed = False  # the shard starts over from one donor alone
            await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))
        tried = "; ".join(f"{short_peer(d)}: {w}" for d, w in {**failures, **self.refused}.items()) or "no peer holds it"
        raise ShardUnavailable(f"shard {index} of dataset {manifest.id[:12]} could not be fetched in {timeout:g} s "
                               f"({tried})")

    async def _download(self, donor: str, request: dict[str, Any], max_size: int, deadline: float,
                        part: PartFile | None) -> bytes:
        """One attempt: the whole payload (part None) or what follows `part.offset`, into `part`."""
        loop = asyncio.get_running_loop()

        def budget() -> float:
            return max(0.0, min(self.stall, deadline - loop.time()))

        try:
            async with asyncio.timeout(budget()):
                _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(donor), HANDLER)
        except TimeoutError:
            raise _Failed("no answer while connecting") from None
        except NETWORK_ERRORS as e:
            raise _Failed(f"unreachable ({type(e).__name__})") from None
        try:
            async with asyncio.timeout(budget()):
                streams.write_json(writer, request, version=PROTOCOL_VERSION)
                await writer.drain()
                reply = await streams.read_json(reader, MAX_HEADER_BYTES, version=PROTOCOL_VERSION)
            if reply.get("ok") is not True:
                reason = str(reply.get("reason"))[:20]
                raise _Failed(f"{reason}: {str(reply.get('detail', ''))[:100]}", busy=reason == "busy")
            size = reply.get("size")
            if not _is_int(size) or size > max_size or (part is not None and size != part.size):
                raise _Failed(f"announces {size!r} bytes")
            got, remaining = bytearray(), size - (part.offset if part is not None else 0)
            while remaining > 0:
                async with asyncio.timeout(budget()):
                    data = await reader.read(min(remaining, 1 << 20))
                if not data:
                    raise _Failed(f"left after {size - remaining} of {size} bytes")
                if part is not None:
                    part.write(data)  # a read is at most 1 MiB: appending and hashing it takes ~1 ms
                else:
                    got += data
                remaining -= len(data)
            return bytes(got)
        except TimeoutError:
            raise _Failed(f"stalled: nothing for {self.stall:g} s") from None
        except (WireError, *NETWORK_ERRORS) as e:
            raise _Failed(f"broke off ({type(e).__name__})") from None
        finally:
            writer.close()


class _Failed(Exception):
    def __init__(self, reason: str, busy: bool = False):
        super().__init__(reason)
        self.busy = busy


async def _refuse(writer: asyncio.StreamWriter, reason: str, detail: str) -> None:
    streams.write_json(writer, {"ok": False, "reason": reason, "detail": detail}, version=PROTOCOL_VERSION)
    await writer.drain()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
