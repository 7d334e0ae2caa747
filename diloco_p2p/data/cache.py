"""A prepared corpus that arrives from the swarm: a local cache of its shards, fetched as needed.

Given only a dataset id, a node fetches the manifest (its hash must be the id), then shards by
a `Remote` (`diloco_p2p.swarm.datashare`, or the manifest's ``base_url`` over HTTP), each
written to a ``.part`` file while hashed and renamed only when its sha256 is the manifest's; a
``.part`` is resumed. The node reads its windows shard by shard (`BlockedOrder`), so a
`Prefetcher` keeps the next shards ahead and the cache under ``data.cache_bytes``, and
`LazyShardSource` maps a shard when a window first needs it. MosaicML Streaming's lazy,
verified, bounded cache, with the swarm's peers as the source. How: docs/architecture.md, "Data".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from diloco_p2p.data.manifest import (
    _HASH_CHUNK,
    MANIFEST,
    VERIFIED,
    Manifest,
    dataset_id,
    file_sha256,
    read_stamps,
    shard_stamp,
    write_json_atomic,
)
from diloco_p2p.errors import UserError

log = logging.getLogger("diloco_p2p.data")

CACHE_MARKER = "cache.json"  # a directory filled from the swarm: its order is the blocked one


class Remote(Protocol):
    """Where a cache gets what it lacks (`diloco_p2p.swarm.datashare.DataShare`)."""

    def fetch_manifest(self, dataset_id: str, timeout: float) -> bytes: ...

    def fetch_shard(self, manifest: Manifest, index: int, part: PartFile, timeout: float) -> str: ...

    def serve(self, manifest: Manifest, held: Callable[[], Iterable[int]]) -> None: ...


class ShardUnavailable(RuntimeError):
    """No donor could serve a verified copy of a shard in time (the message says why)."""


class PartFile:
    """A shard being downloaded: ``NAME.part`` appended to while its sha256 runs; `commit`
    renames it to NAME if the hash is `sha256`, else deletes it."""

    def __init__(self, path: Path, sha256: str, size: int):
        self.path, self.sha256, self.size = path, sha256, size
        self.part = path.with_name(path.name + ".part")
        self.hasher = hashlib.sha256()
        self.offset = 0
        self._file: Any = None
        if self.part.exists():  # resume: hash what an earlier attempt left
            if self.part.stat().st_size > size:
                self.part.unlink()
            else:
                with open(self.part, "rb") as f:
                    while chunk := f.read(_HASH_CHUNK):
                        self.hasher.update(chunk)
                        self.offset += len(chunk)

    def write(self, data: bytes | memoryview) -> None:
        if self.offset + len(data) > self.size:
            raise ValueError(f"{len(data)} bytes past the {self.size} of {self.path.name}")
        if self._file is None:
            self._file = open(self.part, "ab")  # noqa: SIM115 - closed by commit/discard
        self._file.write(data)
        self.hasher.update(data)
        self.offset += len(data)

    @property
    def complete(self) -> bool:
        return self.offset == self.size

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def commit(self) -> bool:
        """Rename the whole, verified file into place (True), or delete it (False)."""
        self._close()
        if self.complete and self.hasher.hexdigest() == self.sha256:
            if not self.part.exists():  # a zero-byte shard never opened its file
                self.part.touch()
            os.replace(self.part, self.path)
            return True
        self.discard()
        return False

    def pause(self) -> None:
        """Keep the bytes so far for the next attempt (the donor left or stalled)."""
        self._close()

    def discard(self) -> None:
        self._close()
        self.part.unlink(missing_ok=True)
        self.hasher, self.offset = hashlib.sha256(), 0


def parse_manifest(raw: bytes, expected_id: str, directory: Path) -> Manifest:
    """The manifest in `raw` if it hashes to `expected_id` (no pickle: JSON, checked); else ValueError."""
    try:
        content = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("the manifest is not JSON") from None
    if not isinstance(content, dict) or dataset_id(content) != expected_id or content.get("id") != expected_id:
        raise ValueError(f"the manifest does not hash to {expected_id[:12]}")
    if not isinstance(content.get("shards"), list):
        raise ValueError("the manifest lists no shards")
    return Manifest(directory, content)


class ShardCache:
    """The shards of one dataset under `directory`, at most `cache_bytes` of them (None: all)."""

    def __init__(self, manifest: Manifest, remote: Remote | None, *, cache_bytes: int | None = None,
                 fetch_timeout: float = 60.0):
        self.manifest, self.remote, self.directory = manifest, remote, manifest.directory
        self.cache_bytes, self.fetch_timeout = cache_bytes, fetch_timeout
        self.size = [s["tokens"] * manifest.dtype.itemsize for s in manifest.shards]
        self._lock = threading.Condition()
        self._fetching: set[int] = set()
        self.used: OrderedDict[int, None] = OrderedDict()  # held shards, least recently used first
        self.fetched = self.evicted = self.fetched_bytes = 0
        self.fetch_seconds = 0.0
        self._verify_held()
        largest = max(self.size, default=0)
        if cache_bytes is not None and cache_bytes < 3 * largest:
            raise UserError(f"data.cache_bytes={cache_bytes} is below 3 shards of dataset {manifest.id[:12]} "
                            f"({3 * largest} bytes: the shard being read, the next one and one fetched ahead); "
                            "raise it or unset it")

    def _verify_held(self) -> None:
        """Keep the shards already here whose size and (once per file version) sha256 match."""
        stamps = read_stamps(self.directory)
        for i, shard in enumerate(self.manifest.shards):
            path = self.manifest.path(shard)
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            stamp = shard_stamp(st, shard)
            if st.st_size == self.size[i] and (stamps.get(shard["name"]) == stamp or file_sha256(path) == shard["sha256"]):
                stamps[shard["name"]] = stamp
                self.used[i] = None
            else:
                log.warning("data: %s is damaged (size or sha256 differ from the manifest); fetching it again", path)
                path.unlink()
        self._stamps = stamps
        self._save_stamps()

    def _save_stamps(self) -> None:
        held = {self.manifest.shards[i]["name"] for i in self.used}
        try:
            write_json_atomic(self.directory / VERIFIED, {k: v for k, v in self._stamps.items() if k in held})
        except OSError:
            pass

    def held(self) -> list[int]:
        with self._lock:
            return sorted(self.used)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(self.size[i] for i in self.used)

    def ensure(self, index: int, keep: Iterable[int] = ()) -> Path:
        """The path of shard `index`, fetched first if it is not here (raises ShardUnavailable);
        makes room under the limit by evicting shards outside `keep` and `index`."""
        with self._lock:
            while index in self._fetching:  # another thread fetches it: wait for that one
                self._lock.wait()
            if index in self.used:
                self.used.move_to_end(index)
                return self.manifest.path(self.manifest.shards[index])
            self._fetching.add(index)
        try:
            self._evict(self.size[index], {index, *keep})
            self._fetch(index)
        finally:
            with self._lock:
                self._fetching.discard(index)
                self._lock.notify_all()
        return self.manifest.path(self.manifest.shards[index])

    def _fetch(self, index: int) -> None:
        base_url = self.manifest.content.get("base_url")
        if self.remote is None and not base_url:
            raise ShardUnavailable(f"shard {index} of dataset {self.manifest.id[:12]} is not in {self.directory} "
                                   "and this node has no swarm to fetch it from; join one with --initial-peers")
        shard = self.manifest.shards[index]
        start = time.perf_counter()
        part = PartFile(self.manifest.path(shard), shard["sha256"], self.size[index])
        resumed = part.offset
        donor = None
        if self.remote is not None:
            try:
                donor = self.remote.fetch_shard(self.manifest, index, part, self.fetch_timeout)
            except ShardUnavailable as e:
                if not base_url:
                    raise
                log.warning("data: %s; trying the manifest's base_url", e)
        if donor is None:
            donor = http_fetch(str(base_url), shard, part, self.fetch_timeout)
        seconds = time.perf_counter() - start
        st = self.manifest.path(shard).stat()
        with self._lock:
            self._stamps[shard["name"]] = shard_stamp(st, shard)
            self.used[index] = None
            self.fetched += 1
            self.fetched_bytes += self.size[index] - resumed
            self.fetch_seconds += seconds
        self._save_stamps()
        log.info("data: shard %d/%d (%.1f MB) from %s in %.2f s%s", index + 1, len(self.size),
                 self.size[index] / 1e6, donor, seconds, f", resumed at {resumed} bytes" if resumed else "")

    def _evict(self, incoming: int, keep: set[int]) -> None:
        """Delete least recently used shards outside `keep` until `incoming` more bytes fit."""
        if self.cache_bytes is None:
            return
        with self._lock:
            total = sum(self.size[i] for i in self.used) + incoming
            for i in list(self.used):
                if total <= self.cache_bytes:
                    break
                if i in keep:
                    continue
                del self.used[i]
                self.manifest.path(self.manifest.shards[i]).unlink(missing_ok=True)
                total -= self.size[i]
                self.evicted += 1
                log.debug("data: evicted shard %d (cache at its limit of %d bytes)", i, self.cache_bytes)

    def room_for(self, index: int, keep: set[int]) -> bool:
        """Whether fetching `index` would fit under the limit evicting only shards outside `keep`."""
        if self.cache_bytes is None:
            return True
        with self._lock:
            kept = sum(self.size[i] for i in self.used if i in keep)
        return kept + self.size[index] <= self.cache_bytes


def http_fetch(base_url: str, shard: dict[str, Any], part: PartFile, timeout: float) -> str:
    """Shard `shard` from ``base_url/NAME`` into `part` (the manifest's fallback source), resumed
    with a Range request; committed only if its sha256 is the manifest's. Returns the URL."""
    import urllib.request

    url = f"{base_url.rstrip('/')}/{shard['name']}"
    if not url.startswith(("http://", "https://")):
        raise ShardUnavailable(f"the manifest's base_url {base_url!r} is not an http(s) URL")
    headers = {"Range": f"bytes={part.offset}-"} if part.offset else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as reply:
            if part.offset and reply.status != 206:
                part.discard()  # the server sends the whole file: start over
            while chunk := reply.read(1 << 20):
                part.write(chunk)
    except (OSError, ValueError) as e:  # URLError and timeouts are OSErrors; ValueError: more than the size
        part.pause()
        raise ShardUnavailable(f"{url}: {e}") from None
    if not part.commit():
        raise ShardUnavailable(f"{url} served a copy whose sha256 is not the manifest's")
    return url



class LazyShardSource:
    """The token stream of a cached corpus: a shard is mapped when a window first reads it,
    fetched first if it is not in the cache (the reader waits for it)."""

    def __init__(self, cache: ShardCache):
        self.cache = cache
        self.starts = [0]
        for s in cache.manifest.shards:
            self.starts.append(self.starts[-1] + s["tokens"])
        self.dtype = cache.manifest.dtype
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()
        self.keep: Callable[[], set[int]] = lambda: set()  # shards needed soon (set by the dataset)
        self.waited = 0.0  # seconds the reader waited for a fetch

    def __len__(self) -> int:
        return self.starts[-1]

    def _map(self, i: int) -> np.ndarray:
        m = self._maps.get(i)
        if m is not None and i in self.cache.used:
            self._maps.move_to_end(i)
            return m
        start = time.perf_counter()
        try:
            path = self.cache.ensure(i, self.keep())
        except (ShardUnavailable, TimeoutError) as e:
            raise UserError(f"data: {e}; the node cannot train without it") from None
        self.waited += time.perf_counter() - start
        m = np.memmap(path, dtype=self.dtype, mode="r") if self.cache.size[i] else np.empty(0, self.dtype)
        self._maps[i] = m
        while len(self._maps) > 4:  # an evicted shard's file goes once its map does
            self._maps.popitem(last=False)
        return m

    def slice(self, start: int, stop: int) -> np.ndarray:
        import bisect

        stop = min(stop, len(self))
        i = bisect.bisect_right(self.starts, start) - 1
        parts = []
        while start < stop:
            local = start - self.starts[i]
            n = min(stop, self.starts[i + 1]) - start
            parts.append(self._map(i)[local : local + n])
            start += n
            i += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class Prefetcher:
    """A daemon thread that fetches the shards `upcoming()` names, in order, while room is left."""

    def __init__(self, cache: ShardCache, upcoming: Callable[[], list[int]], interval: float = 0.2):
        self.cache, self.upcoming, self.interval = cache, upcoming, interval
        self._stop = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="data-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            wanted = self.upcoming()
            todo = [i for i in wanted if i not in self.cache.used]
            if todo and self.cache.room_for(todo[0], set(wanted)):
                try:
                    self.cache.ensure(todo[0], wanted)
                    continue
                except Exception as e:  # the reader will try again, and say so if it fails too
                    self.error = str(e)
                    log.debug("data: prefetching shard %d failed: %r", todo[0], e)
            self._stop.wait(self.interval)

    def close(self) -> None:
        self._stop.set()


def mark_cache(directory: Path, dataset: str) -> None:
    """Remember that `directory` is filled from the swarm (its training order is the blocked one)."""
    if not (directory / CACHE_MARKER).exists():
        write_json_atomic(directory / CACHE_MARKER, {"dataset_id": dataset})


def is_cache(directory: Path, manifest: Manifest, in_swarm: bool) -> bool:
    """A directory the swarm fills: marked so, or missing shards while in a swarm (or with a
    ``base_url``; then marked from now on: its training order stays the blocked one). Otherwise
    a missing shard is an error at start (`Manifest.check_shards`)."""
    if (directory / CACHE_MARKER).exists():
        return True
    missing = sum(not manifest.path(s).exists() for s in manifest.shards)
    if missing and in_swarm:
        log.warning("data: %d of the %d shards of %s are missing; fetching them from the swarm (the directory is "
                    "a swarm cache from now on)", missing, len(manifest.shards), directory)
    return bool(missing) and in_swarm


def load_or_fetch_manifest(directory: Path, dataset: str, remote: Remote | None, timeout: float) -> Manifest:
    """The manifest of dataset `dataset` in `directory`, fetched from the swarm (and checked) if absent."""
    if (directory / MANIFEST).is_file():
        manifest = Manifest.load(directory)
        if manifest.id != dataset:
            raise UserError(f"{directory / MANIFEST} holds dataset {manifest.id} but this node was asked for "
                            f"{dataset}; remove that directory or fix data.dataset_id")
        return manifest
    if remote is None:
        raise UserError(f"dataset {dataset} is not in {directory} and this node is not in a swarm to fetch it from; "
                        "pass --initial-peers (a seed) or point data.path at a prepared corpus")
    raw = remote.fetch_manifest(dataset, timeout)
    manifest = parse_manifest(raw, dataset, directory)
    directory.mkdir(parents=True, exist_ok=True)
    manifest.save()
    mark_cache(directory, dataset)
    log.info("data: fetched the manifest of dataset %s (%d shards, %.1f MB of tokens)", dataset[:12],
             len(manifest.shards), manifest.total_tokens * manifest.dtype.itemsize / 1e6)
    return manifest
