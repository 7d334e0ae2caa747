"""sync.overlap (`diloco_p2p.loop.overlap`): the Eager Updates formulas, recomputed here by hand, and the
node's loop against a scripted swarm: the global θ every member hashes, the eager node's local
start point, checkpoints of the round in flight, joiners, and the in-process replicas."""

from __future__ import annotations

import threading

import pytest
import torch

from diloco_p2p.config import OuterConfig, load_config
from diloco_p2p.contract import Background, RoundOutcome, StopRequested, SwarmState
from diloco_p2p.errors import UserError
from diloco_p2p.hashing import tensor_sha256
from diloco_p2p.loop.checkpoint import load_checkpoint
from diloco_p2p.loop.node import Node
from diloco_p2p.loop.outer import flatten
from diloco_p2p.loop.overlap import EagerCorrection, Pipeline, outer_update
from diloco_p2p.planner.simulate import simulate
from tests.unit.test_node import SMALL

BETA, LR = 0.9, 0.7
OUTER = OuterConfig(lr=LR, momentum=BETA, nesterov=True)

# The review's worked example (MATH ENTRY 1): k = 2 workers, d = 4.
D1 = [0.04, -0.02, 0.06, -0.01]
D2 = [0.06, -0.01, 0.03, 0.01]


def nesterov(theta, m, g):
    """Sutskever et al. 2013 as DiLoCo uses it, on plain lists: m ← βm + g; θ ← θ − η(g + βm)."""
    m = [BETA * mi + gi for mi, gi in zip(m, g, strict=True)]
    theta = [t - LR * (gi + BETA * mi) for t, gi, mi in zip(theta, g, m, strict=True)]
    return theta, m


def paper_eager_worker(theta0, own, averages, M):
    """Algorithm 3 (Eager Updates §2.3) for worker m, verbatim: Δ̃_m^(t) = Δ^(t-1) + (1/M)(Δ_m^(t) − Δ_m^(t-1)),
    θ_m^(t) = OuterOpt(θ_m^(t-1), Δ̃_m^(t)), with Δ^(0) = Δ_m^(0) = 0."""
    theta, m = list(theta0), [0.0] * len(theta0)
    prev_own, prev_avg = [0.0] * len(theta0), [0.0] * len(theta0)
    out = []
    for t in range(len(own)):
        g = [a + (o - p) / M for a, o, p in zip(prev_avg, own[t], prev_own, strict=True)]
        theta, m = nesterov(theta, m, g)
        out.append(theta)
        prev_own, prev_avg = own[t], averages[t]
    return out


def test_the_first_eager_step_by_hand():
    # Round 1: nothing delayed yet, Δ̃_1 = (1/2)·Δ_1 = [0.02, -0.01, 0.03, -0.005]; m = Δ̃_1;
    # θ_1 = 1 − 0.7·(1 + 0.9)·Δ̃_1 = 1 − 1.33·Δ̃_1.
    c = EagerCorrection(4, OUTER)
    c.step(torch.tensor(D1, dtype=torch.float64).float() / 2)
    expected = [1 - 1.33 * 0.02, 1 - 1.33 * -0.01, 1 - 1.33 * 0.03, 1 - 1.33 * -0.005]
    assert [round(1 + x, 6) for x in c.theta.tolist()] == pytest.approx([0.9734, 1.0133, 0.9601, 1.00665], abs=1e-6)
    assert (1 + c.theta).tolist() == pytest.approx(expected, abs=1e-6)
    assert c.pending.tolist() == pytest.approx([0.02, -0.01, 0.03, -0.005], abs=1e-7)


