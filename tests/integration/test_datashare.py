"""Shard transfers between real p2pd daemons on loopback (`diloco_p2p.swarm.datashare`): a donor
that leaves mid-transfer (the shard resumes from another, nothing fetched twice), a donor that
serves a corrupt shard (refused, named once), a closed run's donor that refuses a stranger, and
an id nobody serves. The donor to fault is the one the fetcher's rendezvous order tries first."""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator

import numpy as np
import pytest

from diloco_p2p.config import ModelConfig
from diloco_p2p.data.cache import ShardCache, ShardUnavailable, parse_manifest
from diloco_p2p.data.encode import tokenizer_identity
from diloco_p2p.data.manifest import MANIFEST, Manifest
from diloco_p2p.data.prepare import prepare
from diloco_p2p.errors import UserError
from diloco_p2p.model.build import ByteTokenizer
from diloco_p2p.swarm.datashare import PROTOCOL_VERSION, DataShare
from diloco_p2p.swarm.state.announcements import rendezvous_order
from diloco_p2p.swarm.transport import streams
from tests.faults.injection import flip_first_byte
from tests.harness.loopback import LoopbackPeers

CUT = 300_000  # bytes the leaving donor sends before it goes


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Manifest:
    src = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(2)
    (src / "a.txt").write_bytes(bytes(rng.integers(32, 127, 1_500_000, dtype=np.uint8)))
    out = tmp_path_factory.mktemp("prepared")
    tok = ByteTokenizer()
    prepare([str(src)], out, tok, tokenizer_identity(ModelConfig(), tok), shard_tokens=1 << 19, progress=False)
    return Manifest.load(out)


@pytest.fixture(scope="module")
def peers(prepared) -> Iterator[tuple[LoopbackPeers, list[DataShare]]]:
    """[donor, fetcher, donor]; both donors serve the whole corpus."""
    with LoopbackPeers(3) as lp:
        shares = [DataShare(lp.dhts[i], lp.p2ps[i], lp.loop, stall=5) for i in range(3)]
        for s in shares:
            lp.loop.run(s.start(), timeout=30)
        for s in (shares[0], shares[2]):
            s.serve(prepared, lambda: range(len(prepared.shards)))
        yield lp, shares
        for s in shares:
            lp.loop.run(s.stop(), timeout=30)


def _roles(shares: list[DataShare], index: int = 0) -> tuple[DataShare, DataShare, DataShare]:
    """(the donor the fetcher tries first for shard `index`, the other donor, the fetcher)."""
    fetcher = shares[1]
    first = rendezvous_order(f"{fetcher.peer_id}/{index}", [shares[0].peer_id, shares[2].peer_id])[0]
    a, b = (shares[0], shares[2]) if shares[0].peer_id == first else (shares[2], shares[0])
    return a, b, fetcher


async def _leave(self, path, offset, size, reader, writer) -> None:
    """Serve CUT bytes, then go (the stream ends mid-shard)."""
    streams.write_json(writer, {"ok": True, "size": size}, version=PROTOCOL_VERSION)
    with open(path, "rb") as f:
        f.seek(offset)
        writer.write(f.read(CUT))
    await writer.drain()


def _cache(prepared: Manifest, tmp_path, remote) -> ShardCache:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / MANIFEST).write_bytes((prepared.directory / MANIFEST).read_bytes())
    return ShardCache(Manifest.load(tmp_path / "c"), remote, fetch_timeout=20)


def test_the_manifest_comes_verified_and_a_donor_leaving_mid_shard_is_resumed_from(peers, prepared, tmp_path):
    lp, shares = peers
    first, other, fetcher = _roles(shares)
    raw = fetcher.fetch_manifest(prepared.id, timeout=20)
    assert parse_manifest(raw, prepared.id, tmp_path).shards == prepared.shards
    first._stream = types.MethodType(_leave, first)
    try:
        before = other.bytes_served
        cache = _cache(prepared, tmp_path, fetcher)
        path = cache.ensure(0)
    finally:
        del first._stream
    size = cache.size[0]
    assert path.read_bytes() == prepared.path(prepared.shards[0]).read_bytes()
    assert other.bytes_served - before == size - CUT  # resumed where the first donor left: nothing twice
    assert not fetcher.refused  # leaving is not lying


def test_a_corrupt_donor_is_named_once_and_the_shards_come_from_the_other(peers, prepared, tmp_path, caplog):
    lp, shares = peers
    first, other, fetcher = _roles(shares)
    first._outgoing = flip_first_byte  # it serves every shard with its first byte flipped
    try:
        cache = _cache(prepared, tmp_path, fetcher)
        with caplog.at_level(logging.WARNING, "diloco_p2p.swarm.datashare"):
            for i in range(len(prepared.shards)):
                assert cache.ensure(i).read_bytes() == prepared.path(prepared.shards[i]).read_bytes()
    finally:
        del first._outgoing
    lines = [r.getMessage() for r in caplog.records if "sha256" in r.getMessage()]
    assert len(lines) == 1 and first.peer_id[-8:] in lines[0], lines
    assert first.peer_id in fetcher.refused
    fetcher.refused.clear()


def test_a_closed_runs_donors_refuse_a_stranger_and_an_unknown_id_is_one_line(peers, prepared, tmp_path):
    lp, shares = peers
    first, other, fetcher = _roles(shares)

    async def refuse(peer: str, what: str) -> bool:
        assert what == "data"
        return False

    first.admit = other.admit = refuse
    try:
        cache = _cache(prepared, tmp_path, fetcher)
        cache.fetch_timeout = 2
        with pytest.raises(ShardUnavailable, match="could not be fetched"):
            cache.ensure(1)
    finally:
        first.admit = other.admit = None
    assert not (tmp_path / "c" / prepared.shards[1]["name"]).exists()
    with pytest.raises(UserError, match=f"no peer in the swarm serves dataset {'1' * 64}"):
        fetcher.fetch_manifest("1" * 64, timeout=2)


def test_a_closed_runs_fetcher_lists_no_stranger_as_a_donor(peers, prepared):
    lp, shares = peers
    first, other, fetcher = _roles(shares)
    listed = lp.loop.run(fetcher.donors(prepared.id), timeout=30)
    assert {first.peer_id, other.peer_id} <= set(listed)
    fetcher.admitted = lambda peer: peer != first.peer_id  # `first` was never admitted
    try:
        assert first.peer_id not in lp.loop.run(fetcher.donors(prepared.id), timeout=30)
        assert other.peer_id in lp.loop.run(fetcher.donors(prepared.id), timeout=30)
    finally:
        fetcher.admitted = lambda peer: True
