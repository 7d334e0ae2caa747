"""``sync.average_moments`` (issue 49): the inner first moments averaged after each committed round.

Which buffers a node hands in, that the average is written back only when the moments'
all-reduce completes, that replicas end each round holding the group's average (the all-reduce's
arithmetic, recomputed here) with bit-identical θ under Muon and AdamW, and where the option is
refused."""

from __future__ import annotations

import pytest
import torch

from diloco_p2p.config import InnerConfig, load_config
from diloco_p2p.contract import RoundOutcome
from diloco_p2p.errors import UserError
from diloco_p2p.loop.inner import InnerTrainer
from diloco_p2p.loop.moments import MomentAveraging, first_moments
from diloco_p2p.model.build import build_model
from diloco_p2p.planner.simulate import ReplicaSync, simulate, wire_average
from tests.unit.test_node import SMALL

MOMENTS = [*SMALL, "train.max_rounds=3", "sync.average_moments=true"]


def _trainer(optimizer: str, steps: int = 2) -> InnerTrainer:
    model = build_model(load_config(None, ["model.preset=tiny"]).model, 259, seed=0)
    trainer = InnerTrainer(model, InnerConfig(optimizer=optimizer, batch_size=2, seq_len=16, warmup_steps=1),
                           10, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        trainer.step(lambda: torch.randint(0, 259, (2, 17), generator=g))
    return trainer


class _Answer:
    """A `Sync` whose moments' all-reduce ends as told."""

    def __init__(self, outcome: RoundOutcome):
        self.outcome = outcome
        self.handed: list[torch.Tensor] = []

    def average_moments(self, round, moments, weight):
        self.handed.append(moments.clone())
        return self.outcome


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_node_hands_in_one_first_moment_per_parameter_and_none_before_its_first_step(optimizer):
    assert first_moments(_trainer(optimizer, steps=0)) == []
    trainer = _trainer(optimizer)
    buffers = first_moments(trainer)
    params = list(trainer.model.parameters())
    assert [b.shape for b in buffers] == [p.shape for p in params]  # in the model's order, whichever optimizer
    # the optimizers' own tensors (written in place), never a second moment
    second = {id(s["exp_avg_sq"]) for s in trainer.optimizer.state.values()}
    assert all(id(b) not in second for b in buffers)
    owned = {id(t) for o in trainer.optimizers.values() for s in o.state.values() for t in s.values()}
    assert {id(b) for b in buffers} <= owned


def test_a_completed_exchange_writes_the_average_back_in_the_order_handed_in():
    trainer = _trainer("muon")
    numel = sum(b.numel() for b in first_moments(trainer))
    average = torch.arange(numel, dtype=torch.float32) / numel
    sync = _Answer(RoundOutcome(status="committed", average=average, parts=4, parts_committed=4, bytes_sent=10,
                                rejections={"x": ["norm"]}))
    outcome = RoundOutcome(status="committed", bytes_sent=5, rejections={"x": ["weight"], "y": ["opposed"]})
    MomentAveraging(trainer, sync).after(3, 1.0, outcome)
    assert torch.equal(torch.cat([b.reshape(-1) for b in first_moments(trainer)]), average)
    assert outcome.moments == "ok" and outcome.bytes_sent == 15
    assert outcome.rejections == {"x": ["norm", "weight"], "y": ["opposed"]}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_row_only_another_node_trained_moves_about_lr_after_the_average_not_lr_over_eps(optimizer):
    """AdamW's exp_avg averaged in where our own exp_avg_sq is 0 (the embedding row of a token only
    another node saw) would step by exp_avg / eps: the write-back raises exp_avg_sq to exp_avg²
    there, so the next step moves that row by about lr, not a million times more."""
    trainer = _trainer(optimizer)
    embedding = trainer.model.model.embed_tokens.weight  # the model's first parameter: offset 0
    assert next(iter(trainer.model.parameters())) is embedding
    row, width = 258, embedding.shape[1]  # a token id the batches never drew (0..258, exclusive)
    state = next(s for o in trainer.optimizers.values() for q, s in o.state.items() if q is embedding)
    assert float(state["exp_avg_sq"][row].abs().max()) == 0.0  # untouched by our data
    average = torch.cat([b.reshape(-1) for b in first_moments(trainer)]).clone()
    average[row * width:(row + 1) * width] = 0.05  # another node's momentum for that row
    sync = _Answer(RoundOutcome(status="committed", average=average, parts=2, parts_committed=2))
    MomentAveraging(trainer, sync).after(1, 1.0, RoundOutcome(status="committed"))
    assert torch.equal(state["exp_avg_sq"][row], torch.full((width,), 0.05) ** 2)
    assert torch.equal(state["exp_avg_sq"][:row], state["exp_avg_sq"][:row].clamp(min=state["exp_avg"][:row] ** 2))
    before, lr = embedding.detach()[row].clone(), trainer.lr
    g = torch.Generator().manual_seed(1)
    trainer.step(lambda: torch.randint(0, 258, (2, 17), generator=g))  # row 258 unseen again
    moved = float((embedding.detach()[row] - before).abs().max())
    assert 0 < moved <= 4 * lr, (moved, lr)


@pytest.mark.parametrize("status,parts,label", [("committed", 3, "partial"), ("failed", None, "failed"),
                                               ("alone", None, "failed")])
def test_an_exchange_that_does_not_complete_leaves_the_node_its_own_moments(status, parts, label):
    trainer = _trainer("adamw")
    before = [b.clone() for b in first_moments(trainer)]
    numel = sum(b.numel() for b in before)
    sync = _Answer(RoundOutcome(status=status, average=torch.zeros(numel), parts=4, parts_committed=parts))
    outcome = RoundOutcome(status="committed")
    MomentAveraging(trainer, sync).after(1, 1.0, outcome)
    assert outcome.moments == label
    assert all(torch.equal(a, b) for a, b in zip(before, first_moments(trainer), strict=True))


def test_a_round_that_did_not_commit_averages_no_moments():
    sync = _Answer(RoundOutcome(status="committed"))
    for status in ("alone", "failed", "resynced"):
        outcome = RoundOutcome(status=status)
        MomentAveraging(_trainer("adamw"), sync).after(1, 1.0, outcome)
        assert outcome.moments is None
    assert sync.handed == []


class _Recording(ReplicaSync):
    """A replica's sync that keeps what it handed in and what came back, per round."""

    seen: dict[str, dict[int, tuple[torch.Tensor, float, torch.Tensor]]] = {}

    def average_moments(self, round, moments, weight):
        out = super().average_moments(round, moments, weight)
        self.seen.setdefault(self.peer_id, {})[round] = (moments.clone(), weight, out.average.clone())
        return out


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_replicas_hold_the_groups_average_of_their_moments_after_each_round_and_the_same_theta(tmp_path, optimizer):
    config = load_config(None, [*MOMENTS, f"inner.optimizer={optimizer}"])
    _Recording.seen = {}
    nodes = {}
    records = simulate(config, tmp_path, ["a", "b", "c"], make_sync=_Recording, on_nodes=nodes.update)
    seen = _Recording.seen
    assert sorted(seen) == ["a", "b", "c"] and all(sorted(s) == [1, 2, 3] for s in seen.values())
    for round_ in (1, 2, 3):
        handed = [seen[k][round_] for k in ("a", "b", "c")]
        expected = wire_average([m for m, _, _ in handed], [w for _, w, _ in handed], config.sync.compression,
                                config.sync.max_weight_ratio)
        assert all(torch.equal(avg, expected) for _, _, avg in handed)  # the all-reduce's arithmetic, bit for bit
        assert not torch.equal(handed[0][0], handed[1][0])  # the replicas' own moments differed
    for key, node in nodes.items():  # each holds the last round's average
        assert torch.equal(torch.cat([b.reshape(-1) for b in first_moments(node.trainer)]), seen[key][3][2])
    hashes = {k: [r.params_sha256 for r in rs] for k, rs in records.items()}
    assert hashes["a"] == hashes["b"] == hashes["c"]
    assert all(r.moments == "ok" for rs in records.values() for r in rs[1:])
    # and the moments change the training: without them the replicas' θ goes elsewhere from round 2 on
    plain = simulate(load_config(None, [*SMALL, "train.max_rounds=3", f"inner.optimizer={optimizer}"]),
                     tmp_path / "plain", ["a", "b", "c"])
    theirs = [r.params_sha256 for r in plain["a"]]
    assert theirs[:2] == hashes["a"][:2] and theirs[2] != hashes["a"][2]
    assert all(r.moments is None for r in plain["a"])


@pytest.mark.parametrize("setting", ["sync.overlap=delayed", "sync.fragments=2", "sync.compression=topk2"])
def test_average_moments_is_refused_where_a_round_does_not_average_everything_now_and_dense(setting):
    with pytest.raises(UserError, match="sync.average_moments .* set sync.average_moments=false"):
        load_config(None, ["sync.average_moments=true", setting])


def test_average_moments_is_part_of_the_swarms_config_only_when_on():
    """A node with it and one without cannot join one run; runs from before keep their config hash."""
    off, on = load_config(None, []).swarm_view(), load_config(None, ["sync.average_moments=true"]).swarm_view()
    assert "sync.average_moments" not in off and on == {**off, "sync.average_moments": True, "inner.optimizer": "adamw"}
    # Muon's momentum and AdamW's exp_avg are not one quantity: with the moments averaged, one optimizer per run
    muon = load_config(None, ["sync.average_moments=true", "inner.optimizer=muon"]).swarm_view()
    assert muon != on
    assert load_config(None, ["inner.optimizer=muon"]).swarm_view() == off
