"""sync.fragments (Streaming DiLoCo's fragments, arXiv:2501.18512): round r averages only part
(r − 1) mod P of the flat parameters. The outer step on a part, the node's loop against a
scripted swarm (what each round sends, θ part by part, the trained weights never reset), with
``sync.overlap=inner`` (the landing merges only its part; a stop puts it back), checkpoints of the
trained weights, the error-feedback residual per part, and replicas that agree on θ every round."""

from __future__ import annotations

import pytest
import torch

from diloco_p2p.config import OuterConfig, SyncConfig, load_config
from diloco_p2p.contract import RoundOutcome, StopRequested
from diloco_p2p.errors import UserError
from diloco_p2p.hashing import tensor_sha256
from diloco_p2p.loop.checkpoint import load_checkpoint, save_checkpoint
from diloco_p2p.loop.error_feedback import ErrorFeedback, sent_values
from diloco_p2p.loop.node import Node
from diloco_p2p.loop.outer import OuterOptimizer, flatten
from diloco_p2p.loop.overlap import outer_update
from diloco_p2p.planner.simulate import simulate
from diloco_p2p.swarm.collective.wire import partition
from tests.unit.test_node import SMALL
from tests.unit.test_overlap import OverlapSync, _weights

OUTER = OuterConfig(lr=0.7, momentum=0.9, nesterov=True)


def _params():
    """Three parameters of 5, 7 and 4 values: parts of their flat layout cross their boundaries."""
    torch.manual_seed(0)
    return [torch.randn(5), torch.randn(7, 1), torch.randn(2, 2)]


def _step(theta, momentum, grad, part, cfg):
    """The outer rule on a part alone (`outer_update` on copies), written back into θ and m."""
    lo, hi = part
    t, m = theta[lo:hi].clone(), momentum[lo:hi].clone()
    outer_update(t, m, grad, cfg)
    theta[lo:hi], momentum[lo:hi] = t, m


def test_the_outer_step_of_a_part_is_the_whole_rule_on_its_values_and_leaves_the_rest():
    outer = OuterOptimizer(_params(), OUTER)
    theta, momentum = outer.theta.clone(), torch.zeros(16)
    for lo, hi in [(3, 9), (9, 16), (3, 9)]:  # the second step on (3, 9) uses that part's momentum
        g = torch.randn(hi - lo)
        version = outer.version
        outer.step(g, (lo, hi))
        _step(theta, momentum, g, (lo, hi), OUTER)  # m ← βm + g; θ ← θ − η(g + βm), on the part alone
        assert torch.equal(outer.theta, theta) and torch.equal(outer.momentum, momentum)
        assert outer.version == version + 1
    assert torch.equal(outer.theta[:3], flatten(_params())[:3])  # never in a part that stepped
    with pytest.raises(ValueError, match=r"expected \(6,\)"):
        outer.step(torch.zeros(16), (3, 9))


def test_a_part_is_written_into_the_parameters_it_spans():
    params = _params()
    outer = OuterOptimizer(params, OUTER)
    outer.theta = torch.arange(16, dtype=torch.float32)
    local = flatten(params)
    outer.copy_into(params, part=(3, 13))  # the end of the first, all of the second, one of the third
    assert torch.equal(flatten(params)[3:13], outer.theta[3:13])
    assert torch.equal(flatten(params)[:3], local[:3]) and torch.equal(flatten(params)[13:], local[13:])
    before = flatten(params)
    outer.mix_into(params, 0.25, (0, 6))  # θ_local ← 0.25·θ_local + 0.75·θ on the part
    assert torch.allclose(flatten(params)[:6], 0.25 * before[:6] + 0.75 * outer.theta[:6])
    assert torch.equal(flatten(params)[6:], before[6:])


