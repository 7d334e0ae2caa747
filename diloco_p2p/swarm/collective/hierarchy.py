"""A 2-D grid all-reduce: one exact weighted mean for a membership larger than one butterfly.

Every node at a round joins one membership, so the swarm keeps one θ whatever its size. Past
`sync.target_group_size` members the butterfly runs over the rows of a grid (`Grid`, a pure
function of the member count): each row's reducer hands its part to a column all-reduce across
the rows before gathering it, and two tiny all-reduces of a 0/1 mask agree on what committed.
The result is the weighted mean one butterfly would form, at the same bytes per node, with
O(√N) instead of O(N) messages, and the call returns within the butterfly's deadline.
The protocol: docs/protocol/hierarchy.md
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import PeerID

from diloco_p2p.config.compression import codec
from diloco_p2p.swarm.collective import wire
from diloco_p2p.swarm.collective.allreduce import AllreduceService
from diloco_p2p.swarm.collective.allreduce_state import GATHER_FRACTION, AllreduceResult

MAX_MEMBERS = 4096  # one round's membership: matchmaking closes a group at this many (`sync`)
ROW_FRACTION, AGREE_FRACTION, COLUMN_SHARE = 0.7, 0.15, 0.6


def rows_for(k: int, butterfly_max: int) -> int:
    """How many rows a membership of `k` gets: 1 (one butterfly) up to `butterfly_max` members."""
    if k <= max(butterfly_max, 1):
        return 1
    return max(1, min(math.ceil(k / max(butterfly_max, 1)), k // 2))


@dataclass(frozen=True)
class Grid:
    """Rows (member indices), intervals and columns of one membership; see the module docstring."""

    rows: list[list[int]]
    intervals: list[tuple[int, int]]
    n: int

    @classmethod
    def build(cls, k: int, n: int, butterfly_max: int) -> Grid:
        rows = [list(range(a, b)) for a, b in wire.partition(k, rows_for(k, butterfly_max))]
        cuts = sorted({x for size in {len(r) for r in rows} for bounds in wire.partition(n, size) for x in bounds})
        return cls(rows, [(a, b) for a, b in itertools.pairwise(cuts) if b > a], n)

    @property
    def aligned(self) -> bool:
        """Every row cuts the vector at the same places (equal rows)."""
        return len({len(r) for r in self.rows}) == 1

    def place(self, member: int) -> tuple[int, int]:
        """(row, index in the row) of a member."""
        for r, row in enumerate(self.rows):
            if member in row:
                return r, row.index(member)
        raise ValueError(f"member {member} is not in the grid")

    def part(self, r: int, i: int) -> tuple[int, int]:
        return wire.partition(self.n, len(self.rows[r]))[i]

    def owner(self, r: int, interval: tuple[int, int]) -> int:
        """Index in row r of the member whose part holds `interval`."""
        return next(i for i, (lo, hi) in enumerate(wire.partition(self.n, len(self.rows[r]))) if lo <= interval[0] < hi)

    def column(self, interval: tuple[int, int]) -> list[int]:
        return [row[self.owner(r, interval)] for r, row in enumerate(self.rows)]

    def mine(self, r: int, i: int) -> list[tuple[int, int]]:
        return [iv for iv in self.intervals if self.owner(r, iv) == i]

    def held(self, r: int, committed: list[int]) -> torch.Tensor:
        """0/1 per interval: whether row r committed the part it lies in."""
        return torch.tensor([float(self.owner(r, iv) in committed) for iv in self.intervals], dtype=torch.float32)


async def average(
    service: AllreduceService, group_id: str, peers: list[PeerID], tensor: torch.Tensor, weight: float, *,
    butterfly_max: int, compression: str = "fp16", public: list[bool] | None = None, timeout: float = 60.0,
    **kwargs: Any,
) -> AllreduceResult:
    """The round's all-reduce: one butterfly up to `butterfly_max` members, else the grid. Sparse
    wires and memberships with private members always run one butterfly (the grid lacks NAT support)."""
    nat = public is not None and not all(public)
    if codec(compression).sparse or nat or rows_for(len(peers), butterfly_max) == 1:
        return await service.allreduce(group_id, peers, tensor, weight, compression=compression, public=public,
                                       timeout=timeout, **kwargs)
    return await hierarchical_allreduce(service, group_id, peers, tensor, weight, butterfly_max=butterfly_max,
                                        compression=compression, timeout=timeout, **kwargs)


async def hierarchical_allreduce(
    service: AllreduceService, group_id: str, peers: list[PeerID], tensor: torch.Tensor, weight: float, *,
    butterfly_max: int, compression: str = "fp16", timeout: float = 60.0, **kwargs: Any,
) -> AllreduceResult:
    """Weighted average of `tensor` over `peers` on the grid (module docstring); the same result
    object as `AllreduceService.allreduce`, its parts being the grid's intervals."""
    started = time.perf_counter()
    names = [p.to_base58() for p in peers]
    me = names.index(service.p2p.peer_id.to_base58())
    grid = Grid.build(len(peers), tensor.numel(), butterfly_max)
    r, i = grid.place(me)
    loop = asyncio.get_running_loop()
    t0, row_timeout = loop.time(), ROW_FRACTION * timeout
    columns: list[AllreduceResult] = []
    level = {k: v for k, v in kwargs.items() if k not in ("on_phase", "on_scattered")}

    async def next_level(values: torch.Tensor, total: float) -> tuple[torch.Tensor, str] | None:
        lo = grid.part(r, i)[0]
        budget = max(COLUMN_SHARE * (t0 + GATHER_FRACTION * row_timeout - loop.time()), 0.05)
        mine = grid.mine(r, i)
        results = await asyncio.gather(*(
            service.allreduce(f"{group_id}.col{a}", [peers[m] for m in grid.column((a, b))],
                              values[a - lo : b - lo].contiguous(), total, compression=compression,
                              timeout=budget, **level)
            for a, b in mine
        ))
        columns.extend(results)
        if any(res.status == "failed" for res in results):
            return None
        out = torch.cat([res.average for res in results]) if results else values
        exact = codec(compression).exact_reencode or grid.aligned
        return out, compression if exact else "fp32"

    row = await service.allreduce(f"{group_id}.row{r}", [peers[m] for m in grid.rows[r]], tensor, weight,
                                  compression=compression, timeout=row_timeout, part_hook=next_level, **kwargs)
    abstain = row.status == "failed"
    held = torch.ones(len(grid.intervals)) if abstain else grid.held(r, row.committed_parts)
    entered = torch.tensor([float(name in row.contributors and not abstain) for name in names])
    across = [row_[i] for row_ in grid.rows if len(row_) > i]
    votes = torch.cat([held, entered])
    m = len(grid.intervals)
    votes, first = await _agree(service, f"{group_id}.and{i}", [peers[x] for x in across], votes, m, timeout)
    votes, second = await _agree(service, f"{group_id}.androw{r}", [peers[x] for x in grid.rows[r]], votes, m, timeout)
    return _result(grid, row, columns + first + second, votes, abstain, names, time.perf_counter() - started)


