"""The cache of a corpus fetched from the swarm: verified, resumable shard writes, eviction under
the limit, the manifest checked against its id, and the shard-blocked training order."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from diloco_p2p.config import DataConfig, ModelConfig
from diloco_p2p.data import open_dataset
from diloco_p2p.data.cache import (
    CACHE_MARKER,
    LazyShardSource,
    PartFile,
    ShardCache,
    ShardUnavailable,
    parse_manifest,
)
from diloco_p2p.data.dataset import BlockedOrder, ShardSource, TokenDataset, is_eval
from diloco_p2p.data.encode import tokenizer_identity
from diloco_p2p.data.manifest import MANIFEST, Manifest
from diloco_p2p.data.prepare import prepare
from diloco_p2p.errors import UserError
from diloco_p2p.model.build import ByteTokenizer

BYTE = ByteTokenizer()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A byte-tokenized corpus in 8 shards of 4096 tokens (the last one shorter)."""
    root = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(1)
    (root / "a.txt").write_bytes(bytes(rng.integers(32, 127, 30_000, dtype=np.uint8)))
    out = tmp_path_factory.mktemp("prepared")
    prepare([str(root)], out, BYTE, tokenizer_identity(ModelConfig(), BYTE), shard_tokens=4096, progress=False)
    return Manifest.load(out)


class FakeRemote:
    """Copies shards from a prepared directory; `bad` donors flip a byte, `cut` stops after N bytes."""

    def __init__(self, source: Manifest, bad: int = 0, cut: int | None = None):
        self.source, self.bad, self.cut = source, bad, cut
        self.calls: list[int] = []
        self.served: list[tuple[str, str]] = []

    def fetch_manifest(self, dataset, timeout):
        return (self.source.directory / MANIFEST).read_bytes()

    def fetch_shard(self, manifest, index, part, timeout):
        self.calls.append(index)
        data = self.source.path(self.source.shards[index]).read_bytes()[part.offset:]
        if self.cut is not None:
            part.write(data[: self.cut])
            self.cut = None
            part.pause()
            raise ShardUnavailable("donor left")
        while True:
            donor = "bad" if self.bad else "good"
            part.write(bytes([data[0] ^ 1]) + data[1:] if self.bad else data)
            if part.commit():
                return donor
            self.bad -= 1
            data = self.source.path(self.source.shards[index]).read_bytes()

    def serve(self, manifest, held):
        self.served.append((manifest.id, repr(sorted(held()))))


def cache_dir(tmp_path, prepared):
    d = tmp_path / "cache"
    d.mkdir()
    shutil.copy(prepared.directory / MANIFEST, d / MANIFEST)
    return Manifest.load(d)


def test_a_part_file_commits_only_the_manifest_hash_and_resumes(prepared, tmp_path):
    shard = prepared.shards[0]
    data = prepared.path(shard).read_bytes()
    target = tmp_path / shard["name"]
    part = PartFile(target, shard["sha256"], len(data))
    part.write(data[:1000])
    part.pause()
    resumed = PartFile(target, shard["sha256"], len(data))  # a new process finds the .part
    assert resumed.offset == 1000
    resumed.write(data[1000:])
    assert resumed.commit() and target.read_bytes() == data
    bad = PartFile(tmp_path / "x.bin", shard["sha256"], len(data))
    bad.write(b"\0" + data[1:])
    assert not bad.commit()
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.bin.part").exists()
    with pytest.raises(ValueError, match="past"):
        PartFile(tmp_path / "y.bin", shard["sha256"], 4).write(b"12345")


def test_the_manifest_must_hash_to_the_dataset_id(prepared, tmp_path):
    raw = (prepared.directory / MANIFEST).read_bytes()
    assert parse_manifest(raw, prepared.id, tmp_path).id == prepared.id
    edited = json.loads(raw)
    edited["eval_fraction"] = 0.3
    with pytest.raises(ValueError, match="does not hash"):
        parse_manifest(json.dumps(edited).encode(), prepared.id, tmp_path)
    with pytest.raises(ValueError, match="not JSON"):
        parse_manifest(b"\x80\x03pickle", prepared.id, tmp_path)


