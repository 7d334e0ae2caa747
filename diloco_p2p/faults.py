"""The points of a round where a test may inject faults; the product injects none.

The node calls a `Faults` at named points: ``delta`` (the round's pseudo-gradient is computed,
before matchmaking), ``group`` (a group formed), ``allreduce`` (our parts are sent), and in a
multi-rank node ``rankR.step`` (local rank R is about to take an inner step), plus the start of
the first round (`start_gate`), the choice of the all-reduce class (`reducer`, `arm_reducer`) and
the end of a round (`keep`). Here every method does nothing or returns its input.

The fault tests start a node as ``python -m tests.faults.node train ARGS`` (`tests/faults/`): that
entry `install`s its own `Faults` (kills, stalls, NaN and lying contributions, a lying reducer, a
start barrier, kept averages) before the command runs, and the train command builds the node's
with `make_faults`. No environment variable or option of the product plans a fault.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class Faults:
    """Behaviour-free hook points (see the module docstring); a test entry installs a subclass."""

    def start_gate(self) -> None:
        """The node has joined the swarm and is about to start its first round."""

    def fire(self, point: str, round_: int) -> None:
        """The round reached `point` (a process-level fault may be delivered here)."""

    def poison(self, point: str, round_: int, tensor: torch.Tensor) -> torch.Tensor:
        """The pseudo-gradient the round averages: `tensor`."""
        return tensor

    def lie(self, round_: int, delta: torch.Tensor, weight: float, max_weight_ratio: float) -> tuple[torch.Tensor, float]:
        """The contribution this node sends: its own `delta` with its own `weight`."""
        return delta, weight

    def reducer(self, honest: type) -> type:
        """The all-reduce class the node reduces with: `honest`."""
        return honest

    def arm_reducer(self, service: Any, round_: int) -> None:
        """Before a round's averaging, with the node's all-reduce service."""

    def keep(self, directory: Path, round_: int, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """A round's Δ and the average it applied, once the round is over."""


_factory: Callable[[], Faults] = Faults


def install(factory: Callable[[], Faults]) -> None:
    """Make `make_faults` build with `factory`: for a test entry, before the command runs."""
    global _factory
    _factory = factory


def make_faults() -> Faults:
    """The `Faults` of this process's node: the installed kind, by default the one that does nothing."""
    return _factory()
