"""One exact weighted mean for a round membership larger than one butterfly: a 2-D grid all-reduce.

Every node at round r joins one membership (`sync`: matchmaking closes one group per round), so
the swarm keeps one θ whatever its size. Up to `butterfly_max` members (`sync.target_group_size`)
average with one butterfly (`diloco_p2p.swarm.collective.allreduce`): each member sends 3(N-1) messages a
round, which stops scaling long before the bytes do. Larger memberships run the butterfly over
sub-groups of a grid, the exact (no gossip, no approximation) counterpart of Moshpit SGD's grid
averaging (Ryabinin et al. 2021, arXiv:2103.03239) and of the 2-D torus all-reduce (Mikami et al.
2018, arXiv:1811.05233): reduce-scatter within rows, all-reduce of each shard across columns,
all-gather back within rows.

The grid (`Grid`, a pure function of N, n and `butterfly_max`, the same on every member): the
ordered members are cut into r = ceil(N / butterfly_max) contiguous rows whose sizes differ by at
most one (r <= N/2: rows of at least two). Row R partitions the vector into |R| parts as the
butterfly does (`wire.partition`); the *intervals* are the refinement of every row's partition
(equal rows: the parts themselves; rows of c and c-1 members: at most 2c-1 intervals), so each
interval lies inside exactly one part of every row. Its *column* is the owner of that part in
each row, in row order.

One all-reduce (`hierarchical_allreduce`):

1. Rows: each row runs the butterfly (`AllreduceService.allreduce`) with a `part_hook`: the
   reducer of part j reduces it whole over its row's complete contributions (weighted mean,
   total weight W = the accepted weights), then, for each interval of its part, runs a column
   all-reduce of that slice with weight W among the interval's column (one member per row,
   concurrently for its intervals). So the column average is sum_R W_R mean_R / sum_R W_R: the
   weighted mean over every contribution that entered, exactly as one butterfly would form it
   (with one more rounding of the row means in the wire format).
2. The reducer gathers the column results in its row, in the wire format when re-encoding them
   is exact (fp32, fp16, or int8 when all rows are equal, so every row cuts the same blocks),
   else in fp32 (int8 with unequal rows: blocks would start at different offsets in different
   rows, and the re-quantized values would differ between rows).
3. Agreement: an interval is held if our row committed the part it lies in. Two tiny fp32
   all-reduces of the 0/1 interval mask (weight 1 each) AND it across the swarm: first among the
   members with our index in every row, then within our row (a mean of exactly 1.0 = every mask
   heard holds it). An interval lost at any level - a dead reducer in some row, a column that
   failed, a gather that did not arrive - is zero on every member alike; a member whose row
   failed abstains (all ones) and itself returns "failed". The same two calls OR one bit per
   member, set by its own row if its contribution entered that row's committed parts: every
   member learns the swarm's contributors. Each part of a step's vector carries a whole copy of
   the mask: a member gone since its row's scatter still sits in both steps (the grid is fixed)
   and its part of each step is lost, which must not drop the mask itself - a loss in the row
   step reaches no other row, so that row alone would drop every interval and fork θ. As in
   the butterfly, a member that dies *during* an agreement step can leave members disagreeing;
   the round's params hash shows it.

Membership (`matchmaking`, with `MAX_MEMBERS` as its target: one group per round). Per node and
round: one DHT store to register, one read of the round's key (one key, a subkey per registered
node: O(N) bytes), one store to withdraw; only the leader re-reads, every request_timeout / 2
while its group is open. So DHT calls per node do not grow with N (`tests/unit/
test_membership_scale.py` counts them up to 64 nodes, `benchmarks/wire/scale.py` to 256). The leader
holds one stream per member and sends each the member list: O(N) messages and O(N^2) bytes at the
leader (~190 bytes per member per member: 190 MB a round at 1,000 nodes). A node arriving after
the group closed is "late" (it catches up by downloading the state), never a second group.

Deadlines: the row all-reduce gets 0.7 T; column calls run between the row's scatter and gather
deadlines (60% of the time left to the gather deadline); each agreement step gets 0.15 T. So the
whole call returns within T, like the butterfly.

Cost per member and round, n elements of b bytes, N = r rows x c columns (equal rows), against
the all-reduce lower bound 2(N-1)/N * n * b bytes (each member must send everything it does not
reduce and receive everything it does not hold) and N-1 messages:

    scheme        bytes sent / (n b)                 messages (streams)
    butterfly     2(N-1)/N  (the bound)              3(N-1): scatter, gather, mask to each other member
    grid          2(c-1)/c + 2(r-1)/(rc)             3(c-1) row + 3(r-1) column + 3(r-1) + 3(c-1)
                  = 2(N-1)/N  (the bound)            agreement = 6(r+c-2); r = c = sqrt(N): 12(sqrt N - 1)

plus a ~200-byte header per message and 8 bytes per chunk frame; the agreement's vectors are
k m + N fp32 values for a step of k members and m intervals (about 8 ((r + c) m + 2N) bytes sent;
m = c on equal rows: 33 KB at N = 1,024). With unequal rows a member may
own 2 intervals (2 column calls: 3(r-1) more messages, the same bytes), and int8 then gathers in
fp32: (c-1)/c n (4 - b) more bytes. At N = 1,024, butterfly_max 32: 3,069 messages per member
for the butterfly, 372 for the grid; the bytes are the same. Time: the row gather starts only
after the column all-reduce (no pipelining across levels), so on a link-bound round the grid
takes about one extra n/c-sized transfer and a few more round trips than the butterfly's
wire time. Measured on 50 Mbit/s tbf links, 2M fp16 values (`benchmarks/wire/allreduce_wan.py --grid 3`):
4 members 1.44 s butterfly, 1.72 s grid 2x2; 6 members 1.89 s butterfly, 2.12 s grid 2x3, the
same bytes (1.0003x the bound); loopback numbers in `benchmarks/wire/scale.py`.
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

from diloco_p2p.swarm.collective import wire
from diloco_p2p.swarm.collective.allreduce import AllreduceService
from diloco_p2p.swarm.collective.allreduce_state import GATHER_FRACTION, AllreduceResult

MAX_MEMBERS = 4096  # one round's membership: matchmaking closes a group at this many (`sync`)
ROW_FRACTION, AGREE_FRACTION, COLUMN_SHARE = 0.7, 0.15, 0.6
_EXACT_REENCODE = ("fp32", "fp16")  # decode(encode(x)) == x for every x decoded from this format


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
    butterfly_max: int, timeout: float = 60.0, **kwargs: Any,
) -> AllreduceResult:
    """The round's all-reduce: one butterfly up to `butterfly_max` members, else the grid. Sparse
    compressions (an all-gather, not a reduce) always run as one butterfly call, and so does a
    membership with members behind NAT (``public``, `diloco_p2p.swarm.transport.reach`): the grid's rows
    would each need a public reducer per part, which it does not arrange yet."""
    sparse = kwargs.get("compression") in getattr(wire, "SPARSE", ())
    nat = kwargs.get("public") is not None and not all(kwargs["public"])
    if sparse or nat or rows_for(len(peers), butterfly_max) == 1:
        return await service.allreduce(group_id, peers, tensor, weight, timeout=timeout, **kwargs)
    return await hierarchical_allreduce(service, group_id, peers, tensor, weight, butterfly_max=butterfly_max,
                                        timeout=timeout, **kwargs)


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
        exact = compression in _EXACT_REENCODE or grid.aligned
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
    """One agreement step over `peers`: the interval mask (the first part of `votes`) ANDed, the
    contributor bits (one per member, the rest) ORed. Every part of the step's vector carries a
    whole copy of the mask (`_spread`), so a member gone since its row's scatter, which reduces
    no part of this step, takes only its share of the contributor bits with it: were the mask in
    one part only, losing that part would drop every interval for this step's members alone (an
    element lost here cannot reach the other rows), and their θ would fork from the other rows'.
    Our own votes when we heard nobody (we abstain rather than veto)."""
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
    """`votes` laid out for a k-member step: each of the k parts (`wire.partition`) starts with a
    copy of the m mask values, the contributor bits fill the rest in order. Returns the vector,
    where each copy starts, and the contributor bits' positions. A pure function of the sizes:
    every member of the step lays it out alike."""
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
        contributors=sorted(contributors), rejected=row.rejected,
        bytes_sent=sum(x.bytes_sent for x in levels), bytes_received=sum(x.bytes_received for x in levels),
        seconds=seconds, part_contributors={}, agreed_with=row.agreed_with,
        phases=dict(row.phases, agreed=seconds),
    )
