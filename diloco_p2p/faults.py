"""The points of a round where a test may inject faults; the product injects none.

The node calls a `Faults` at named points: ``delta``, ``group``, ``allreduce``, ``rankR.step``,
the first round's start (`start_gate`), the all-reduce class (`reducer`, `arm_reducer`) and the
end of a round (`keep`). Here every method does nothing or returns its input. The fault tests
start a node as ``python -m tests.faults.node train ARGS``, which installs its own `Faults`
(kills, stalls, lying contributions and reducers, a start barrier) before the command runs. No
environment variable or option of the product plans a fault.
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

    def lie(self, round_: int, delta: torch.Tensor, weight: float, max_weight_ratio: float,
            point: str = "delta") -> tuple[torch.Tensor, float]:
        """The contribution this node sends at `point` (``delta``, ``moments``): its own with its own `weight`."""
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
