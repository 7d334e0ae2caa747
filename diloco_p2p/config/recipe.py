"""``outer.recipe=auto``: H's schedule and the outer step for a number of nodes and a horizon.

A user who changes only the number of nodes (``outer.nodes``), the run's length
(``train.max_rounds``) or the inner optimizer keeps a run tuned for it: for M >= 2, ``qsr`` from
the smallest ``h_start`` that keeps the run within twice the all-reduces of a constant H. With
AdamW inside, plain averaging (η 1, β 0) under 64 rounds and the DiLoCo paper's Nesterov step
(η 0.7, β 0.9, warmed up over 16 rounds) from 64 rounds on. With Muon inside (MuLoCo) η 1 at any
length, and from 8 nodes a slow Nesterov momentum (β 0.5, MT-DAO's short outer memory): at 2
nodes it lost, at 4 it won or lost with the AdamW part's lr, and with AdamW inside it was far
worse. The choices come from `benchmarks/quality/quality.py` on the tiny preset. The table and
the measurements behind it: docs/recipes.md
"""

from __future__ import annotations

from typing import Any

from diloco_p2p.config.schedule import qsr_start

ALLREDUCE_BUDGET = 2.0  # at most this many times the all-reduces of a constant H
LONG_HORIZON = 64  # rounds from which momentum has time to build up
SLOW_MOMENTUM_NODES = 8  # with Muon inside, the swarm size from which β 0.5 beat plain averaging


def recipe(nodes: int, max_rounds: int, inner_steps: int, schedules: bool = True,
           optimizer: str = "adamw") -> dict[str, Any]:
    """The outer fields (`OuterConfig`) for M = `nodes` planned over `max_rounds` rounds of H = `inner_steps`
    with `optimizer` (``inner.optimizer``) inside; with `schedules` false (sync.overlap, sync.fragments,
    delayed Nesterov or dynamic local updates, whose rounds do not start from θ or whose H is their own)
    a constant H and no outer warmup."""
    if nodes == 1:  # no averaging to lose: the lookahead-like outer step of the tiny preset's sweep
        return {"h_schedule": "constant", "lr": 0.7, "momentum": 0.3}
    start = qsr_start(inner_steps, max_rounds, int(ALLREDUCE_BUDGET * max_rounds)) if schedules else inner_steps
    sync = {"h_schedule": "qsr" if start < inner_steps else "constant", "h_start": start}
    if optimizer == "muon":
        return {**sync, "lr": 1.0, "momentum": 0.5 if nodes >= SLOW_MOMENTUM_NODES else 0.0}
    if max_rounds < LONG_HORIZON:
        return {**sync, "lr": 1.0, "momentum": 0.0}
    return {**sync, "lr": 0.7, "momentum": 0.9, "warmup_rounds": 16 if schedules else 0}