def test_a_cache_fetches_once_rejects_corrupt_copies_and_evicts_under_its_limit(prepared, tmp_path):
    manifest = cache_dir(tmp_path, prepared)
    size = prepared.shards[0]["tokens"] * 2
    remote = FakeRemote(prepared, bad=1)
    cache = ShardCache(manifest, remote, cache_bytes=3 * size)
    for i in range(4):
        assert cache.ensure(i).read_bytes() == prepared.path(prepared.shards[i]).read_bytes()
    assert cache.ensure(3) and remote.calls == [0, 1, 2, 3]  # held: not fetched again
    assert cache.held() == [1, 2, 3] and cache.evicted == 1  # the least recently used went
    assert not manifest.path(manifest.shards[0]).exists()
    cache.ensure(5, keep={1, 2})
    assert cache.held() == [1, 2, 5]
    assert not cache.room_for(6, keep={1, 2, 5})
    with pytest.raises(UserError, match="below 3 shards"):
        ShardCache(manifest, remote, cache_bytes=size)


def test_a_cache_keeps_verified_shards_and_refetches_damaged_ones_at_start(prepared, tmp_path):
    manifest = cache_dir(tmp_path, prepared)
    cache = ShardCache(manifest, FakeRemote(prepared))
    cache.ensure(0)
    cache.ensure(1)
    path = manifest.path(manifest.shards[1])
    path.write_bytes(b"\0" + path.read_bytes()[1:])  # damaged while the node was down
    again = ShardCache(manifest, FakeRemote(prepared))
    assert again.held() == [0] and not path.exists()
    with pytest.raises(ShardUnavailable, match="no swarm"):
        ShardCache(manifest, None).ensure(2)


def test_a_download_cut_short_resumes_from_its_part_file(prepared, tmp_path):
    manifest = cache_dir(tmp_path, prepared)
    remote = FakeRemote(prepared, cut=3000)
    cache = ShardCache(manifest, remote)
    with pytest.raises(ShardUnavailable):
        cache.ensure(0)
    assert (manifest.directory / (manifest.shards[0]["name"] + ".part")).stat().st_size == 3000
    cache.ensure(0)
    assert cache.fetched_bytes == prepared.shards[0]["tokens"] * 2 - 3000  # only the rest went over the wire


def test_the_blocked_order_visits_every_window_once_shard_by_shard(prepared):
    source = ShardSource(prepared)
    n = (len(source) - 1) // 64
    order = BlockedOrder(n, source.starts, 64, "node:0")
    seen = [order[k] for k in range(n)]
    assert sorted(seen) == list(range(n)) and seen != list(range(n))
    shard_of = [int(np.searchsorted(source.starts, w * 64, side="right")) - 1 for w in seen]
    runs = [s for k, s in enumerate(shard_of) if k == 0 or s != shard_of[k - 1]]
    assert runs == order.shards and len(set(runs)) == len(runs)  # one run per shard
    assert BlockedOrder(n, source.starts, 64, "node:1").shards != order.shards or seen != [
        BlockedOrder(n, source.starts, 64, "node:1")[k] for k in range(n)]


def test_a_swarm_corpus_reads_the_same_tokens_and_names_the_shards_it_needs_next(prepared, tmp_path):
    manifest = cache_dir(tmp_path, prepared)
    remote = FakeRemote(prepared)
    lazy = LazyShardSource(ShardCache(manifest, remote))
    whole = ShardSource(prepared)
    assert len(lazy) == len(whole)
    for start in (0, 4090, 10_000, len(whole) - 70):
        assert np.array_equal(lazy.slice(start, start + 65), whole.slice(start, start + 65))
    data = TokenDataset(lazy, 64, prepared.eval_fraction, "k", blocked=True)
    first = data._epoch_order(0).shards[0]
    assert data.upcoming_shards(0)[0] == first
    windows = data.next_windows(5)
    assert all(not is_eval(w, prepared.eval_fraction) for w in windows)
    assert {int(np.searchsorted(lazy.starts, w * 64, side="right")) - 1 for w in windows} == {first}


