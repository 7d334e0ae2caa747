"""How one round's averaging ended, as the outer step and the guard see it.

The round's `RoundOutcome` (committed, alone or failed, and what the all-reduce measured), and
the refusals of peers that the all-reduce's result names (`blame`).
"""

from __future__ import annotations

import json

import torch

from diloco_p2p.contract import RoundOutcome
from diloco_p2p.swarm.collective.allreduce_state import AllreduceResult
from diloco_p2p.swarm.trust.guard import Guard

# What the all-reduce says of a contribution it refused (`AllreduceResult.rejected`) -> the refusal.
MALFORMED = {"nan": "NaN or Inf in its contribution", "shape": "a contribution of another length",
             "compression": "a contribution in another wire format"}


def blame(guard: Guard, round: int, result: AllreduceResult, me: str | None = None) -> None:
    """Contributions refused (weight, norm, opposed, malformed) and reducers caught are refusals of
    peers (`Guard`); a caught reducer is left out of our next groups, and so is a malformed sender
    that our own part or most parts refused (one lying reducer cannot name anyone so), an opposed
    one named with the parts that left it out (`AllreduceResult.opposed`). Our own is no peer's fault."""
    for peer, reason in sorted(result.rejected.items()):
        if peer == me:
            continue
        if reason in ("weight", "norm"):
            guard.reject(peer, reason, f"its contribution to the all-reduce of round {round}")
        elif reason == "opposed" and peer not in result.opposed:
            guard.reject(peer, "opposed", f"round {round}: its contribution points against the others' "
                         "(in too few parts to keep it out)", keep_out=False)
        elif reason in MALFORMED:
            proven = peer in result.proven_malformed
            guard.reject(peer, "malformed", f"round {round}: {MALFORMED[reason]}"
                         + ("" if proven else " (said by one part's reducer only: not kept out)"), keep_out=proven)
    for peer, most in sorted(result.opposed.items()):
        if peer != me:
            guard.reject(peer, "opposed", f"round {round}: its contribution points against the others' "
                         f"(left out of {most})")
    for peer, why in sorted(result.reducers.items()):
        guard.reject(peer, "reducer", f"round {round}: {why}")


def round_outcome(delta: torch.Tensor, result: AllreduceResult | None, group_size: int, alone_policy: str,
                  agreement: dict[str, bool], *, interrupted: bool = False) -> RoundOutcome:
    """How a round of averaging ended, as the outer step sees it: ``committed`` with the group's
    average; else ``alone`` (``failed`` when interrupted or the all-reduce failed), applying our own
    finite Δ only under ``alone_policy: apply``."""
    if result is None or result.status == "failed":
        status = "failed" if interrupted or result is not None else "alone"
        own = delta if alone_policy == "apply" and bool(torch.isfinite(delta).all()) else None
        outcome = RoundOutcome(status=status, average=own, group_size=group_size, **agreement)
    else:
        outcome = RoundOutcome(status="committed", average=result.average, group_size=group_size, **agreement)
    if result is not None:
        outcome.allreduce_seconds = result.seconds
        outcome.bytes_sent, outcome.bytes_received = result.bytes_sent, result.bytes_received
        outcome.contributors, outcome.rejected = len(result.contributors), result.rejected
        outcome.parts_committed, outcome.parts = len(result.committed_parts), result.num_parts
        outcome.dropped_peers = group_size - len(result.contributors)
    return outcome


def kept(sent: torch.Tensor, weight: float, result: AllreduceResult) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What the tests keep of an all-reduce (``keep@average``, `Faults.keep`), to recompute the mean."""
    meta = {"weight": repr(weight), "contributors": json.dumps(result.contributors),
            "committed_parts": json.dumps(result.committed_parts), "num_parts": str(result.num_parts)}
    return {"delta": sent, "average": result.average}, meta
