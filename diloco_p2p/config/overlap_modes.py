"""The overlap modes of `sync.overlap`, declared once with what each hides the all-reduce behind.

The config's choices and checks, the planner's pricing (`diloco_p2p.planner.plan`) and the loop
(`diloco_p2p.loop.overlap`) read `MODES`, so a mode added here is offered, checked and priced
alike. What each mode does to θ is `diloco_p2p.loop.overlap`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class OverlapMode:
    """One value of `sync.overlap`.

    hides: the compute that round t's all-reduce runs behind: ``nothing`` (the round blocks on
    it), ``round`` (all of round t+1's inner steps; it is applied at that round's end) or
    ``steps`` (round t+1's first τ = `sync.overlap_steps` inner steps; it lands inside the round).
    fragments: whether it runs with `sync.fragments` > 1 (each part's step lands where it would
    alone). correction: whether the node trains from θ plus a local correction of its own (the
    Eager Updates paper's)."""

    name: str
    hides: Literal["nothing", "round", "steps"]
    fragments: bool
    correction: bool = False

    @property
    def blocking(self) -> bool:
        """The round waits for its own average: rounds start from θ, the outer schedules apply."""
        return self.hides == "nothing"


MODES: dict[str, OverlapMode] = {m.name: m for m in (
    OverlapMode("none", hides="nothing", fragments=True),
    OverlapMode("delayed", hides="round", fragments=False),
    OverlapMode("eager", hides="round", fragments=False, correction=True),
    OverlapMode("inner", hides="steps", fragments=True),
)}
NAMES = tuple(MODES)


def mode(name: str) -> OverlapMode:
    """The overlap mode called `name`; ValueError naming the choices otherwise."""
    if name not in MODES:
        raise ValueError(f"unknown overlap {name!r}; expected one of {', '.join(NAMES)}")
    return MODES[name]