def test_global_plus_correction_is_the_papers_eager_worker():
    """The split (global θ on the delayed averages) + (local correction) equals Algorithm 3 run directly."""
    gen = torch.Generator().manual_seed(0)
    rounds, M = 5, 2
    own = [D1] + [torch.randn(4, generator=gen).mul(0.05).tolist() for _ in range(rounds - 1)]
    other = [D2] + [torch.randn(4, generator=gen).mul(0.05).tolist() for _ in range(rounds - 1)]
    averages = [[(a + b) / 2 for a, b in zip(x, y, strict=True)] for x, y in zip(own, other, strict=True)]
    assert averages[0] == pytest.approx([0.05, -0.015, 0.045, 0.0])  # the review's Δ̄

    paper = paper_eager_worker([1.0] * 4, own, averages, M)
    theta, mom = torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    corr = EagerCorrection(4, OUTER)
    corr.theta, corr.momentum, corr.pending = (torch.zeros(4, dtype=torch.float64) for _ in range(3))
    for t in range(rounds):
        if t > 0:
            outer_update(theta, mom, torch.tensor(averages[t - 1], dtype=torch.float64), OUTER)  # Algorithm 2 l.10
        d = torch.tensor(own[t], dtype=torch.float64) / M - corr.pending
        outer_update(corr.theta, corr.momentum, d, OUTER)
        corr.pending = torch.tensor(own[t], dtype=torch.float64) / M
        assert (theta + corr.theta).tolist() == pytest.approx(paper[t], abs=1e-12)


def test_delayed_is_the_blocking_sequence_one_round_late():
    """Algorithm 2 line 10: θ^(t) = OuterOpt(θ^(t-1), Δ^(t-1)), so after t rounds θ has applied Δ^(1..t-1)."""
    averages = [[0.05, -0.015, 0.045, 0.0], [0.01, 0.02, -0.03, 0.04]]
    blocking, m = [1.0] * 4, [0.0] * 4
    blocking, m = nesterov(blocking, m, averages[0])
    theta, mom = torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    outer_update(theta, mom, torch.tensor(averages[0], dtype=torch.float64), OUTER)  # at the end of round 2
    assert theta.tolist() == pytest.approx(blocking, abs=1e-12)
    assert theta.tolist() == pytest.approx([1 - 1.33 * 0.05, 1 + 1.33 * 0.015, 1 - 1.33 * 0.045, 1.0], abs=1e-12)


# -- the node's loop against a scripted swarm ---------------------------------------------------


class OverlapSync:
    """A swarm whose average of round r is `average(r, Δ)`; records what the loop sends, from
    whichever thread the loop averages in."""

    speeds = None

    def __init__(self, average=None, peer_id="scripted-peer", resyncs=None, stop=None):
        self.peer_id, self.resyncs, self.stop = peer_id, resyncs or {}, stop
        self.make = average or (lambda r, d: d / 2)
        self.deltas, self.hashes, self.threads, self.after, self.thetas = {}, {}, {}, [], {}
        self.seen = []

    def announce(self, node):
        pass

    def before_round(self, node):
        self.seen.append(node)
        make = self.resyncs.pop(node.round, None)
        return make(node) if make else None

    def average(self, round, delta, weight, params_hash):
        self.deltas[round], self.hashes[round] = delta.clone(), params_hash
        self.threads[round] = threading.current_thread().name
        if self.stop is not None and round == 2:
            self.stop.requested = True
        return RoundOutcome(status="committed", average=self.make(round, delta), group_size=2, contributors=2)

    def after_round(self, node, record):
        self.after.append((node, record))
        self.thetas[node.round] = node.state["outer.theta"].clone()  # the global θ the swarm is told of

    def dht_peers(self):
        return 0

    def close(self):
        pass


def _node(tmp_path, sync, mode="eager", rounds=4, extra=(), name="run", stop=None):
    config = load_config(None, [*SMALL, f"train.max_rounds={rounds}", f"sync.overlap={mode}", *extra])
    return Node(config, tmp_path / name, sync, stop=stop, progress=False)


def _starts(node):
    """The θ each round's inner steps start from, captured at the round's first inner step."""
    starts, real, h = [], node.trainer.step, node.config.outer.inner_steps

    def step(next_batch):
        if node.step % h == 0:
            starts.append(flatten(node.params).double())
        return real(next_batch)

    node.trainer.step = step
    return starts


