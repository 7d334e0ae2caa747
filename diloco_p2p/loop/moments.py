"""``sync.average_moments``: the inner first moments, averaged with the round's group.

Each replica's momentum is built from its 1/M of the data, data-parallel's from all of it (MT-DAO).
After a committed round a second all-reduce (Δ's wire and checks) averages Muon's ``momentum_buffer``
and AdamW's ``exp_avg``; one that does not complete changes nothing, and θ never depends on it. On N
ranks each averages its shards'. Measured: docs/benchmarks.md.

AdamW's second moments stay local, raised to the averaged ``exp_avg²`` where below it: a coordinate
our data never touched (a token only another node saw) has ``exp_avg_sq`` ≈ 0 and would step by
``exp_avg / ε`` (a Δ norm of 10³ against 1, one run diverged); with the floor, about lr at most."""

from __future__ import annotations

import logging

import torch

from diloco_p2p.contract import RoundOutcome, Sync
from diloco_p2p.local.fsdp import is_dtensor
from diloco_p2p.loop.inner import InnerTrainer

log = logging.getLogger(__name__)

FIRST_MOMENTS = ("momentum_buffer", "exp_avg")  # Muon's, AdamW's
SECOND_MOMENT = "exp_avg_sq"  # AdamW's, beside its exp_avg


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def moment_pairs(trainer: InnerTrainer) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(first moment, its second or None) of each parameter (this rank's shards) in the model's order; [] before a step."""
    states = {id(p): s for o in trainer.optimizers.values() for p, s in o.state.items()}
    out = []
    for p in trainer.model.parameters():
        state = states.get(id(p), {})
        second = _local(state[SECOND_MOMENT]) if SECOND_MOMENT in state else None
        out += [(_local(state[k]), second) for k in FIRST_MOMENTS if k in state]
    return out


def first_moments(trainer: InnerTrainer) -> list[torch.Tensor]:
    """The trainer's first-moment buffers (this rank's shards) in the model's parameter order; [] before a step."""
    return [first for first, _ in moment_pairs(trainer)]


class MomentAveraging:
    """A node's moments, averaged after each committed round through its `Sync`."""

    def __init__(self, trainer: InnerTrainer, sync: Sync):
        self.trainer, self.sync = trainer, sync

    def after(self, round: int, weight: float, outcome: RoundOutcome) -> None:
        """After a committed round: average our moments with its group, write them back, note it in `outcome`."""
        if outcome.status != "committed":
            return
        pairs = moment_pairs(self.trainer)
        if not pairs:
            return
        flat = torch.cat([b.detach().reshape(-1).float() for b, _ in pairs])
        result = self.sync.average_moments(round, flat, weight)
        ok = result.status == "committed" and result.parts_committed == result.parts
        outcome.moments = "ok" if ok else "partial" if result.status == "committed" else "failed"
        outcome.bytes_sent += result.bytes_sent
        outcome.bytes_received += result.bytes_received
        outcome.allreduce_seconds += result.allreduce_seconds
        for peer, reasons in (result.rejections or {}).items():
            outcome.rejections = outcome.rejections or {}
            outcome.rejections[peer] = sorted(set(outcome.rejections.get(peer, [])) | set(reasons))
        if not ok:
            log.warning("round %d: the moments' all-reduce ended %s; keeping our own moments", round, outcome.moments)
            return
        average, offset = result.average, 0
        with torch.no_grad():
            for b, second in pairs:
                b.copy_(average[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
                if second is not None:  # the floor (module docstring)
                    torch.maximum(second, b * b, out=second)