def test_error_feedback_offers_and_settles_only_the_parts_values():
    fb = ErrorFeedback(12, SyncConfig(compression="int4", error_feedback=True))
    fb.error = torch.arange(12, dtype=torch.float32) / 100
    kept = fb.error.clone()
    delta = torch.randn(4)
    offered = fb.offer(delta, (4, 8))
    assert torch.equal(offered, delta + kept[4:8])
    fb.settle(offered, RoundOutcome(status="committed", average=offered, group_size=2), (4, 8))
    assert torch.equal(fb.error[4:8], offered - sent_values(offered, "int4", 2))
    assert torch.equal(fb.error[:4], kept[:4]) and torch.equal(fb.error[8:], kept[8:])
    offered = fb.offer(torch.zeros(4), (0, 4))  # a failed round: the part's residual is still owed
    fb.settle(offered, RoundOutcome(status="failed", group_size=2), (0, 4))
    assert torch.equal(fb.error[:4], kept[:4])


def _node(tmp_path, sync, fragments=3, rounds=4, extra=(), name="run", stop=None):
    config = load_config(None, [*SMALL, f"train.max_rounds={rounds}", f"sync.fragments={fragments}",
                                "train.eval_every=1", *extra])
    return Node(config, tmp_path / name, sync, stop=stop, progress=False)


def test_each_round_averages_its_part_and_the_trained_weights_are_never_reset(tmp_path):
    sync = OverlapSync()  # the group's average of round r: Δ_r / 2
    node = _node(tmp_path, sync, rounds=4)
    before, after, _ = _weights(node)
    theta0, n, h = node.outer.theta.clone(), node.outer.numel, node.config.outer.inner_steps
    parts = partition(n, 3)
    records = node.run()[1:]
    assert [r.fragment for r in records] == [0, 1, 2, 0]
    theta, momentum = theta0.clone(), torch.zeros(n)
    for t, record in enumerate(records, start=1):
        lo, hi = parts[(t - 1) % 3]
        end = after[t * h - 1].float()  # the trained weights where round t's steps ended
        # Δ of round t: its part only, θ less the trained weights (never reset to θ since round 1)
        assert sync.deltas[t].shape == (hi - lo,)
        assert torch.allclose(sync.deltas[t], theta[lo:hi] - end[lo:hi], atol=1e-6)
        _step(theta, momentum, sync.deltas[t] / 2, (lo, hi), node.config.outer)
        assert record.params_sha256 == tensor_sha256(theta) == sync.hashes.get(t + 1, record.params_sha256)
        if t < 4:  # round t + 1 starts where round t ended, its part replaced by the part's new θ
            start = before[t * h].float()
            assert torch.equal(start[lo:hi], theta[lo:hi])
            rest = torch.ones(n, dtype=torch.bool)
            rest[lo:hi] = False
            assert torch.equal(start[rest], end[rest])
    assert torch.equal(before[0].float(), theta0)
    assert torch.equal(flatten(node.params), theta)  # the run ends with θ in the model


INNER = ["outer.inner_steps=4", "sync.overlap=inner", "sync.overlap_steps=2", "sync.overlap_mix=0.25"]


def test_under_inner_the_landing_merges_only_its_part(tmp_path):
    sync = OverlapSync()  # the group's average of round r: Δ_r / 2
    node = _node(tmp_path, sync, fragments=2, rounds=4, extra=INNER)
    before, after, _ = _weights(node)
    n, h, tau, alpha = node.outer.numel, 4, 2, 0.25
    parts = partition(n, 2)
    theta, momentum = node.outer.theta.clone(), torch.zeros(n)
    records = node.run()[1:]
    assert [r.applied_round for r in records] == [None, 1, 2, 4] and [r.fragment for r in records] == [0, 1, 0, 1]
    assert [sync.deltas[t].numel() for t in (1, 2, 3, 4)] == [hi - lo for lo, hi in parts] * 2

    def land(t):  # round t's average, Δ_t / 2, onto θ and the momentum of its part
        _step(theta, momentum, sync.deltas[t] / 2, parts[(t - 1) % 2], node.config.outer)
        return parts[(t - 1) % 2]

    for t in (2, 3, 4):  # round t − 1's average lands τ steps into round t, on its part only
        lo, hi = land(t - 1)
        step = (t - 1) * h + tau
        merged, carried = before[step].float(), after[step - 1].float()
        assert torch.allclose(merged[lo:hi], alpha * carried[lo:hi] + (1 - alpha) * theta[lo:hi], atol=1e-6)
        assert not torch.allclose(merged[lo:hi], carried[lo:hi], atol=1e-6)
        rest = torch.ones(n, dtype=torch.bool)
        rest[lo:hi] = False
        assert torch.equal(merged[rest], carried[rest])  # the other part carries on untouched
        if t == 4:
            land(4)  # the last round drains: its own average too
        assert records[t - 1].params_sha256 == tensor_sha256(theta)


