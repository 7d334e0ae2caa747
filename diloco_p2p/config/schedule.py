"""The outer loop's schedules: H of every round, and the outer step's η and β of every round.

A run takes T = ``train.max_rounds`` · H inner steps whatever the schedule; under
``outer.h_schedule`` (``constant``; ``ramp``, after post-local SGD, Lin et al. 2020; ``qsr``, the
quadratic synchronization rule, Gu et al. 2023) the early rounds are shorter, so the same T takes
more rounds (`rounds`) and the last one is cut to end at T. ``outer.warmup_rounds`` moves η and
β up linearly (momentum warmup as in Pier 2025). Every value is a pure function of the
`OuterConfig` and the round's number, so every member of a round runs the same H and the same
step, and θ stays bit-identical.
The schedules: docs/architecture.md, "Schedules of H and of the outer step".
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
    """Dynamic local updates (AsyncDiLoCo, Liu et al. 2024): a member of speed v runs ⌊v/max v · H⌋
    inner steps (at least 1), so all reach the all-reduce together; H when a speed is unknown."""
    fastest = max(speeds.values(), default=0.0)
    mine = speeds.get(me, 0.0)
    if not (fastest > 0 and mine > 0):
        return h
    return max(1, min(h, math.floor(mine / fastest * h)))


def catch_up_steps(h: int, behind_s: float | None, step_s: float) -> int:
    """The steps left of a round in flight for a node that adopted the swarm's state `behind_s` seconds
    into it: H − ⌊behind/step⌋, at least 1, so it meets the round's group; H when a time is unknown."""
    if behind_s is None or not (behind_s > 0 and step_s > 0):
        return h
    return max(1, min(h, h - math.floor(behind_s / step_s)))
