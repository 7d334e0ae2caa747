"""How one round's averaging ended, as the outer step and the guard see it: the round's
`RoundOutcome` (committed, alone or failed, and what the all-reduce measured), and the refusals of
peers that the all-reduce's result names (`blame`)."""

from __future__ import annotations

import torch

from diloco_p2p.contract import RoundOutcome
from diloco_p2p.swarm.collective.allreduce_state import AllreduceResult
from diloco_p2p.swarm.trust.guard import Guard


def blame(guard: Guard, round: int, result: AllreduceResult) -> None:
    """Contributions refused for their weight or norm, and reducers the members caught, are
    refusals of peers (`Guard`: logged, counted, in the round record); a caught reducer is then
    left out of our next groups (`Guard.distrusted`)."""
    for peer, reason in sorted(result.rejected.items()):
        if reason in ("weight", "norm"):
            guard.reject(peer, reason, f"its contribution to the all-reduce of round {round}")
    for peer, why in sorted(result.reducers.items()):
        guard.reject(peer, "reducer", f"round {round}: {why}")


def round_outcome(delta: torch.Tensor, result: AllreduceResult | None, group_size: int, alone_policy: str,
                  agreement: dict[str, bool], *, interrupted: bool = False) -> RoundOutcome:
    """How a round of averaging ended, as the outer step sees it.

    No group (`result` None): ``alone``, or ``failed`` when the wait was interrupted; a failed
    all-reduce: ``failed``. In those cases our own Δ is applied only under ``alone_policy:
    apply`` and only if it is finite (M=1 DiLoCo for that round). Otherwise ``committed`` with
    the group's average, identical on every member.
    """
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