@pytest.mark.parametrize("fragments", [1, 2])
def test_rebase_moves_the_tau_steps_progress_onto_the_new_theta(tmp_path, fragments):
    """sync.overlap_merge=rebase: θ_local ← θ + (θ_local − where round t − 1 ended), on its part."""
    sync = OverlapSync()
    node = _node(tmp_path, sync, fragments=fragments, rounds=4, extra=[*INNER, "sync.overlap_merge=rebase"])
    before, after, _ = _weights(node)
    n, h, tau = node.outer.numel, 4, 2
    parts = partition(n, fragments)
    theta, momentum = node.outer.theta.clone(), torch.zeros(n)
    records = node.run()[1:]
    for t in (2, 3, 4):
        lo, hi = parts[(t - 2) % fragments]
        _step(theta, momentum, sync.deltas[t - 1] / 2, (lo, hi), node.config.outer)
        step, ended = (t - 1) * h + tau, after[(t - 1) * h - 1].float()  # round t − 1 ended at step (t − 1)·h
        merged, carried = before[step].float(), after[step - 1].float()
        assert torch.allclose(merged[lo:hi], theta[lo:hi] + (carried[lo:hi] - ended[lo:hi]), atol=1e-6)
        assert torch.equal(merged[:lo], carried[:lo]) and torch.equal(merged[hi:], carried[hi:])
        if t < 4:  # (the last round also applies its own average)
            assert records[t - 1].params_sha256 == tensor_sha256(theta)


def test_a_stop_after_the_landing_puts_the_parts_trained_weights_back_and_resume_loads_them(tmp_path):
    stop = StopRequested()
    node = _node(tmp_path, OverlapSync(), fragments=2, rounds=5, extra=INNER, stop=stop)
    _, after, stop_after = _weights(node)
    stop_after["step"] = 4 * 2 + 3  # round 3, one step after round 2's average (part 1) landed
    records = node.run()
    assert records[-1].round == 2
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt.round == 2 and ckpt.meta["overlap"]["inflight_round"] == 2
    assert ckpt.meta["params_sha256"] == records[-1].params_sha256  # θ of round 2, the landing undone
    # the trained weights at the stop: part 0 as trained so far, part 1 as before the landing's merge
    lo, hi = partition(node.outer.numel, 2)[1]
    local = ckpt.tensors["fragments.local"]
    assert torch.equal(local[:lo], after[-1].float()[:lo]) and torch.equal(local[lo:], after[9].float()[lo:])

    resumed = _node(tmp_path, OverlapSync(), fragments=2, rounds=3, extra=INNER)
    assert resumed.rounds.carry and torch.equal(flatten(resumed.params), local)

    ckpt.tensors["fragments.local"] = local[:-1]
    save_checkpoint(tmp_path / "bad" / "checkpoints", ckpt)
    with pytest.raises(UserError, match="fragments.local has"):
        _node(tmp_path, OverlapSync(), fragments=2, rounds=3, extra=INNER, name="bad")


@pytest.mark.parametrize("extra", [[], INNER, [*INNER, "sync.overlap_merge=rebase"],
                                   ["sync.compression=topk2", "sync.topk_density=0.05"],
                                   [*INNER, "sync.compression=int4", "sync.error_feedback=true"]])
def test_replicas_agree_on_theta_every_round(tmp_path, extra):
    config = load_config(None, [*SMALL, "train.max_rounds=4", "sync.fragments=3", *extra])
    records = simulate(config, tmp_path, ["a", "b"])
    hashes = [[r.params_sha256 for r in records[k]] for k in ("a", "b")]
    assert hashes[0] == hashes[1] and len(set(hashes[0])) >= 4
    assert [r.fragment for r in records["a"][1:]] == [0, 1, 2, 0]


