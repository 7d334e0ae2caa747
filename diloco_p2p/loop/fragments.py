"""``sync.fragments``: which values of the flat parameters a round averages.

Streaming DiLoCo's fragments (Douillard et al. 2025, arXiv:2501.18512): the 1-rank flat layout
(`diloco_p2p.loop.outer.flatten`) is cut into P contiguous parts whose sizes differ by at most
one (`wire.partition`), and round r averages part (r − 1) mod P: its all-reduce carries 1/P of
the bytes, and each part syncs every P rounds. A contiguous range is a run of consecutive layers,
cut mid-layer at its ends, which keeps every round's bytes equal. On N local ranks each rank's
values of a part are a contiguous range of its own flat layout (`ShardLayout.local_range`); what
outlives the rank layout (a checkpoint's part in flight) is kept in the 1-rank layout (`to_full`,
`to_local`), so a checkpoint resumes at any number of local ranks.
"""

from __future__ import annotations

import torch

from diloco_p2p.errors import UserError
from diloco_p2p.local.fsdp import ShardLayout
from diloco_p2p.loop.outer import Part
from diloco_p2p.swarm.collective.wire import partition


class Fragments:
    """The parts of P (P = 1: every round averages everything, and every part is None)."""

    def __init__(self, count: int, layout: ShardLayout, local_numel: int):
        self.count, self.layout, self.local_numel = count, layout, local_numel
        self.full_numel = sum(layout.full_numels)
        # each part in the 1-rank layout and in this rank's own (the same on one rank), once
        self.full_parts = partition(self.full_numel, count) if self.on else []
        self.parts = [layout.local_range(*full) for full in self.full_parts]
        empty = [f for f, (lo, hi) in enumerate(self.parts) if hi <= lo]
        if empty:  # a round with nothing to average on this rank
            raise UserError(f"sync.fragments={count} leaves this rank no value of part {empty[0]} "
                            f"({local_numel:,} values held); set fewer fragments")

    @property
    def on(self) -> bool:
        return self.count > 1

    def index(self, round: int) -> int | None:
        """Which part round `round` averages (0-based; None: all)."""
        return (round - 1) % self.count if self.on else None

    def full_part(self, round: int) -> Part | None:
        """The values [lo, hi) of the 1-rank flat layout that round `round` averages."""
        return self.full_parts[(round - 1) % self.count] if self.on else None

    def part(self, round: int) -> Part | None:
        """`full_part` in this rank's own flat layout."""
        return self.parts[(round - 1) % self.count] if self.on else None

    def numel(self, round: int) -> int:
        """How many values this rank averages in round `round`."""
        part = self.part(round)
        return self.local_numel if part is None else part[1] - part[0]

    def _ranges(self, round: int) -> tuple[Part, Part]:
        """Round `round`'s part in this rank's flat layout and in the 1-rank one (fragments on)."""
        index = (round - 1) % self.count
        return self.parts[index], self.full_parts[index]

    def to_full(self, values: torch.Tensor, round: int) -> torch.Tensor | None:
        """This rank's values of round `round`'s part → the part in the 1-rank layout (a collective
        on N ranks, whose result only rank 0 gets)."""
        (lo, hi), (full_lo, full_hi) = self._ranges(round)
        placed = torch.zeros(self.local_numel)
        placed[lo:hi] = values
        full = self.layout.to_full(placed)
        return None if full is None else full[full_lo:full_hi].clone()

    def to_local(self, values: torch.Tensor, round: int, source: str) -> torch.Tensor:
        """Inverse of `to_full`: round `round`'s part in the 1-rank layout → this rank's values;
        `source` names where it came from in the error for a part of the wrong size."""
        (lo, hi), (full_lo, full_hi) = self._ranges(round)
        if values.numel() != full_hi - full_lo:
            raise UserError(f"{source}: the round in flight has {values.numel()} values, its part of the model "
                            f"{full_hi - full_lo}; resume with the config that wrote it (sync.fragments)")
        placed = torch.zeros(self.full_numel)
        placed[full_lo:full_hi] = values.to(torch.float32)
        return self.layout.to_local(placed)[lo:hi].clone()
