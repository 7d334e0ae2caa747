"""The outer loop's schedules: H of every round, and the outer step's η and β of every round.

A run is planned as ``train.max_rounds`` rounds of H = ``outer.inner_steps`` inner steps, so it
takes T = max_rounds · H inner steps whatever the schedule (the inner lr's cosine spans T too).
Under ``outer.h_schedule`` the early rounds are shorter, so the same T takes more rounds (more
all-reduces): the round count is `rounds(...)`, not max_rounds, and the last round is cut to end
the run at exactly T steps. Every value here is a pure function of the `OuterConfig` and the
round's number, and `outer` is a swarm field: every member of a round runs the same H and steps
θ with the same η and β, so the round still ends with bit-identical θ everywhere.

- ``constant``: H every round (DiLoCo).
- ``ramp``: H doubles from ``outer.h_start`` each round until it reaches H. Local SGD from
  scratch loses most in its first steps, when the replicas' trajectories diverge fastest; post-local
  SGD (Lin et al. 2020, "Don't use large mini-batches, use local SGD") runs the first phase
  synchronously and goes local later. Doubling reaches H in log2(H/h_start) rounds at a cost of
  about that many extra all-reduces.
- ``qsr``: the quadratic synchronization rule (Gu et al. 2023, "Why (and when) does local SGD
  generalize better than SGD?"): H grows as the learning rate decays, H ∝ 1/γ², here
  H_r = clamp(h_start / c(p)², h_start, H) with c(p) = ½(1 + cos πp) the cosine factor at the
  fraction p of the run done when round r starts (the inner warmup and floor left out, so H
  depends on swarm fields only).

Outer warmup (``outer.warmup_rounds`` = W > 0): over rounds 1..W, η moves linearly from
``outer.lr_start`` to ``outer.lr`` and β from 0 to ``outer.momentum`` (momentum warmup as in Pier,
2025: momentum needs outer steps to build up, and a full β on the first noisy steps overshoots).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Protocol


class OuterConfig(Protocol):  # `diloco_p2p.config.OuterConfig`'s fields read here (the config reads this module)
    inner_steps: int
    h_schedule: str
    h_start: int
    warmup_rounds: int
    lr: float
    lr_start: float | None
    momentum: float


def inner_steps(cfg: OuterConfig, max_rounds: int, round: int) -> int:
    """H of round `round` (1-based): steps of the last round past the run's end are cut off."""
    lengths = _lengths(cfg.h_schedule, cfg.h_start, cfg.inner_steps, max_rounds)
    return lengths[min(round, len(lengths)) - 1]


def rounds(cfg: OuterConfig, max_rounds: int) -> int:
    """How many rounds (all-reduces) the run takes: max_rounds under ``constant``, more under a ramp."""
    return len(_lengths(cfg.h_schedule, cfg.h_start, cfg.inner_steps, max_rounds))


def total_steps(cfg: OuterConfig, max_rounds: int) -> int:
    """T, the run's inner steps: max_rounds · H under every schedule."""
    return max_rounds * cfg.inner_steps


@lru_cache(maxsize=64)
def _lengths(schedule: str, h_start: int, h: int, max_rounds: int) -> tuple[int, ...]:
    total, done, out = max_rounds * h, 0, []
    while done < total:
        r = len(out) + 1
        if schedule == "ramp":
            step = min(h, h_start * 2 ** min(r - 1, 62))
        elif schedule == "qsr":
            c = 0.5 * (1 + math.cos(math.pi * done / total))
            step = h if c <= 0 else max(h_start, min(h, math.floor(h_start / (c * c))))
        else:
            step = h
        step = min(step, total - done)
        out.append(step)
        done += step
    return tuple(out)


def qsr_start(inner_steps: int, max_rounds: int, budget: int) -> int:
    """The smallest ``qsr`` h_start whose run takes at most `budget` rounds (H: a constant H fits any budget
    of at least max_rounds)."""
    return next(s for s in range(1, inner_steps + 1)
                if s == inner_steps or len(_lengths("qsr", s, inner_steps, max_rounds)) <= budget)


def outer_step(cfg: OuterConfig, round: int) -> tuple[float, float]:
    """(η, β) of round `round`'s outer step (1-based)."""
    w = cfg.warmup_rounds
    if not w or round > w:
        return cfg.lr, cfg.momentum
    start = cfg.lr if cfg.lr_start is None else cfg.lr_start
    f = (round - 1) / w if w > 1 else 1.0
    return start + (cfg.lr - start) * f, cfg.momentum * f


def dylu_steps(speeds: Mapping[str, float], me: str, h: int) -> int:
    """Dynamic local updates (AsyncDiLoCo, Liu et al. 2024; review MATH ENTRY 6): the fastest
    member runs H inner steps, a slower one ⌊v/max v · H⌋ (at least 1), so all reach the
    all-reduce together; the token weighting of the average accounts for the fewer steps.
    H when our speed or the group's is unknown."""
    fastest = max(speeds.values(), default=0.0)
    mine = speeds.get(me, 0.0)
    if not (fastest > 0 and mine > 0):
        return h
    return max(1, min(h, math.floor(mine / fastest * h)))


def catch_up_steps(h: int, behind_s: float | None, step_s: float) -> int:
    """A node that adopted the swarm's state `behind_s` seconds after the swarm began the round
    joins that round in flight: it runs only the steps the others have left, H − ⌊behind/step⌋
    (at least 1), so it reaches the round's group with them instead of after it closed and
    having to download again. `step_s` is its own step time, taken as the others' too. The token
    weighting of the average accounts for the fewer steps, as with dynamic local updates. H when
    either time is unknown."""
    if behind_s is None or not (behind_s > 0 and step_s > 0):
        return h
    return max(1, min(h, h - math.floor(behind_s / step_s)))