def test_fragments_config_is_checked():
    assert "sync.fragments" not in load_config(None, []).swarm_view()  # older runs keep their config hash
    assert load_config(None, ["sync.fragments=4"]).swarm_view()["sync.fragments"] == 4
    rebase = load_config(None, ["sync.overlap=inner", "sync.overlap_merge=rebase"]).swarm_view()
    assert "sync.overlap_merge" not in rebase  # the node's own, as τ and α
    with pytest.raises(UserError, match="overlap_merge"):
        load_config(None, ["sync.overlap_merge=replace"])
    for bad, match in [(["sync.overlap=eager"], "overlap none or inner"), (["sync.overlap=delayed"], "not delayed"),
                       (["outer.delayed_nesterov=2"], "delayed_nesterov")]:
        with pytest.raises(UserError, match=match):
            load_config(None, ["sync.fragments=2", *bad])
    with pytest.raises(UserError, match="sync.fragments"):
        load_config(None, ["sync.fragments=0"])


def test_a_resumed_round_in_flight_is_rebased_from_where_it_ended(tmp_path):
    stop = StopRequested()
    rebase = [*INNER, "sync.overlap_merge=rebase"]
    node = _node(tmp_path, OverlapSync(), fragments=1, rounds=5, extra=rebase, stop=stop)
    _, _, stop_after = _weights(node)
    stop_after["step"] = 4 * 2 + 3  # round 3, after round 2's average landed
    node.run()
    resumed = _node(tmp_path, OverlapSync(), fragments=1, rounds=3, extra=rebase)
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoints")
    ended = ckpt.tensors["outer.theta"] - ckpt.tensors["overlap.inflight_delta"]  # round 2's steps ended here
    assert resumed.rounds.ended is not None and resumed.rounds.ended[0] == 2
    assert torch.equal(resumed.rounds.ended[1], flatten(resumed.params)) and torch.allclose(resumed.rounds.ended[1], ended)


def test_a_part_goes_to_the_one_rank_layout_and_back_and_a_wrong_size_is_refused():
    from diloco_p2p.local.fsdp import ShardLayout
    from diloco_p2p.local.ranks import Ranks
    from diloco_p2p.loop.fragments import Fragments

    params = _params()
    fragments = Fragments(3, ShardLayout(params, Ranks(torch.device("cpu"))), 16)
    assert [fragments.full_part(r) for r in (1, 2, 3, 4)] == [(0, 6), (6, 11), (11, 16), (0, 6)]
    assert [fragments.index(r) for r in (1, 2, 3, 4)] == [0, 1, 2, 0] and fragments.numel(2) == 5
    values = torch.arange(5, dtype=torch.float32)
    assert torch.equal(fragments.to_local(fragments.to_full(values, 2), 2, "here"), values)
    with pytest.raises(UserError, match="here: the round in flight has 6 values, its part of the model 5"):
        fragments.to_local(torch.zeros(6), 2, "here")
    with pytest.raises(UserError, match="sync.fragments=17 leaves this rank no value of part 16"):
        Fragments(17, ShardLayout(params, Ranks(torch.device("cpu"))), 16)
    whole = Fragments(1, ShardLayout(params, Ranks(torch.device("cpu"))), 16)
    assert whole.part(3) is None and whole.index(3) is None and whole.numel(3) == 16


def test_after_a_parts_step_only_the_hash_chunks_it_touched_are_hashed_again(monkeypatch):
    from diloco_p2p import hashing

    monkeypatch.setattr(hashing, "HASH_CHUNK_BYTES", 16)  # 4 values a chunk: θ of 16 values in 4 chunks
    outer = OuterOptimizer(_params(), OUTER)
    assert outer.params_sha256() == tensor_sha256(outer.theta.clone())
    for part, stale in [((3, 9), {0, 1, 2}), ((9, 16), {2, 3}), ((4, 8), {1})]:
        outer.step(torch.randn(part[1] - part[0]), part)
        assert outer._stale == stale
        assert outer.params_sha256() == tensor_sha256(outer.theta.clone()) and outer._stale == set()
    outer.load_state_tensors({"outer.theta": torch.randn(16), "outer.momentum": torch.zeros(16)})
    assert outer._stale is None and outer.params_sha256() == tensor_sha256(outer.theta.clone())
    outer.step(torch.randn(16))
    assert outer._stale == {0, 1, 2, 3} and outer.params_sha256() == tensor_sha256(outer.theta.clone())