async def _agree(service: AllreduceService, group_id: str, peers: list[PeerID], votes: torch.Tensor, m: int,
                 timeout: float) -> tuple[torch.Tensor, list[AllreduceResult]]:
    """One agreement step: the interval mask (first part of `votes`) ANDed, contributor bits ORed.
    Every part carries a whole copy of the mask (`_spread`), so one member gone cannot drop it for
    its step alone and fork θ. We abstain if we heard nobody."""
    if len(peers) == 1:
        return votes, []
    spread, copies, rest = _spread(votes, m, len(peers))
    res = await service.allreduce(group_id, peers, spread, 1.0, compression="fp32", timeout=AGREE_FRACTION * timeout)
    if res.status == "failed":
        return votes, [res]
    mean = res.average  # of 0/1 values with weight 1 each, in fp32: exactly 1.0 iff all heard hold it
    held = votes[:m] == 1.0
    for p in res.committed_parts:  # the same parts and bits on every member that agreed in this step
        held &= mean[copies[p] : copies[p] + m] == 1.0
    entered = (mean[rest] > 0) | (votes[m:] > 0)  # a lost contributor bit counts as 0
    return torch.cat([held, entered]).float(), [res]


def _spread(votes: torch.Tensor, m: int, k: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """`votes` laid out for a k-member step: each part starts with a copy of the m mask values, the
    contributor bits fill the rest. Returns the vector, each copy's start and the bits' positions."""
    bounds = wire.partition(k * m + votes.numel() - m, k)  # every part holds at least m values
    copies = [lo for lo, _ in bounds]
    rest = torch.tensor([x for lo, hi in bounds for x in range(lo + m, hi)], dtype=torch.long)
    spread = torch.empty(bounds[-1][1], dtype=torch.float32)
    for lo in copies:
        spread[lo : lo + m] = votes[:m]
    spread[rest] = votes[m:]
    return spread, copies, rest


def _result(grid: Grid, row: AllreduceResult, levels: list[AllreduceResult], votes: torch.Tensor,
            abstain: bool, names: list[str], seconds: float) -> AllreduceResult:
    """The swarm's average as this member holds it: the row's result with every interval that
    the agreement dropped set to zero; contributors as the rows reported them; bytes of every level."""
    m = len(grid.intervals)
    committed = [] if abstain else [j for j, held in enumerate(votes[:m].tolist()) if held == 1.0]
    average = row.average if committed else torch.zeros_like(row.average)
    for j, (a, b) in enumerate(grid.intervals):
        if j not in committed:
            average[a:b] = 0.0
    status = "failed" if not committed else "ok" if len(committed) == m else "partial"
    contributors = [name for name, bit in zip(names, votes[m:].tolist(), strict=True) if bit] if committed else []
    levels = [row, *levels]
    return AllreduceResult(
        average=average, status=status, committed_parts=committed, num_parts=m,
        contributors=sorted(contributors), rejected=row.rejected, opposed=row.opposed,
        bytes_sent=sum(x.bytes_sent for x in levels), bytes_received=sum(x.bytes_received for x in levels),
        seconds=seconds, part_contributors={}, agreed_with=row.agreed_with,
        phases=dict(row.phases, agreed=seconds),
    )