def test_open_dataset_fetches_a_corpus_by_its_id_and_serves_what_it_holds(prepared, tmp_path):
    remote = FakeRemote(prepared)
    cfg = DataConfig(path=f"swarm:{prepared.id}", prefetch_shards=1)
    data = open_dataset(cfg, ModelConfig(), BYTE, 64, "k", tmp_path / "data", remote=remote)
    # Before the first batch the prefetcher wants only the shard training starts in (nothing that
    # would compete with it), then data.prefetch_shards blocks ahead.
    assert data.prefetcher.upcoming() == data.upcoming_shards(0)[:1] != data.upcoming_shards(1)
    batch = data.next_batch(4)
    assert batch.shape == (4, 65)
    assert data.prefetcher.upcoming() == data.upcoming_shards(1)
    directory = tmp_path / "data" / f"swarm-{prepared.id[:16]}"
    assert (directory / CACHE_MARKER).exists() and Manifest.load(directory).id == prepared.id
    assert remote.served[0][0] == prepared.id
    data.prefetcher.close()
    with pytest.raises(UserError, match="not in a swarm"):
        open_dataset(DataConfig(dataset_id=prepared.id), ModelConfig(), BYTE, 64, "k", tmp_path / "other")


def test_data_path_swarm_names_the_dataset_and_a_malformed_id_is_refused(prepared, tmp_path):
    from diloco_p2p.config import load_config

    cfg = load_config(None, [f"data.path=swarm:{prepared.id}", "data.cache_bytes=1000000"])
    assert (cfg.data.path, cfg.data.dataset_id) == (None, prepared.id)
    assert cfg.swarm_view()["data.dataset_id"] == prepared.id  # the same view as a node holding the corpus
    with pytest.raises(UserError, match="data.dataset_id"):
        load_config(None, ["data.dataset_id=not-an-id"])
    with pytest.raises(UserError, match="names dataset"):
        load_config(None, [f"data.path=swarm:{prepared.id}", f"data.dataset_id={'a' * 64}"])
    with pytest.raises(UserError, match="cache_bytes"):
        load_config(None, ["data.cache_bytes=0"])


def test_a_prepared_directory_missing_shards_is_filled_from_the_swarm(prepared, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(prepared.directory, partial)
    (partial / prepared.shards[2]["name"]).unlink()
    with pytest.raises(UserError, match="is missing"):  # no swarm: an error at start, as before
        open_dataset(DataConfig(path=str(partial)), ModelConfig(), BYTE, 64, "k", tmp_path / "d")
    remote = FakeRemote(prepared)
    data = open_dataset(DataConfig(path=str(partial)), ModelConfig(), BYTE, 64, "k", tmp_path / "d", remote=remote)
    data.prefetcher.close()
    assert data.blocked and (partial / CACHE_MARKER).exists()
    assert np.array_equal(data.source.slice(0, len(data.source)), ShardSource(prepared).slice(0, 10**9))
    assert 2 in remote.calls


def test_the_blocked_order_resumes_exactly_from_a_saved_position(prepared, tmp_path):
    from dataclasses import replace

    def dataset():
        return TokenDataset(ShardSource(prepared), 64, prepared.eval_fraction, "node", blocked=True)

    a = dataset()
    n = a.n_windows
    a.next_windows(n - 7)  # near the end of epoch 0: the continuation crosses into epoch 1
    saved = replace(a.position)
    expected = a.next_windows(40)
    b = dataset()
    b.position = saved
    assert b.next_windows(40) == expected and b.position.epoch == 1


def test_the_manifests_base_url_is_the_fallback_source(prepared, tmp_path):
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(prepared.directory))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        content = json.loads((prepared.directory / MANIFEST).read_text())
        content["base_url"] = f"http://127.0.0.1:{server.server_address[1]}/"
        (tmp_path / "c").mkdir()
        (tmp_path / "c" / MANIFEST).write_text(json.dumps(content))
        manifest = Manifest.load(tmp_path / "c")
        assert manifest.id == prepared.id  # base_url is not part of the id
        shard = manifest.shards[1]
        part = tmp_path / "c" / (shard["name"] + ".part")
        part.write_bytes(prepared.path(shard).read_bytes()[:100])  # a server without Range support: starts over
        remote = FakeRemote(prepared, cut=50)  # the swarm fails: the URL serves
        cache = ShardCache(manifest, remote, fetch_timeout=10)
        for i in (0, 1):
            assert cache.ensure(i).read_bytes() == prepared.path(prepared.shards[i]).read_bytes()
        assert ShardCache(manifest, None).ensure(2).read_bytes() == prepared.path(prepared.shards[2]).read_bytes()
        content["base_url"] = f"http://127.0.0.1:{server.server_address[1]}/nowhere"
        (tmp_path / "c" / MANIFEST).write_text(json.dumps(content))
        with pytest.raises(ShardUnavailable, match="404"):
            ShardCache(Manifest.load(tmp_path / "c"), None).ensure(3)
    finally:
        server.shutdown()