def test_the_eager_node_trains_from_the_papers_theta_and_hashes_the_global_one(tmp_path):
    sync = OverlapSync()  # the group's average of round r: Δ_r / 2
    node = _node(tmp_path, sync, rounds=4)
    starts, theta0 = _starts(node), node.outer.theta.clone()
    records = node.run()[1:]
    assert [r.applied_round for r in records] == [None, 1, 2, 4]  # the last round drains the pipeline
    assert [r.status for r in records] == ["skipped", "committed", "committed", "committed"]
    assert all(sync.threads[t].startswith("average-round") for t in (1, 2, 3)) and sync.threads[4] == "MainThread"

    # Global θ (hashed, served): Algorithm 2 line 10 on the group's averages, bit for bit.
    theta, mom = theta0.clone(), torch.zeros_like(theta0)
    for t, record in enumerate(records, start=1):
        if t >= 2:
            outer_update(theta, mom, sync.deltas[t - 1] / 2, node.config.outer)
        if t == 4:
            outer_update(theta, mom, sync.deltas[4] / 2, node.config.outer)
        assert record.params_sha256 == tensor_sha256(theta)
        if t < 4:
            assert sync.hashes[t] == record.params_sha256  # round t is averaged among nodes holding this θ
    # Local start points: θ_m^(t) of Algorithm 3 with M = 2 (our group) and Δ^(t) = Δ_m^(t) / 2.
    own = [sync.deltas[t].double().tolist() for t in (1, 2, 3)]
    paper = paper_eager_worker(theta0.double().tolist(), own, [[x / 2 for x in d] for d in own], 2)
    assert torch.equal(starts[0].float(), theta0)
    for t in (1, 2, 3):
        assert torch.allclose(starts[t], torch.tensor(paper[t - 1], dtype=torch.float64), atol=1e-5)
        assert not torch.allclose(starts[t].float(), sync.thetas[t], atol=1e-6)  # not the global θ
    assert node.rounds.pipe.correction.theta.abs().sum() == 0  # drained: the run ends on the global θ


def test_delayed_trains_from_the_global_theta(tmp_path):
    sync = OverlapSync()
    node = _node(tmp_path, sync, mode="delayed", rounds=3)
    starts = _starts(node)
    node.run()
    for t in (1, 2):
        assert torch.equal(starts[t].float(), sync.thetas[t])


def test_nodes_with_different_data_hold_the_same_global_theta(tmp_path):
    """What the swarm hashes is the θ of the averages alone; each eager node's correction is its own."""
    fixed = lambda r, d: torch.full_like(d, 1e-3 * r)  # noqa: E731 - the group's average, the same for both
    a, b = OverlapSync(fixed, peer_id="peer-a"), OverlapSync(fixed, peer_id="peer-b")
    ra = _node(tmp_path, a, rounds=3, name="a").run()
    rb = _node(tmp_path, b, rounds=3, name="b").run()
    assert [r.params_sha256 for r in ra] == [r.params_sha256 for r in rb]
    assert not torch.equal(a.deltas[2], b.deltas[2])  # they trained on different data from different points


def test_a_checkpoint_holds_the_round_in_flight_and_resume_averages_it_again(tmp_path):
    stop = StopRequested()
    sync = OverlapSync(stop=stop)  # the stop comes while round 2 is averaged in the background
    node = _node(tmp_path, sync, rounds=5, stop=stop)
    node.run()
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt.round == 2 and ckpt.meta["overlap"]["inflight_round"] == 2
    assert torch.equal(ckpt.tensors["overlap.inflight_delta"], sync.deltas[2])
    assert torch.allclose(ckpt.tensors["overlap.pending"], sync.deltas[2] / 2)
    assert ckpt.tensors["overlap.theta"].abs().sum() > 0

    again = OverlapSync()
    resumed = _node(tmp_path, again, rounds=3)
    assert torch.equal(resumed.rounds.pipe.correction.theta, ckpt.tensors["overlap.theta"])
    records = resumed.run()
    assert torch.equal(again.deltas[2], sync.deltas[2])  # averaged again with the swarm on resume
    assert again.hashes[2] == ckpt.meta["params_sha256"]
    assert [r.applied_round for r in records] == [3]  # round 3 applied round 2's average, then its own


