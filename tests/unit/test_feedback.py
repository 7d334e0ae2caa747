"""Error feedback (`diloco_p2p.loop.error_feedback`): the arithmetic after each kind of round, what
"sent" means per wire and group size, and the buffer in a node: offered with Δ, checkpointed,
restored on resume, reset when the node adopts the swarm's state."""

from __future__ import annotations

import pytest
import torch

from diloco_p2p.config import SyncConfig, load_config
from diloco_p2p.contract import RoundOutcome, StopRequested, SwarmState
from diloco_p2p.loop.error_feedback import ErrorFeedback, sent_values
from diloco_p2p.loop.node import Node
from diloco_p2p.planner.simulate import simulate
from diloco_p2p.swarm.collective import codecs, wire
from tests.unit.test_node import SMALL, ScriptedSync


def vector(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def committed(k: int = 3) -> RoundOutcome:
    return RoundOutcome(status="committed", average=torch.zeros(1), group_size=k)


def test_defaults_on_for_topk2_only_and_never_for_fp32_fp16():
    assert ErrorFeedback(10, SyncConfig(compression="topk2")).enabled
    assert not ErrorFeedback(10, SyncConfig(compression="int4")).enabled
    assert ErrorFeedback(10, SyncConfig(compression="int8", error_feedback=True)).enabled
    assert not ErrorFeedback(10, SyncConfig(compression="topk2", error_feedback=False)).enabled
    assert not ErrorFeedback(10, SyncConfig(compression="fp16", error_feedback=True)).enabled
    off = ErrorFeedback(10, SyncConfig())
    d = torch.ones(10)
    assert off.offer(d) is d


@pytest.mark.parametrize("compression, k", [("int4", 2), ("int4", 3), ("int8", 3)])
def test_dense_sent_values_are_what_the_reducers_decode_of_each_part(compression, k):
    x, chunk = vector(3000, 1), 500
    expected = torch.cat([torch.cat([wire.decode(wire.encode(x[lo + a : lo + b], compression), b - a, compression)
                                     for a, b in wire.chunk_ranges(hi - lo, chunk)])
                          for lo, hi in wire.partition(3000, k)])
    assert torch.equal(sent_values(x, compression, k, chunk=chunk), expected)


def test_topk2_sent_values_are_the_decoded_contribution():
    x = vector(9000, 2)
    sent = sent_values(x, "topk2", 3, density=0.02, chunk=4000)
    assert torch.equal(sent, codecs.decode_chunks(codecs.encode_chunks(x, 4000, 0.02), 9000, 4000, 0.02))
    assert int((sent != 0).sum()) == sum(min(m, -(-m * 2 // 100)) for m in (4000, 4000, 1000))


def test_error_is_what_was_not_sent_and_everything_is_sent_eventually():
    """offered_t = Δ_t + e_(t-1), e_t = offered_t − sent_t, so Σ sent_t = Σ Δ_t − e_T: the
    feedback loses nothing, it only delays."""
    fb = ErrorFeedback(5000, SyncConfig(compression="topk2", topk_density=0.05), chunk=2048)
    total_delta, total_sent = torch.zeros(5000, dtype=torch.float64), torch.zeros(5000, dtype=torch.float64)
    for t in range(30):
        delta = vector(5000, 10 + t)
        offered = fb.offer(delta)
        fb.settle(offered, committed())
        sent = sent_values(offered, "topk2", 3, density=0.05, chunk=2048)
        assert torch.allclose(fb.error, offered - sent)
        total_delta += delta.double()
        total_sent += sent.double()
    assert torch.allclose(total_sent + fb.error.double(), total_delta, atol=1e-4)
    # the residual stays bounded (it does not grow like Σ Δ, about sqrt(30)·|Δ| here)
    assert fb.error.abs().max() < 0.5 * total_delta.abs().max() + 30


def test_decay_offers_delta_plus_beta_error_as_computed_by_hand():
    """SparseLoCo's rule e ← βe + Δ, send C(e), e ← e − C(e) on 4 values at density 1/4: C keeps
    the largest magnitude exactly (lo = hi), so every step is exact arithmetic."""
    d1, d2 = torch.tensor([1.0, -3.0, 0.5, 2.0]), torch.tensor([0.25, 1.0, -1.5, 0.0])
    for beta, offer2, e2 in ((0.5, [0.75, 1.0, -1.25, 1.0], [0.75, 1.0, 0.0, 1.0]),
                             (1.0, [1.25, 1.0, -1.0, 2.0], [1.25, 1.0, -1.0, 0.0])):  # 1.0: the plain rule
        fb = ErrorFeedback(4, SyncConfig(compression="topk2", topk_density=0.25, feedback_decay=beta))
        fb.settle(fb.offer(d1), committed(2))
        assert fb.error.tolist() == [1.0, 0.0, 0.5, 2.0]  # -3 was sent
        offered = fb.offer(d2)
        assert offered.tolist() == offer2
        fb.settle(offered, committed(2))
        assert fb.error.tolist() == e2
        fb.settle(fb.offer(torch.zeros(4)), RoundOutcome(status="failed", average=None, group_size=2))
        assert fb.error.tolist() == e2  # nothing applied: the old e is owed, not a decayed one


def test_decay_one_is_the_plain_rule_bit_for_bit():
    plain, one = (ErrorFeedback(5000, SyncConfig(compression="topk2", topk_density=0.05, **kw), chunk=2048)
                  for kw in ({}, {"feedback_decay": 1.0}))
    for t in range(3):
        delta, owed = vector(5000, 40 + t), plain.error.clone()
        offered = plain.offer(delta)
        assert torch.equal(offered, delta + owed) and torch.equal(one.offer(delta), offered)
        plain.settle(offered, committed())
        one.settle(offered, committed())
        assert torch.equal(plain.error, one.error)


def test_replicas_with_decaying_feedback_agree_on_theta_every_round(tmp_path):
    config = load_config(None, [*SMALL, "train.max_rounds=3", "sync.compression=topk2", "sync.topk_density=0.05",
                                "sync.feedback_decay=0.9", "outer.momentum=0", "outer.lr=1.0"])
    records = simulate(config, tmp_path, ["a", "b"])
    hashes = [[r.params_sha256 for r in records[k]] for k in ("a", "b")]
    assert hashes[0] == hashes[1] and len(set(hashes[0])) == 4  # round 0 and 3 rounds that each moved θ


def test_alone_applied_clears_the_error_and_nothing_applied_keeps_it():
    fb = ErrorFeedback(100, SyncConfig(compression="int4", error_feedback=True))
    offered = fb.offer(vector(100, 3))
    fb.settle(offered, committed(2))
    kept = fb.error.clone()
    assert kept.abs().max() > 0
    fb.settle(fb.offer(vector(100, 4)), RoundOutcome(status="failed", average=None, group_size=2))
    assert torch.equal(fb.error, kept)
    fb.settle(fb.offer(vector(100, 5)), RoundOutcome(status="alone", average=torch.zeros(100), group_size=1))
    assert torch.equal(fb.error, torch.zeros(100))


def test_a_non_finite_offer_leaves_no_non_finite_error():
    fb = ErrorFeedback(100, SyncConfig(compression="topk2"))
    delta = vector(100, 6)
    delta[3] = float("nan")
    fb.settle(fb.offer(delta), committed())
    assert bool(torch.isfinite(fb.error).all())


def _node(tmp_path, sync, rounds):
    config = load_config(None, [*SMALL, f"train.max_rounds={rounds}", "sync.compression=topk2",
                                "sync.topk_density=0.05", "train.checkpoint_every=1"])
    return Node(config, tmp_path / "run", sync, progress=False)


def test_node_offers_delta_plus_error_checkpoints_it_and_resumes_it(tmp_path):
    sync = ScriptedSync({r: (lambda d: RoundOutcome(status="committed", average=d / 2, group_size=2))
                         for r in (1, 2)})
    node = _node(tmp_path, sync, rounds=1)
    node.run()
    e1 = node.feedback.error.clone()
    assert torch.allclose(e1, sync.deltas[1] - sent_values(sync.deltas[1], "topk2", 2, density=0.05))
    assert e1.abs().max() > 0

    resumed = _node(tmp_path, sync, rounds=2)
    assert torch.equal(resumed.feedback.error, e1)  # restored from the checkpoint
    resumed.outer.pseudo_gradient = lambda views, offset=None, part=None: torch.zeros_like(e1)  # a round that moved nothing
    resumed.run()
    assert torch.equal(sync.deltas[2], e1)  # so it offered exactly what it owed


def test_adopting_the_swarms_state_resets_the_error(tmp_path):
    def donor(node):
        theta = node.state["outer.theta"].clone()
        return SwarmState(tensors={"outer.theta": theta, "outer.momentum": torch.zeros_like(theta)}, round=5,
                          outcome=RoundOutcome(status="resynced", group_size=0))

    sync = ScriptedSync({1: lambda d: RoundOutcome(status="committed", average=d, group_size=2)}, resyncs={1: donor})
    node = _node(tmp_path, sync, rounds=6)
    node.outer.pseudo_gradient = lambda views, offset=None, part=None: torch.zeros_like(node.outer.theta) + 0.25
    node.run()
    e1 = sync.deltas[1] - sent_values(sync.deltas[1], "topk2", 2, density=0.05)
    assert e1.abs().max() > 0
    assert [r.status for _, r in sync.after] == ["committed", "resynced", "alone"]
    assert torch.equal(sync.deltas[6], torch.full_like(e1, 0.25))  # after the resync: Δ alone, nothing owed


def test_carry_starts_the_round_from_theta_less_its_share_of_the_residual_and_offers_once(tmp_path):
    """sync.feedback_carry γ = 1: round 2's inner steps start from θ − β·e (the offset handed to the copy
    and to Δ), and the offer Δ + β·e is the model's whole distance from θ, θ − θ_local."""
    sync = ScriptedSync({r: (lambda d: RoundOutcome(status="committed", average=d / 2, group_size=2))
                         for r in (1, 2)})
    config = load_config(None, [*SMALL, "train.max_rounds=2", "sync.compression=topk2", "sync.topk_density=0.05",
                                "sync.feedback_decay=0.9", "sync.feedback_carry=1"])
    node = Node(config, tmp_path / "run", sync, progress=False)
    starts, ends = [], []
    copy_into, pseudo_gradient = node.outer.copy_into, node.outer.pseudo_gradient

    def copy(params, offset=None, part=None):
        starts.append(None if offset is None else offset.clone())
        return copy_into(params, offset, part)

    def delta(views, offset=None, part=None):
        ends.append((node.outer.theta.clone(), node.outer.gather(views), offset))
        return pseudo_gradient(views, offset, part)

    node.outer.copy_into, node.outer.pseudo_gradient = copy, delta
    node.run()
    e1 = sync.deltas[1] - sent_values(sync.deltas[1], "topk2", 2, density=0.05)
    assert e1.abs().max() > 0
    round_starts = [s for s in starts if s is not None]  # the others: θ itself (the records' eval)
    assert len(round_starts) == 2 and not round_starts[0].any()  # round 1 from θ: nothing owed yet
    assert torch.equal(round_starts[1], e1 * -0.9)  # round 2 from θ − β·e
    theta, local, offset = ends[1]
    assert offset is not None and torch.equal(offset, round_starts[1])
    assert torch.allclose(sync.deltas[2], theta - local, atol=1e-6)  # offered once: θ − θ_local


def test_replicas_that_carry_agree_on_theta_and_unset_carries_half_under_topk2(tmp_path):
    common = [*SMALL, "train.max_rounds=3", "sync.compression=topk2", "sync.topk_density=0.05",
              "sync.feedback_decay=0.9", "outer.momentum=0", "outer.lr=2.0"]
    runs = {name: simulate(load_config(None, [*common, *sets]), tmp_path / name, ["a", "b"])
            for name, sets in (("unset", []), ("half", ["sync.feedback_carry=0.5"]), ("zero", ["sync.feedback_carry=0"]))}
    hashes = {name: [[r.params_sha256 for r in run[k]] for k in ("a", "b")] for name, run in runs.items()}
    assert hashes["unset"] == hashes["half"]
    for a, b in hashes.values():
        assert a == b and len(set(a)) == 4  # every replica the same θ, every round
    assert hashes["half"][0][:2] == hashes["zero"][0][:2]  # round 1: nothing owed yet, the same start
    assert hashes["half"][0][2] != hashes["zero"][0][2]  # round 2 started from θ − γ·β·e


def test_a_stopped_node_keeps_its_residual_and_resumes_round_two_from_the_same_start(tmp_path):
    """A node stopped while round 2 averages drops the round and checkpoints round 1, with the e it
    had offered (owed again, not lost with the dropped offer); resumed, it starts round 2 from the
    same θ − γ·β·e as the round it dropped."""
    stop, starts = StopRequested(), []

    def average(d):
        stop.requested = len(sync.deltas) == 2
        return RoundOutcome(status="committed", average=d / 2, group_size=2)

    def watched(node):
        copy_into = node.outer.copy_into

        def copy(params, offset=None, part=None):
            if offset is not None:
                starts.append((node.outer.theta.clone(), offset.clone()))
            copy_into(params, offset, part)
        node.outer.copy_into = copy
        return node

    sync = ScriptedSync({r: average for r in (1, 2)})
    config = load_config(None, [*SMALL, "train.max_rounds=2", "sync.compression=topk2", "sync.topk_density=0.05",
                                "train.checkpoint_every=1", "sync.feedback_decay=0.9", "sync.feedback_carry=0.5"])
    stopped = watched(Node(config, tmp_path / "run", sync, stop=stop, progress=False))
    stopped.run()
    e1 = sync.deltas[1] - sent_values(sync.deltas[1], "topk2", 2, density=0.05)
    assert stopped.round == 1 and e1.abs().max() > 0 and torch.equal(stopped.feedback.error, e1)
    resumed = watched(Node(config, tmp_path / "run", sync, progress=False))
    assert torch.equal(resumed.feedback.error, e1)
    resumed.run()
    (_, first), (theta, dropped), (theta_again, again) = starts
    assert not first.any() and torch.equal(dropped, e1 * -0.45)
    assert torch.equal(theta, theta_again) and torch.equal(dropped, again)
