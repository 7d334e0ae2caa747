"""Training data through the swarm, with real processes: a node given only a dataset id fetches
the manifest and the shards it needs from its peers (refusing a donor that serves a corrupt
shard), trains, and ends every round with the same θ as the nodes that hold the corpus.

Order, so the corrupt donor is the only one at first: the seed, then node `corrupt` (it trains
on the prepared corpus and serves every shard with a byte flipped), then node `fetcher` (given
only the id); once the fetcher has refused the corrupt donor, node `holder` (the same corpus,
served intact) starts, and the three train together.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from tests.harness.procs import diloco, run_cli, wait_until
from tests.harness.settings import SWARM, TINY, set_args
from tests.harness.swarm import ProcessSwarm

SHARD_TOKENS = 2000  # 4 kB shards: a few rounds of the tiny model read several of them
CACHE = 6 * 2 * SHARD_TOKENS  # bytes: six shards


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("data-swarm")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 220)
    out = root / "prepared"
    prep = run_cli(["prepare", str(corpus), "--out", str(out), "--shard-tokens", str(SHARD_TOKENS)])
    assert prep.returncode == 0, prep.stderr
    return root, out, json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def swarm(prepared):
    root, out, manifest = prepared
    (root / "swarm").mkdir()
    with ProcessSwarm(root / "swarm") as swarm:
        common = ["data.fetch_timeout=90", "sync.matchmaking_timeout=20", "train.max_rounds=3"]
        corrupt = swarm.node("corrupt", [*common, f"data.path={out}"], env={"DILOCO_P2P_CORRUPT_SHARDS": "1"})
        fetcher = swarm.node("fetcher", [*common, f"data.path=swarm:{manifest['id']}", f"data.cache_bytes={CACHE}",
                                         "data.prefetch_shards=1"])
        wait_until(lambda: "failed its sha256 check" in fetcher.output(), 120, "the corrupt shard to be refused",
                   fetcher, corrupt)
        holder = swarm.node("holder", [*common, f"data.path={out}"])
        # While the nodes wait at the start gate (serving): the whole corpus with `fetch-data`.
        copy = swarm.procs.start(diloco("fetch-data", "--initial-peers", swarm.maddr, "--dataset", manifest["id"],
                                        "--out", str(root / "copy"), "--timeout", "90"), root / "fetch-data.log")
        swarm.wait_joined(corrupt, fetcher, holder)
        assert copy.wait(timeout=180) == 0, copy.tail()
        swarm.release(corrupt, fetcher, holder)
        for node in (corrupt, fetcher, holder):
            assert node.wait(timeout=240) == 0, node.tail()
        yield swarm, {"corrupt": corrupt, "fetcher": fetcher, "holder": holder}, copy.output()


def test_a_node_given_only_the_dataset_id_trains_with_the_swarm(swarm, prepared):
    _, nodes, _ = swarm
    per_node = {name: n.by_round() for name, n in nodes.items()}
    for round_ in range(4):
        assert len({r[round_]["params_sha256"] for r in per_node.values()}) == 1, round_
    for round_ in range(1, 4):
        assert {r[round_]["status"] for r in per_node.values()} == {"committed"}
    _, out, manifest = prepared
    cache = nodes["fetcher"].run_dir / "data" / f"swarm-{manifest['id'][:16]}"
    held = sorted(cache.glob("shard-*.bin"))
    assert held and not list(cache.glob("*.part"))
    by_name = {s["name"]: s["sha256"] for s in manifest["shards"]}
    for path in held:  # every shard it kept is the manifest's
        assert hashlib.sha256(path.read_bytes()).hexdigest() == by_name[path.name]


def test_the_corrupt_donor_is_named_once_and_the_shard_comes_from_another(swarm):
    _, nodes, _ = swarm
    log = nodes["fetcher"].output()
    refusals = [line for line in log.splitlines() if "failed its sha256 check" in line]
    corrupt_peer = _peer(nodes["corrupt"])
    assert len(refusals) == 1 and corrupt_peer in refusals[0], refusals
    fetched = re.findall(r"data: shard \d+/\d+ .* from (\S+) in", log)
    assert fetched and corrupt_peer not in fetched and set(fetched) == {_peer(nodes["holder"])}


def test_the_cache_stays_under_its_limit_by_evicting_finished_shards(swarm, prepared):
    _, nodes, _ = swarm
    _, _, manifest = prepared
    cache = nodes["fetcher"].run_dir / "data" / f"swarm-{manifest['id'][:16]}"
    kept = sum(p.stat().st_size for p in cache.glob("shard-*.bin"))
    fetched = re.findall(r"data: shard (\d+)/", nodes["fetcher"].output())
    assert kept <= CACHE
    assert len(set(fetched)) * 2 * SHARD_TOKENS > CACHE  # it read more than fits: it evicted


def test_fetch_data_downloads_the_whole_corpus_and_a_bad_id_is_one_line(swarm, prepared, tmp_path):
    swarm_, _, got = swarm
    root, out, manifest = prepared
    assert f"dataset {manifest['id']}: {len(manifest['shards'])} shards" in got
    for s in manifest["shards"]:
        assert (root / "copy" / s["name"]).read_bytes() == (out / s["name"]).read_bytes()
    assert not (root / "copy" / "cache.json").exists()  # an ordinary prepared corpus now
    unknown = hashlib.sha256(b"a corpus nobody prepared").hexdigest()
    bad = run_cli(["train", *set_args(TINY + [f"data.dataset_id={unknown}", "data.fetch_timeout=3",
                                              *SWARM[len(TINY):]]),
                   "--initial-peers", swarm_.maddr, "--run-dir", str(tmp_path / "bad")], timeout=120)
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert len(errors) == 1 and f"no peer in the swarm serves dataset {unknown}" in errors[0], errors


def _peer(node) -> str:
    """The short peer id a node's log lines carry (`diloco_p2p.logs.short_peer`)."""
    found = re.findall(r"\[peer=(\w{6,}) ", node.output())
    assert found, node.tail()
    return found[0]