def test_a_joiner_adopts_the_average_in_flight_with_the_state(tmp_path):
    donor_theta = None

    def donor_state(node):
        nonlocal donor_theta
        donor_theta = torch.full_like(node.state["outer.theta"], 0.01)
        tensors = {"outer.theta": donor_theta, "outer.momentum": torch.zeros_like(donor_theta),
                   "overlap.average": torch.full_like(donor_theta, 0.002),
                   "overlap.average_round": torch.tensor([7])}
        return SwarmState(tensors=tensors, round=7, outcome=RoundOutcome(status="resynced", group_size=0))

    sync = OverlapSync(resyncs={0: donor_state})
    node = _node(tmp_path, sync, rounds=9)
    node.rounds.pipe.correction.theta.fill_(1.0)  # whatever it held goes
    records = node.run()
    assert [r.round for r in records] == [0, 7, 8, 9]
    assert records[2].applied_round == 7  # the members' round 7 average, from the state
    theta, mom = donor_theta.clone(), torch.zeros_like(donor_theta)
    outer_update(theta, mom, torch.full_like(theta, 0.002), node.config.outer)
    assert records[2].params_sha256 == tensor_sha256(theta) == sync.hashes[8]  # the members' θ of round 8


def test_the_served_state_carries_the_known_average_in_flight(tmp_path):
    sync = OverlapSync()
    node = _node(tmp_path, sync, rounds=3, extra=["outer.inner_steps=6"])
    node.run()
    served = [n for n, _ in sync.after if "overlap.average" in n.state]
    assert served, "no state was served with the average in flight"
    assert all(int(n.state["overlap.average_round"][0]) == n.round == n.in_flight_round for n in served)
    assert torch.equal(served[0].state["overlap.average"], sync.deltas[served[0].round] / 2)


# -- overlap=inner: the average lands τ inner steps into the next round -----------------------------

INNER = ["outer.inner_steps=4", "sync.overlap_steps=2", "sync.overlap_mix=0.25", "train.eval_every=1"]


def _weights(node):
    """The model's weights before and after every inner step (flat, fp64), and the step to stop after."""
    before, after, real = [], [], node.trainer.step
    stop_after = {}

    def step(next_batch):
        before.append(flatten(node.params).double())
        out = real(next_batch)
        after.append(flatten(node.params).double())
        if len(after) == stop_after.get("step"):
            node.stop.requested = True
        return out

    node.trainer.step = step
    return before, after, stop_after


def test_inner_lands_the_average_tau_steps_in_and_merges_it_into_the_trained_weights(tmp_path):
    sync = OverlapSync()  # the group's average of round r: Δ_r / 2
    node = _node(tmp_path, sync, mode="inner", rounds=4, extra=INNER)
    before, after, _ = _weights(node)
    theta0 = node.outer.theta.clone()
    records = node.run()[1:]
    assert [r.applied_round for r in records] == [None, 1, 2, 4]  # the last round drains the pipeline
    assert [r.landed_step for r in records] == [None, 2, 2, 2]
    assert all(sync.threads[t].startswith("average-round") for t in (1, 2, 3)) and sync.threads[4] == "MainThread"

    # Global θ (hashed, served): the delayed sequence, θ^(t) = OuterOpt(θ^(t-1), Δ^(t-1)), bit for bit.
    theta, mom, landed = theta0.clone(), torch.zeros_like(theta0), {1: theta0.double()}
    for t, record in enumerate(records, start=1):
        if t >= 2:
            outer_update(theta, mom, sync.deltas[t - 1] / 2, node.config.outer)
            landed[t] = theta.double()  # the global θ once round t − 1's average has landed
        if t == 4:
            outer_update(theta, mom, sync.deltas[4] / 2, node.config.outer)
        assert record.params_sha256 == tensor_sha256(theta)
        if t < 4:
            assert sync.hashes[t] == record.params_sha256
    # The trained weights: round 1 starts at θ^(0); each later round where the last ended (the eval
    # in between sees θ and leaves them); τ = 2 steps in, θ_local ← α·θ_local + (1−α)·θ with θ the
    # global θ just updated by the previous round's average (what round t serves), α = 0.25.
    h, tau, alpha = 4, 2, 0.25
    assert torch.equal(before[0].float(), theta0)
    for t in (2, 3, 4):
        start, land = (t - 1) * h, (t - 1) * h + tau
        assert torch.equal(before[start], after[start - 1])
        expected = alpha * after[land - 1] + (1 - alpha) * landed[t]
        assert torch.allclose(before[land], expected, atol=1e-6)
        assert not torch.allclose(before[land], after[land - 1], atol=1e-6)
    for t in (1, 2, 3, 4):  # Δ of round t: the global θ after the landing less where round t's steps ended
        assert torch.allclose(sync.deltas[t].double(), landed[t] - after[t * h - 1], atol=1e-6)
    assert records[1].exposed_seconds >= 0 and records[1].compute_seconds > 0


