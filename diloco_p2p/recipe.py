"""outer.recipe=auto: the outer step and H's schedule for a number of nodes and a horizon.

PROVISIONAL: filled from benchmarks/quality.py's table.
"""

from __future__ import annotations

from typing import Any


def recipe(nodes: int, max_rounds: int, inner_steps: int) -> dict[str, Any]:
    """The outer fields (`OuterConfig`) for M = `nodes` planned over `max_rounds` rounds of H = `inner_steps`."""
    return {"h_schedule": "ramp", "h_start": 1, "lr": 1.0, "momentum": 0.0}
