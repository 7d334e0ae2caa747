"""The outer loop's schedules (`diloco_p2p.config.schedule`) and the recipe that picks them."""

from __future__ import annotations

import pytest
import torch

from diloco_p2p.config import OuterConfig, load_config, schedule
from diloco_p2p.config.recipe import recipe
from diloco_p2p.errors import UserError
from diloco_p2p.loop.outer import OuterOptimizer


def lengths(cfg: OuterConfig, max_rounds: int) -> list[int]:
    return [schedule.inner_steps(cfg, max_rounds, r) for r in range(1, schedule.rounds(cfg, max_rounds) + 1)]


def test_constant_runs_max_rounds_of_h():
    cfg = OuterConfig(inner_steps=30)
    assert lengths(cfg, 16) == [30] * 16
    assert schedule.total_steps(cfg, 16) == 480


def test_ramp_doubles_from_h_start_and_cuts_the_last_round_at_the_planned_steps():
    cfg = OuterConfig(inner_steps=30, h_schedule="ramp", h_start=1)
    got = lengths(cfg, 4)  # T = 120: 1 + 2 + 4 + 8 + 16 = 31, then 30, 30, and 29 to end at 120
    assert got == [1, 2, 4, 8, 16, 30, 30, 29]
    assert sum(got) == schedule.total_steps(cfg, 4) == 120
    assert lengths(OuterConfig(inner_steps=30, h_schedule="ramp", h_start=8), 2) == [8, 16, 30, 6]


def test_qsr_grows_h_as_the_cosine_decays_and_spans_the_run():
    cfg = OuterConfig(inner_steps=30, h_schedule="qsr", h_start=4)
    got = lengths(cfg, 16)
    assert sum(got) == 480 and got[0] == 4 and max(got) == 30
    assert got[:-1] == sorted(got[:-1])  # never shorter while the lr decays (the last is cut)
    # H = h_start / c(p)^2 with c the cosine factor at the round's start: c = 1/2 at half the run
    starts = [sum(got[:i]) for i in range(len(got))]
    mid = next(i for i, s in enumerate(starts) if s >= 240)
    assert got[mid] == min(30, int(4 / (0.5 * (1 + torch.cos(torch.tensor(torch.pi * starts[mid] / 480)).item())) ** 2))


def test_outer_warmup_ramps_lr_from_lr_start_and_momentum_from_zero():
    cfg = OuterConfig(lr=0.8, momentum=0.6, warmup_rounds=4, lr_start=1.0)
    steps = [schedule.outer_step(cfg, r) for r in range(1, 7)]
    assert steps[0] == (1.0, 0.0)
    assert steps[2] == pytest.approx((0.9, 0.3))
    assert steps[4:] == [(0.8, 0.6), (0.8, 0.6)]
    assert schedule.outer_step(OuterConfig(lr=0.8, momentum=0.6), 1) == (0.8, 0.6)


def test_the_outer_step_takes_the_rounds_lr_and_momentum():
    cfg = OuterConfig(lr=0.5, momentum=0.9, warmup_rounds=2, lr_start=1.0, nesterov=True)
    outer = OuterOptimizer([torch.zeros(4)], cfg)
    delta = torch.tensor([1.0, -2.0, 0.5, 0.0])
    outer.step(delta, round=1)  # β 0, η 1: plain averaging
    assert torch.equal(outer.theta, -delta) and torch.equal(outer.momentum, delta)
    outer.step(delta, round=2)  # β 0.45, η 0.75: m = 0.45 m + Δ, θ -= η (Δ + β m)
    m = 0.45 * delta + delta
    assert torch.allclose(outer.theta, -delta - 0.75 * (delta + 0.45 * m))
    assert torch.allclose(outer.momentum, m)


def test_a_schedule_is_refused_where_rounds_do_not_start_from_theta():
    with pytest.raises(UserError, match="outer.h_schedule"):
        load_config(None, ["outer.h_schedule=ramp", "outer.inner_steps=8", "sync.overlap=eager"])
    with pytest.raises(UserError, match="h_start"):
        load_config(None, ["outer.h_schedule=ramp", "outer.inner_steps=8", "outer.h_start=9"])


def test_schedules_off_keep_the_swarm_hash_and_on_change_it():
    plain = load_config(None, ["outer.inner_steps=30"])
    assert not any(k.startswith(("outer.h_", "outer.warmup", "outer.lr_start", "outer.recipe", "outer.nodes"))
                   for k in plain.swarm_view())
    ramp = load_config(None, ["outer.inner_steps=30", "outer.h_schedule=ramp"])
    assert ramp.swarm_hash() != plain.swarm_hash()