class GatedSync(OverlapSync):
    """Round r's average is known only once `gates[r]` is set."""

    def __init__(self, gates):
        super().__init__()
        self.gates = gates

    def average(self, round, delta, weight, params_hash):
        outcome = super().average(round, delta, weight, params_hash)
        assert self.gates[round].wait(10)
        return outcome


def test_inner_with_tau_0_lands_the_average_once_known_and_at_the_latest_after_h_minus_1_steps(tmp_path):
    gates = {r: threading.Event() for r in (1, 2, 3, 4)}
    gates[3].set()
    gates[4].set()
    sync = GatedSync(gates)
    node = _node(tmp_path, sync, mode="inner", rounds=4, extra=[*INNER, "sync.overlap_steps=0"])
    before, after, _ = _weights(node)
    step = node.trainer.step

    def gate(next_batch):
        out = step(next_batch)
        if node.step == 4:  # round 2, its first step: round 1's average becomes known
            gates[1].set()
            assert node.rounds.pipe.inflight_done(wait=True)
        if node.step == 10:  # round 3's (H − 1)-th step, its latest landing point: round 2's average comes
            threading.Timer(0.3, gates[2].set).start()  # 0.3 s after it (started here: slow steps cannot hide it)
        return out

    node.trainer.step = gate
    records = node.run()[1:]
    assert [r.landed_step for r in records] == [None, 1, 3, 1]  # known after 1 step; waited for at H − 1; at once
    assert records[2].exposed_seconds >= 0.1 > records[1].exposed_seconds
    assert [r.applied_round for r in records] == [None, 1, 2, 4]
    assert torch.equal(before[8], after[7])  # round 3 starts where round 2 ended


def test_inner_stopped_after_the_landing_checkpoints_the_round_before_it(tmp_path):
    """A stop drops the partial round: θ goes back to before the landing and the checkpoint holds
    the average in flight, to average again on resume, as a stop before the landing does."""
    stop = StopRequested()
    sync = OverlapSync()
    node = _node(tmp_path, sync, mode="inner", rounds=5, extra=INNER, stop=stop)
    _, _, stop_after = _weights(node)
    stop_after["step"] = 4 * 2 + 3  # round 3, one step after the landing of round 2's average
    records = node.run()
    assert records[-1].round == 2
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt.round == 2 and ckpt.meta["overlap"]["inflight_round"] == 2
    assert ckpt.meta["params_sha256"] == records[-1].params_sha256  # θ of round 2, without round 2's average
    assert torch.equal(ckpt.tensors["overlap.inflight_delta"], sync.deltas[2])

    again = OverlapSync()
    resumed = _node(tmp_path, again, mode="inner", rounds=3, extra=INNER)
    ended = ckpt.tensors["outer.theta"] - ckpt.tensors["overlap.inflight_delta"]  # where round 2's steps ended
    assert torch.allclose(flatten(resumed.params), ended, atol=1e-6) and resumed.rounds.carry
    records = resumed.run()
    assert torch.equal(again.deltas[2], sync.deltas[2]) and again.hashes[2] == ckpt.meta["params_sha256"]
    assert [r.applied_round for r in records] == [3]


