"""outer.recipe=auto: H's schedule and the outer step for a number of nodes and a horizon.

A user who changes only the number of nodes (outer.nodes) or the run's length (train.max_rounds)
keeps a run tuned for it. The choices come from `benchmarks/quality/quality.py` (the tables are in
docs/recipes.md; every run in benchmarks/quality/results/quality_tiny_sweep.json):

- H: a run of M >= 2 nodes spends up to twice the all-reduces of a constant H on the quadratic
  synchronization rule (`diloco_p2p.config.schedule`, ``qsr``; Gu et al. 2023): short rounds while the inner
  lr is high, H once it has decayed. ``h_start`` is the smallest that keeps the run within
  2 x max_rounds all-reduces (8 for H=30). On the tiny preset, 16 rounds of H=30 at M=4 (seed 0),
  against data-parallel at equal tokens: a constant H=30 +18.7%, H=15 (32 all-reduces) +16.2%,
  QSR from 8 (31) +15.1%, QSR from 4 (55) +13.9%; doubling H from 1 (20) changed nothing.
- The outer step, short horizons (under 64 rounds): plain averaging, η 1 and β 0. An outer lr above
  1 took the average out of the replicas' region (η 1.5-2 at H=30: +43-47%; η 1.4 at H=5: +29% where
  η 1 gave +11%), Nesterov momentum had no rounds to build up in (0.7/0.3 +16.8%, 0.9/0.3 +16.1%,
  0.6/0.6 +18.4% on the same QSR schedule), and so did a larger inner lr (3e-3: +26%).
- Long horizons (64 rounds and more): the DiLoCo paper's outer step (η 0.7, Nesterov β 0.9), which
  the 150m and 1b presets ran before, with β warmed up over the first 16 rounds (Pier 2025); not
  measured here.
- What no schedule fixes on the tiny preset: averaging every inner step (H=1, 480 all-reduces)
  still ends +8.7% above data-parallel (+6.2% at η 2). Four replicas of batch 8 x 128 tokens are
  deep in the noise-dominated regime, where one AdamW step on the batch of four beats the average
  of four AdamW steps on a quarter each; the gap left is that floor plus what the budget of
  all-reduces allows, not a tuning left undone.
"""

from __future__ import annotations

from typing import Any

from diloco_p2p.config.schedule import qsr_start

ALLREDUCE_BUDGET = 2.0  # at most this many times the all-reduces of a constant H
LONG_HORIZON = 64  # rounds from which momentum has time to build up


def recipe(nodes: int, max_rounds: int, inner_steps: int, schedules: bool = True) -> dict[str, Any]:
    """The outer fields (`OuterConfig`) for M = `nodes` planned over `max_rounds` rounds of H = `inner_steps`;
    with `schedules` false (sync.overlap, sync.fragments, delayed Nesterov or dynamic local updates, whose
    rounds do not start from θ or whose H is their own) a constant H and no outer warmup."""
    if nodes == 1:  # no averaging to lose: the lookahead-like outer step of the tiny preset's sweep
        return {"h_schedule": "constant", "lr": 0.7, "momentum": 0.3}
    start = qsr_start(inner_steps, max_rounds, int(ALLREDUCE_BUDGET * max_rounds)) if schedules else inner_steps
    sync = {"h_schedule": "qsr" if start < inner_steps else "constant", "h_start": start}
    if max_rounds < LONG_HORIZON:
        return {**sync, "lr": 1.0, "momentum": 0.0}
    return {**sync, "lr": 0.7, "momentum": 0.9, "warmup_rounds": 16 if schedules else 0}
