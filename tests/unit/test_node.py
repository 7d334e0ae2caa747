"""`Node.run` against a scripted swarm: every way a round can end, in-process and in about a second.

The fake `Sync` hands the loop exactly what a swarm would (a committed average, nothing, a
failure, a downloaded state, a stop request) and records what the loop tells it, so these
tests pin the loop's decisions without a DHT.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
from pathlib import Path

import pytest
import torch

from diloco_p2p import hashing
from diloco_p2p.config import load_config
from diloco_p2p.config.schedule import catch_up_steps
from diloco_p2p.contract import NodeState, RoundOutcome, RoundRecord, StopRequested, SwarmState
from diloco_p2p.local.ranks import Ranks
from diloco_p2p.loop.checkpoint import load_checkpoint
from diloco_p2p.loop.node import Node
from diloco_p2p.loop.outer import OuterOptimizer

SMALL = ["model.preset=tiny", "data.max_bytes=200000", "data.eval_fraction=0.05", "inner.batch_size=2",
         "inner.seq_len=32", "inner.warmup_steps=1", "outer.inner_steps=2", "train.eval_batches=1",
         "train.num_threads=1", "train.device=cpu"]


class ScriptedSync:
    """A swarm whose answers per round are given up front: `outcomes[r]` is called with Δ for round r."""

    peer_id = "scripted-peer"
    speeds = None
    reachability = None

    def __init__(self, outcomes=None, resyncs=None, stop: StopRequested | None = None):
        self.outcomes, self.resyncs, self.stop = outcomes or {}, resyncs or {}, stop
        self.announced: list[NodeState] = []
        self.seen: list[NodeState] = []
        self.after: list[tuple[NodeState, RoundRecord]] = []
        self.deltas: dict[int, torch.Tensor] = {}

    def announce(self, node):
        self.announced.append(node)

    def before_round(self, node):
        self.seen.append(node)
        make = self.resyncs.pop(node.round, None)
        return make(node) if make else None

    def average(self, round, delta, weight, params_hash):
        self.deltas[round] = delta.clone()
        assert weight > 0 and params_hash == self.seen[-1].shard_sha256  # the node's hash on one rank
        return self.outcomes.get(round, lambda d: RoundOutcome(status="alone", average=d))(delta)

    def after_round(self, node, record):
        self.after.append((node, record))

    def dht_peers(self):
        return 0

    def close(self):
        pass


def _node(tmp_path, sync, rounds=3, extra=(), stop=None):
    config = load_config(None, [*SMALL, f"train.max_rounds={rounds}", *extra])
    return Node(config, tmp_path / "run", sync, stop=stop, progress=False)


def _lines(node):
    return [json.loads(line) for line in (node.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_committed_average_is_applied_by_the_outer_step_and_reported(tmp_path):
    halve = {1: lambda d: RoundOutcome(status="committed", average=d / 2, group_size=3, contributors=3,
                                       allreduce_seconds=0.5, bytes_sent=10, bytes_received=20)}
    sync = ScriptedSync(halve)
    node = _node(tmp_path, sync, rounds=1)
    theta0 = node.outer.theta.clone()
    records = node.run()

    expected = OuterOptimizer([theta0], node.config.outer)  # the same step, by hand, on the same Δ̄
    expected.step(sync.deltas[1] / 2)
    assert torch.equal(node.outer.theta, expected.theta)
    assert [r.status for r in records] == ["init", "committed"]
    last = records[-1]
    assert (last.round, last.group_size, last.contributors, last.bytes_received) == (1, 3, 3, 20)
    assert last.params_sha256 == node.params_sha256() == expected.params_sha256()
    assert _lines(node)[-1] == last.as_dict()  # metrics.jsonl holds the record, whole
    node_state, published = sync.after[-1]
    assert published is last and node_state.round == 1 and node_state.params_sha256 == last.params_sha256
    assert torch.equal(node_state.state["outer.theta"], node.outer.theta)


@pytest.mark.parametrize("status, average", [("alone", None), ("failed", None)])
def test_a_round_with_nothing_to_apply_keeps_theta(tmp_path, status, average):
    sync = ScriptedSync({1: lambda d: RoundOutcome(status=status, average=average, group_size=2)})
    node = _node(tmp_path, sync, rounds=1)
    before = node.params_sha256()
    records = node.run()
    assert records[-1].status == status and records[-1].round == 1
    assert records[-1].params_sha256 == before  # θ untouched; the inner steps' work is dropped
    assert node.step == 2 and node.tokens > 0  # the steps were taken and counted


def test_a_downloaded_state_replaces_ours_and_the_round_jumps(tmp_path):
    def donor_state(node):
        theta = torch.full_like(node.state["outer.theta"], 0.01)
        outcome = RoundOutcome(status="resynced", group_size=0, donor="donor-peer", state_bytes=123)
        return SwarmState(tensors={"outer.theta": theta, "outer.momentum": torch.zeros_like(theta)}, round=7,
                          outcome=outcome)

    sync = ScriptedSync(resyncs={0: donor_state})
    node = _node(tmp_path, sync, rounds=8)
    records = node.run()
    resync = records[1]
    assert (resync.status, resync.round, resync.donor, resync.dropped_round) == ("resynced", 7, "donor-peer", 0)
    assert resync.joined_at_round == 7 and resync.resyncs == 0  # a joiner, not a resync of a trained node
    assert node.joined_at_round == 7
    assert [r.round for r in records] == [0, 7, 8]  # then one round of its own from the swarm's θ
    assert sync.seen[1].round == 7 and sync.seen[1].step == 0
    assert load_checkpoint(node.run_dir / "checkpoints").round == 8


@pytest.mark.parametrize("behind, steps", [(None, 8), (1e9, 1)])
def test_a_node_that_adopted_the_state_late_joins_the_round_in_flight(tmp_path, behind, steps):
    """After a resync the next round runs only the steps the swarm has left (`catch_up_steps`):
    far behind, one step; unknown, all H. The round after runs H again."""
    def late_state(node):
        theta = node.state["outer.theta"].clone()
        return SwarmState(tensors={"outer.theta": theta, "outer.momentum": torch.zeros_like(theta)}, round=3,
                          outcome=RoundOutcome(status="resynced", group_size=0), behind_seconds=behind)

    node = _node(tmp_path, ScriptedSync(resyncs={0: late_state}), rounds=5, extra=["outer.inner_steps=8"])
    records = {r.round: r for r in node.run()}
    assert records[3].status == "resynced"
    assert records[4].step - records[3].step == steps
    assert records[5].step - records[4].step == 8


def _catch_up_rank(rank: int, port: int, run_dir: str, behind: float | None, out: str) -> None:
    """Rank `rank` of a 2-rank node (gloo on loopback) whose resync says it is `behind` s late."""
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ranks = Ranks.from_env("cpu", timeout_s=30)  # a rank that stops a step early leaves the other waiting here

    def late_state(node):
        theta = node.state["outer.theta"].clone()  # this rank's shard
        return SwarmState(tensors={"outer.theta": theta, "outer.momentum": torch.zeros_like(theta)}, round=3,
                          outcome=RoundOutcome(status="resynced", group_size=0), behind_seconds=behind)

    config = load_config(None, [*SMALL, "train.max_rounds=4", "outer.inner_steps=8"])
    try:
        records = Node(config, Path(run_dir), ScriptedSync(resyncs={0: late_state}), ranks=ranks, progress=False).run()
        Path(out).write_text(json.dumps([r.step for r in records]))
    finally:
        ranks.close()


def test_the_local_ranks_of_a_node_catch_up_by_the_same_steps(tmp_path):
    """Each rank times its own steps and may read another lateness from its shard's swarm: one
    far behind (one step left) and one that does not know (all H). The node stops where the
    first rank does, so both run the same FSDP steps and the round ends on both."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    outs = [tmp_path / f"steps-{rank}.json" for rank in (0, 1)]
    procs = [ctx.Process(target=_catch_up_rank, args=(rank, port, str(tmp_path / "node"), behind, str(out)))
             for rank, behind, out in zip((0, 1), (None, 1e9), outs, strict=True)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    steps = [json.loads(out.read_text()) for out in outs]
    assert steps[0] == steps[1]
    assert steps[0][-1] - steps[0][-2] == 1  # the round in flight: the one step the later rank had left


def test_catch_up_runs_the_steps_the_others_have_left():
    assert catch_up_steps(20, None, 0.1) == 20 and catch_up_steps(20, 0.0, 0.1) == 20
    assert catch_up_steps(20, 0.55, 0.1) == 15  # 5.5 steps behind: 15 left
    assert catch_up_steps(20, 5.0, 0.1) == 1  # a whole round behind: one step, still a contribution
    assert catch_up_steps(20, 0.5, 0.0) == 20  # no step time yet


def test_a_later_resync_of_a_trained_node_counts_as_one(tmp_path):
    def again(node):
        theta = node.state["outer.theta"].clone()
        return SwarmState(tensors={"outer.theta": theta, "outer.momentum": torch.zeros_like(theta)}, round=5,
                          outcome=RoundOutcome(status="resynced", group_size=0))

    node = _node(tmp_path, ScriptedSync(resyncs={1: again}), rounds=6)
    records = node.run()
    assert [r.status for r in records] == ["init", "alone", "resynced", "alone"]
    assert records[2].resyncs == 1 and records[2].dropped_round == 1 and node.joined_at_round is None


def test_a_stop_during_averaging_drops_the_round_and_saves_where_we_are(tmp_path):
    stop = StopRequested()

    def stop_now(delta):
        stop.requested = True
        return RoundOutcome(status="committed", average=delta, group_size=2)

    sync = ScriptedSync({2: stop_now})
    node = _node(tmp_path, sync, rounds=5, stop=stop)
    records = node.run()
    assert [r.round for r in records] == [0, 1]  # round 2 was never counted
    assert node.round == 1
    saved = load_checkpoint(node.run_dir / "checkpoints")
    assert saved.round == 1 and saved.meta["params_sha256"] == records[-1].params_sha256


def test_theta_is_hashed_once_per_distinct_value(tmp_path, monkeypatch):
    calls = []
    real = hashing.tensor_sha256
    monkeypatch.setattr(hashing, "tensor_sha256", lambda t: calls.append(1) or real(t))
    commit = {r: (lambda d: RoundOutcome(status="committed", average=d, group_size=2)) for r in (1, 2, 3)}
    node = _node(tmp_path, ScriptedSync(commit), rounds=3)
    node.run()
    assert len(calls) == 4  # the initial θ and one per round, although each round reads the hash 5+ times


def test_the_records_checkpoint_is_written_before_the_record(tmp_path, monkeypatch):
    """A checkpoint that fails to write leaves no record claiming that round."""
    node = _node(tmp_path, ScriptedSync(), rounds=2)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    node.run()  # rounds 1-2 on disk
    node2 = _node(tmp_path, ScriptedSync(), rounds=3)
    monkeypatch.setattr("diloco_p2p.loop.node.save_checkpoint", disk_full)
    with pytest.raises(OSError):
        node2.run()
    assert [r["round"] for r in _lines(node2)] == [0, 1, 2]  # round 3 is in no checkpoint, so in no record