def test_overlap_config_is_checked(tmp_path):
    with pytest.raises(UserError, match="delayed_nesterov"):
        load_config(None, ["sync.overlap=eager", "outer.delayed_nesterov=2"])
    with pytest.raises(UserError, match="dynamic_local_updates"):
        load_config(None, ["sync.overlap=delayed", "outer.dynamic_local_updates=true"])
    with pytest.raises(UserError, match="sync.overlap"):
        load_config(None, ["sync.overlap=sometimes"])
    assert "sync.overlap" not in load_config(None, []).swarm_view()  # older runs keep their config hash
    assert load_config(None, ["sync.overlap=eager"]).swarm_view()["sync.overlap"] == "eager"
    with pytest.raises(UserError, match="overlap_steps"):
        load_config(None, ["sync.overlap=inner", "sync.overlap_steps=5", "outer.inner_steps=5"])
    with pytest.raises(UserError, match="H >= 2"):
        load_config(None, ["sync.overlap=inner", "outer.inner_steps=1"])
    inner = load_config(None, ["sync.overlap=inner", "sync.overlap_steps=3", "sync.overlap_mix=0.7"]).swarm_view()
    assert inner["sync.overlap"] == "inner" and not any(k.startswith("sync.overlap_") for k in inner)  # per node


@pytest.mark.parametrize("mode,wire", [("delayed", []), ("eager", []), ("inner", []),
                                       ("inner", ["sync.compression=int4", "sync.error_feedback=true"])])
def test_replicas_agree_on_theta_every_round(tmp_path, mode, wire):
    config = load_config(None, [*SMALL, "train.max_rounds=3", f"sync.overlap={mode}", "sync.overlap_steps=1", *wire])
    records = simulate(config, tmp_path, ["a", "b"])
    hashes = [[r.params_sha256 for r in records[k]] for k in ("a", "b")]
    assert hashes[0] == hashes[1]
    assert hashes[0][0] == hashes[0][1] and len(set(hashes[0])) == 3  # round 1 applies no average yet
    assert [r.applied_round for r in records["a"][1:]] == [None, 1, 3]


# -- a node of N local ranks: each rank's shard in the background, the node-wide outcome on the loop's thread


class _Ranks:
    """Two local ranks, both with our values, whose collectives record the thread they ran on."""

    world_size = 2

    def __init__(self):
        self.on_main = []

    def all_reduce(self, values, op="sum"):
        self.on_main.append(threading.current_thread() is threading.main_thread())
        return [float(v) * (self.world_size if op == "sum" else 1) for v in values]


class _ShardSwarm:
    """The shard's own `SwarmSync`: its average of Δ waits for the test's go."""

    def __init__(self):
        self.go, self.hashes = threading.Event(), []

    def average(self, round, delta, weight, params_hash):
        assert self.go.wait(10)
        self.hashes.append(params_hash)
        return RoundOutcome(status="committed", average=delta / 2, group_size=2, contributors=2, bytes_sent=10)


def test_a_shard_averages_behind_compute_and_its_outcome_is_made_node_wide_on_the_loops_thread():
    """Collectives among local ranks in the background thread would interleave with FSDP's on the
    loop's thread: the shard's average runs there, the node-wide part only when the loop takes it."""
    from diloco_p2p.swarm.multirank import ShardSync

    sync = ShardSync.__new__(ShardSync)  # its swarm endpoint and ranks replaced by the two above
    sync.world_size, sync.inner, sync.ranks = 2, _ShardSwarm(), _Ranks()
    pipe = Pipeline("eager", 4, OUTER, 2)
    pipe.begin(sync, 1, torch.ones(4), 8.0, "shard-hash")
    assert isinstance(pipe.inflight, Background) and not pipe.inflight_done()  # averaging behind compute
    sync.inner.go.set()
    assert pipe.inflight_done(wait=True) and sync.ranks.on_main == []  # the shard's part: no collective
    flight = pipe.take()
    assert sync.ranks.on_main == [True, True]  # the node-wide part, on the loop's thread
    outcome = flight.result()
    assert (outcome.shards, outcome.shards_committed, outcome.bytes_sent) == (2, 2, 20)
    assert torch.equal(outcome.average, torch.full((4,), 0.5)) and sync.inner.hashes == ["shard-hash"]
    assert flight.node_result() is outcome and sync.ranks.on_main == [True, True]  # once
