"""The grid of the hierarchical all-reduce (`diloco_p2p.swarm.collective.hierarchy.Grid`) is a pure function of
(members, values, butterfly_max): checked here for every small shape, so every member cuts the same
rows, intervals and columns and every value is reduced by exactly one column."""

from __future__ import annotations

import itertools

from diloco_p2p.swarm.collective import wire
from diloco_p2p.swarm.collective.hierarchy import Grid, rows_for


def test_every_small_grid_covers_each_value_once_and_aligns_with_every_row():
    for k, n, bmax in itertools.product(range(2, 23), (0, 1, 5, 37, 1000), range(1, 8)):
        grid = Grid.build(k, n, bmax)
        rows = grid.rows
        assert [m for row in rows for m in row] == list(range(k)) and len(rows) == rows_for(k, bmax)
        assert max(map(len, rows)) - min(map(len, rows)) <= 1 and (len(rows) == 1 or min(map(len, rows)) >= 2)
        assert [x for iv in grid.intervals for x in range(*iv)] == list(range(n))  # contiguous, in order
        for r, row in enumerate(rows):
            parts = wire.partition(n, len(row))
            owned = [iv for i in range(len(row)) for iv in grid.mine(r, i)]
            assert sorted(owned) == grid.intervals  # each interval owned once per row
            for i in range(len(row)):
                lo, hi = parts[i]
                assert all(lo <= a < b <= hi for a, b in grid.mine(r, i))
        for iv in grid.intervals:
            column = grid.column(iv)
            assert len(column) == len(rows) and [grid.place(m)[0] for m in column] == list(range(len(rows)))


def test_one_butterfly_up_to_butterfly_max_then_rows_of_about_that_size():
    assert [rows_for(k, 16) for k in (2, 16, 17, 32, 33, 1000)] == [1, 1, 2, 2, 3, 63]
    assert rows_for(3, 2) == 1  # a row of one would not be a butterfly: rows of at least two


def test_every_part_of_an_agreement_step_carries_the_whole_interval_mask():
    """`hierarchy._spread`: a dead reducer of one part of an agreement step loses only its share of
    the contributor bits, never the mask (each part starts with a copy of it)."""
    import torch

    from diloco_p2p.swarm.collective.hierarchy import _spread

    for m, members, k in itertools.product((1, 3, 7), (2, 6, 23), range(2, 9)):
        votes = torch.tensor([float(x % 2) for x in range(m)] + [float(x % 3 == 0) for x in range(members)])
        spread, copies, rest = _spread(votes, m, k)
        bounds = wire.partition(spread.numel(), k)
        assert copies == [lo for lo, _ in bounds] and all(hi - lo >= m for lo, hi in bounds)
        for lo in copies:
            assert torch.equal(spread[lo : lo + m], votes[:m])
        assert torch.equal(spread[rest], votes[m:])
        assert sorted(rest.tolist() + [lo + x for lo in copies for x in range(m)]) == list(range(spread.numel()))
