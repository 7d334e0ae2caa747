"""Elastic membership, the cases tests/integration/test_join_leave.py and
tests/faults/test_node_faults.py leave out, with real processes on loopback: a node frozen by an
external SIGSTOP wherever it happens to be (not at a planned fault point) catches up on SIGCONT;
a run directory written by `fetch` is one `train` resumes from and rejoins the swarm with;
`fetch` from an unreachable DHT fails in one line.

One swarm of three nodes serves the two swarm tests (in file order: the second replaces the
node the first froze). The unreachable-DHT test needs no swarm and comes first: the module's
swarm trains until the module ends, and with it running the one-line `fetch` took 35 s of CI
instead of 8. Groups of three: while a node is missing, the other two wait
MATCHMAKING_TIMEOUT per round for it and then commit as two; the same wait lets a node that
has just resynced reach the next round's group (its resync and inner steps take a few seconds
on a loaded machine).
"""

from __future__ import annotations

import re
import signal

import pytest

from diloco_p2p.loop.checkpoint import load_checkpoint
from tests.harness.procs import run_cli, wait_until
from tests.harness.swarm import ProcessSwarm

MATCHMAKING_TIMEOUT = 8
# max_rounds only bounds a leak: the fixture kills the nodes when the module ends. On a loaded
# machine the swarm reached round 60 before the second test's node could join (seen), so it is far off.
OVERRIDES = ["train.max_rounds=1000", "sync.target_group_size=3", f"sync.matchmaking_timeout={MATCHMAKING_TIMEOUT}"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with ProcessSwarm(tmp_path_factory.mktemp("elastic")) as swarm:
        a, b, v = (swarm.node(name, OVERRIDES) for name in ("a", "b", "v"))
        swarm.release(a, b, v)
        yield swarm, a, b, v


def _assert_rejoins(node, resync_index: int, *others) -> dict:
    """After `node`'s resync record, its next round is committed in one group with `others`, same θ.

    One race is allowed, and checked: the others' group for that round closed at its deadline
    just before the node got there (they had been waiting for a third member since the round
    began, so the deadline can fall while the node is still in its inner steps). The node then
    ends that round alone, `late`, and catches up again (it is a round behind, or holds a
    minority θ), never averaging its own stale θ with anyone. Seen in about 1 run of 4 here.

    A download can also take long enough that the swarm commits another round meanwhile: the node
    then resyncs again at once, with no steps in between (seen once in CI). The last resync of
    such a run is the one the node trains from.

    The others do not wait for a node that missed rounds (`liveness`), and these rounds last a
    fraction of a second: the race can repeat a few times before the node lands in a group (up
    to 5 late rounds seen in CI). Each try is a late round and a resync, nothing else.
    """

    def committed() -> list[dict]:
        return [r for r in node.records()[resync_index + 1:] if r["status"] == "committed"]

    wait_until(lambda: bool(committed()), 120, f"{node.run_dir.name} to commit a round after its resync", node)
    records = node.records()
    while records[resync_index + 1]["status"] == "resynced":
        resync_index += 1
        assert records[resync_index]["round"] > records[resync_index - 1]["round"], records
    first = next(r for r in records[resync_index + 1:] if r["status"] == "committed")
    resync, between = records[resync_index], records[resync_index + 1:records.index(first)]
    if between:  # the race: a late round, then resyncs (maybe an alone round in between) - nothing else
        assert f"round {resync['round'] + 1}: no group (late)" in node.output(), between
        assert [r["status"] for r in between][0] == "alone" and between[-1]["status"] == "resynced", between
        assert {r["status"] for r in between} <= {"alone", "resynced"} and len(between) <= 16, between
    assert first["round"] == (between[-1] if between else resync)["round"] + 1, first
    round_ = first["round"]
    wait_until(lambda: all(round_ in o.by_round() for o in others), 60, f"the others to finish round {round_}", *others)
    assert first["group_size"] == 1 + len(others)
    assert {first["params_sha256"]} == {o.by_round()[round_]["params_sha256"] for o in others}
    return first


def test_fetch_from_an_unreachable_dht_is_one_line(tmp_path):
    # A well-formed multiaddr nobody listens on (port 9, discard: closed on loopback).
    peer = "/ip4/127.0.0.1/tcp/9/p2p/QmcSQkWbtiFPrToKfGvgW2rX9rj5Ng1wcYdrmqurKU1N5s"
    result = run_cli(["fetch", "--initial-peers", peer, "--run-id", "swarm-test", "--out", str(tmp_path / "out"),
                      "--timeout", "5"], timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr  # one line
    assert result.stderr.startswith("error: ") and "could not reach" in result.stderr and peer in result.stderr
    assert not (tmp_path / "out").exists()


def test_sigstop_anywhere_then_sigcont_resyncs_and_agrees_with_the_swarm(swarm):
    s, a, b, v = swarm
    # Its round-2 log line comes after the round's record, DHT publication and checkpoint: the
    # stop lands in round 3 (its DHT read, inner steps or group), wherever it happens to be.
    wait_until(lambda: re.search(r"round 2/\d+ ", v.output()) is not None, 120, "v to end round 2", v)
    v.signal(signal.SIGSTOP)
    stopped_at = 2
    wait_until(lambda: stopped_at + 2 in a.by_round() and stopped_at + 2 in b.by_round(), 120,
               "a and b to get two rounds ahead", a, b)
    v.signal(signal.SIGCONT)
    wait_until(lambda: any(r["status"] == "resynced" for r in v.records()), 120, "v to resync", v)
    index = next(i for i, r in enumerate(v.records()) if r["status"] == "resynced")
    resync = v.records()[index]
    # It downloaded the swarm's state of a round it never trained, and holds exactly that θ:
    # nothing it computed between the stop and the resync survived.
    assert resync["round"] >= stopped_at + 2 and resync["state_bytes"] > 0 and resync["donor"]
    assert resync["resyncs"] == 1 and resync["params_sha256"] == a.by_round()[resync["round"]]["params_sha256"]
    _assert_rejoins(v, index, a, b)


def test_a_fetched_run_directory_resumes_and_rejoins_the_swarm(swarm):
    s, a, b, v = swarm
    out = s.root / "fetched"
    result = run_cli(["fetch", "--initial-peers", s.maddr, "--run-id", "swarm-test", "--out", str(out)], timeout=120)
    assert result.returncode == 0, result.stderr
    fetched = load_checkpoint(out / "checkpoints")
    assert "inner" not in fetched.meta  # θ, momentum and round only: the resume starts a fresh AdamW
    assert fetched.meta["params_sha256"] == a.wait_round(fetched.round)["params_sha256"]
    v.signal(signal.SIGTERM)  # v leaves; a node started from the fetched directory takes its place
    assert v.wait(timeout=30) == 0, v.tail()
    # The fetched config.yaml holds the swarm's fields: the node passes the swarm's config check.
    w = s.node("fetched", OVERRIDES, extra_args=["--config", str(out / "config.yaml")])
    wait_until(lambda: "resumed from checkpoint" in w.output(), 120, "the node to resume", w)
    assert int(re.search(r"resumed from checkpoint at round (\d+)", w.output()).group(1)) == fetched.round
    # The swarm moved on while it started: it catches up, then averages with a and b.
    wait_until(lambda: any(r["status"] == "resynced" for r in w.records()), 120, "the node to resync", w)
    index = next(i for i, r in enumerate(w.records()) if r["status"] == "resynced")
    assert w.records()[index]["round"] > fetched.round and w.records()[index]["joined_at_round"] == fetched.round
    following = _assert_rejoins(w, index, a, b)
    # It trained from the fetched step 0 with a fresh AdamW: 5 steps a round, fewer in a round it
    # joined in flight after a resync (`schedule.catch_up_steps`), more after late rounds.
    before = [r for r in w.records() if r["round"] < following["round"] and r["status"] != "resynced"]
    assert following["train_loss"] is not None and 1 <= following["step"] <= 5 * (len(before) + 1)