def test_auto_recipe_fills_only_what_the_config_leaves_unset():
    auto = load_config(None, ["outer.recipe=auto", "outer.nodes=4", "train.max_rounds=16", "outer.inner_steps=30"])
    chosen = recipe(4, 16, 30)
    assert {k: getattr(auto.outer, k) for k in chosen} == chosen
    mine = load_config(None, ["outer.recipe=auto", "outer.nodes=4", "train.max_rounds=16", "outer.inner_steps=30",
                              "outer.lr=0.3"])
    assert mine.outer.lr == 0.3 and mine.outer.h_schedule == auto.outer.h_schedule
    # the recipe's inputs are not hashed, its choices are: two configs that choose alike agree
    manual = load_config(None, ["train.max_rounds=16", "outer.inner_steps=30",
                                *(f"outer.{k}={v}" for k, v in chosen.items())])
    assert manual.swarm_hash() == auto.swarm_hash()


@pytest.mark.parametrize("nodes", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("max_rounds", [4, 16, 32, 200])
def test_the_recipe_is_a_valid_config_for_any_swarm_and_horizon(nodes, max_rounds):
    cfg = load_config(None, ["outer.recipe=auto", f"outer.nodes={nodes}", f"train.max_rounds={max_rounds}",
                             "outer.inner_steps=30"])
    n = schedule.rounds(cfg.outer, max_rounds)
    assert max_rounds <= n <= 2 * max_rounds  # at most twice the all-reduces of a constant H


def test_simulate_plans_the_recipe_for_its_replicas_unless_told(tmp_path):
    from diloco_p2p.cli import main
    from tests.harness.settings import TINY

    tiny = [a for o in [*TINY, "train.max_rounds=1", "outer.inner_steps=2", "outer.recipe=auto"] for a in ("--set", o)]
    assert main(["simulate", "--replicas", "2", "--dir", str(tmp_path / "a"), *tiny]) == 0
    assert load_config(tmp_path / "a" / "replica-0" / "config.yaml").outer.nodes == 2
    assert main(["simulate", "--replicas", "2", "--dir", str(tmp_path / "b"), *tiny, "--set", "outer.nodes=8"]) == 0
    assert load_config(tmp_path / "b" / "replica-0" / "config.yaml").outer.nodes == 8


def test_the_recipe_keeps_h_constant_where_rounds_do_not_start_from_theta():
    base = ["outer.recipe=auto", "outer.nodes=4", "train.max_rounds=100", "outer.inner_steps=30"]
    for extra in (["sync.overlap=eager"], ["sync.fragments=2"], ["outer.dynamic_local_updates=true"]):
        cfg = load_config(None, [*base, *extra])
        assert (cfg.outer.h_schedule, cfg.outer.warmup_rounds) == ("constant", 0)
    long = load_config(None, base)  # 100 rounds: the long horizon's outer step, its momentum warmed up
    assert (long.outer.h_schedule, long.outer.momentum, long.outer.warmup_rounds) == ("qsr", 0.9, 16)


def test_the_recipe_follows_the_inner_optimizer():
    """With Muon inside: η 1 at every length (the long row lost there), a slow momentum from 8 nodes;
    with AdamW inside the rows of before. A node of the other optimizer chooses another step, so
    it does not match the swarm's hash (refused at start, the field named)."""
    def outer(nodes: int, rounds: int, optimizer: str) -> tuple:
        cfg = load_config(None, ["outer.recipe=auto", f"outer.nodes={nodes}", f"train.max_rounds={rounds}",
                                 "outer.inner_steps=30", f"inner.optimizer={optimizer}"])
        return cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov, cfg.outer.warmup_rounds, cfg.outer.h_schedule

    assert outer(4, 16, "muon") == outer(4, 16, "adamw") == (1.0, 0.0, True, 0, "qsr")
    assert outer(8, 16, "muon") == (1.0, 0.5, True, 0, "qsr") and outer(8, 16, "adamw")[:2] == (1.0, 0.0)
    assert outer(4, 100, "muon") == (1.0, 0.0, True, 0, "qsr") and outer(4, 100, "adamw")[:2] == (0.7, 0.9)
    assert outer(16, 700, "muon")[:2] == (1.0, 0.5) and outer(1, 16, "muon") == outer(1, 16, "adamw")

    def swarm(optimizer: str) -> str:
        return load_config(None, ["outer.recipe=auto", "outer.nodes=8", f"inner.optimizer={optimizer}"]).swarm_hash()

    assert swarm("muon") != swarm("adamw")


def test_a_malformed_value_under_the_recipe_is_named_by_its_own_field():
    with pytest.raises(UserError, match="field 'train.max_rounds'"):
        load_config(None, ["outer.recipe=auto", "train.max_rounds=abc"])
