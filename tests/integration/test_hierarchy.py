"""The grid all-reduce (`diloco_p2p.swarm.collective.hierarchy`) on real p2pd daemons: six `AllreduceService`s
on loopback, run concurrently in this process.

Checks: every member ends with bit-identical averages on equal rows (2 x 3) and unequal rows
(3 + 2, where int8 and int4 gather in fp32 so every row holds the same values); the average equals the
weighted mean computed here within two roundings of the wire format; the bytes each member sends
stay at the lower bound 2(N-1)/N * n * b (equal rows); a member that is gone takes its part out of
the average on every member alike and nothing else.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from diloco_p2p.swarm.collective import hierarchy, wire
from diloco_p2p.swarm.collective.hierarchy import Grid
from tests.harness.loopback import AllreducePeers

pytestmark = pytest.mark.timeout(120)

N = 6 * 5_000 + 4  # parts of unequal size, several chunks each
CHUNK = 2048
WEIGHTS = [1000.0, 3000.0, 2000.0, 500.0, 1500.0, 2500.0]
TIMEOUT = 20.0


@pytest.fixture(scope="module")
def swarm():
    with AllreducePeers(6, prefix="htest", chunk_elements=CHUNK) as peers:
        yield peers


def inputs(seed: int, k: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(N, generator=g) * (i + 1) for i in range(k)]  # scales per member, an outlier
    xs[1][123] = 40.0
    return xs


def run(peers: AllreducePeers, services, members, xs, weights, butterfly_max, **kwargs):
    group_id = f"h-{uuid.uuid4().hex}"
    ids = [peers.peers[m] for m in members]

    async def all_members():
        return await asyncio.gather(*(
            hierarchy.average(svc, group_id, ids, x, w, butterfly_max=butterfly_max, timeout=TIMEOUT, **kwargs)
            for svc, x, w in zip(services, xs, weights, strict=True)
        ))

    return peers.loop.run(all_members(), 90)


def bound(xs, weights, exact, compression):
    """Two roundings (row mean, then the column mean) of the inputs' weighted magnitudes."""
    total = sum(weights)
    if compression == "fp16":
        weighted_abs = sum(w * x.double().abs() for w, x in zip(weights, xs, strict=True)) / total
        return 2.0**-11 * (3 * weighted_abs + exact.abs()) * 1.01 + 1e-6
    weighted_max = sum(w * x.abs().max().item() for w, x in zip(weights, xs, strict=True)) / total
    steps = 254 if compression == "int8" else 14  # absmax / (2 * levels) per rounding; a few roundings
    return torch.full_like(exact, 5 * weighted_max / steps + 1e-6)


def test_grid_rows_intervals_and_columns():
    assert hierarchy.rows_for(16, 16) == 1 and hierarchy.rows_for(17, 16) == 2 and hierarchy.rows_for(3, 2) == 1
    assert hierarchy.rows_for(1024, 32) == 32
    equal = Grid.build(6, 12, 3)
    assert equal.rows == [[0, 1, 2], [3, 4, 5]] and equal.aligned
    assert equal.intervals == [(0, 4), (4, 8), (8, 12)] and equal.column((4, 8)) == [1, 4]
    unequal = Grid.build(5, 12, 3)
    assert unequal.rows == [[0, 1, 2], [3, 4]] and not unequal.aligned
    assert unequal.intervals == [(0, 4), (4, 6), (6, 8), (8, 12)]  # cuts of 3 parts and of 2 parts
    assert [unequal.column(iv) for iv in unequal.intervals] == [[0, 3], [1, 3], [1, 4], [2, 4]]
    assert unequal.mine(1, 0) == [(0, 4), (4, 6)] and unequal.mine(0, 1) == [(4, 6), (6, 8)]
    assert unequal.held(1, [1]).tolist() == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize(("members", "compression"), [
    (range(6), "fp16"), (range(6), "int8"), (range(5), "int8"), (range(5), "fp16"), (range(6), "int4"),
    (range(5), "int4"),
])
def test_members_agree_bit_for_bit_on_the_weighted_mean(swarm, members, compression):
    members = list(members)
    xs, weights = inputs(seed=len(members))[: len(members)], WEIGHTS[: len(members)]
    services = [swarm.services[m] for m in members]
    results = run(swarm, services, members, xs, weights, butterfly_max=3, compression=compression)
    grid = Grid.build(len(members), N, 3)
    assert len(grid.rows) == 2
    for r in results:
        assert r.status == "ok" and r.committed_parts == list(range(len(grid.intervals)))
        assert r.contributors == sorted(swarm.names[m] for m in members) and r.rejected == {}
        assert torch.equal(r.average, results[0].average)  # bit-identical across rows, not merely close
    exact = sum(w * x.double() for w, x in zip(weights, xs, strict=True)) / sum(weights)
    error = (results[0].average.double() - exact).abs()
    assert bool((error <= bound(xs, weights, exact, compression)).all()), f"max error {error.max():.3g}"
    assert error.max() > 0  # the wire really was lossy
    if grid.aligned:  # the bytes of a butterfly over all six: the lower bound, plus headers
        lower = 2 * (len(members) - 1) / len(members) * wire.encoded_size(N, compression)  # int4: scales too
        # + headers: ~250 bytes for each of the 18 messages, and the agreement's vectors (~8 ((r + c) m + 2N) bytes)
        assert all(lower <= r.bytes_sent <= 1.01 * lower + 6000 for r in results), [r.bytes_sent - lower for r in results]


def test_small_membership_is_one_butterfly(swarm):
    members = [0, 1, 2]
    xs = inputs(seed=7)[:3]
    results = run(swarm, swarm.services[:3], members, xs, WEIGHTS[:3], butterfly_max=3, compression="fp16")
    assert all(r.num_parts == 3 and r.status == "ok" for r in results)  # one part per member: no grid


@pytest.mark.parametrize("gone", [4, 3])
def test_a_gone_member_drops_its_part_on_every_member_alike(swarm, gone):
    """Member `gone` (row 1, index 1 or 0) has no all-reduce service: it is gone from the first
    message. Its part of row 1 has no reducer, so those intervals are zero everywhere; the rest is
    the weighted mean of the five others, and every member holds the same bits. Index 0 also
    reduces part 0 of its row's agreement step, where the interval mask would sit whole were it
    not copied into every part: row 1 would drop every interval while row 0 committed."""
    live = [m for m in range(6) if m != gone]
    services = [swarm.service(swarm.p2ps[m], "hdrop") for m in live]
    try:
        xs = inputs(seed=11)
        group_id = f"drop-{uuid.uuid4().hex}"

        async def all_members():
            return await asyncio.gather(*(
                hierarchy.average(svc, group_id, swarm.peers, xs[m], WEIGHTS[m], butterfly_max=3,
                                  timeout=TIMEOUT, compression="fp16")
                for svc, m in zip(services, live, strict=True)
            ))

        results = swarm.loop.run(all_members(), 90)
    finally:
        for svc in services:
            swarm.loop.run(svc.stop(), 30)
    grid = Grid.build(6, N, 3)
    lost = [j for j, iv in enumerate(grid.intervals) if grid.owner(1, iv) == gone - 3]
    for r in results:
        assert r.status == "partial" and r.committed_parts == [j for j in range(3) if j not in lost]
        assert torch.equal(r.average, results[0].average)
        assert swarm.names[gone] not in r.rejected or r.rejected[swarm.names[gone]] == "timeout"
        assert r.contributors == sorted(swarm.names[m] for m in live)  # the other row's too, via the agreement
    weights = [WEIGHTS[m] for m in live]
    exact = sum(w * xs[m].double() for w, m in zip(weights, live, strict=True)) / sum(weights)
    error = (results[0].average.double() - exact).abs()
    ok = bound([xs[m] for m in live], weights, exact, "fp16")
    for j, (a, b) in enumerate(grid.intervals):
        if j in lost:
            assert bool((results[0].average[a:b] == 0).all())
        else:
            assert bool((error[a:b] <= ok[a:b]).all()), f"interval {j}: max error {error[a:b].max():.3g}"


def test_a_capped_weight_counts_capped_at_every_level(swarm):
    """With `weight_cap` (sync's default 4): member 5 claims 10x the others. Its row caps it at 4x
    the row's lower median before reducing, and the row's part enters the column with the weights
    it was reduced with, so the swarm's mean is the mean with that capped weight."""
    from diloco_p2p.swarm.collective.aggregate import Robust

    xs, weights = inputs(seed=13), [1000.0] * 5 + [10_000.0]
    results = run(swarm, swarm.services, list(range(6)), xs, weights, butterfly_max=3, compression="fp16",
                  robust=Robust(weight_cap=4.0))
    assert all(r.status == "ok" and torch.equal(r.average, results[0].average) for r in results)
    capped = [1000.0] * 5 + [4000.0]
    exact = sum(w * x.double() for w, x in zip(capped, xs, strict=True)) / sum(capped)
    error = (results[0].average.double() - exact).abs()
    assert bool((error <= bound(xs, capped, exact, "fp16")).all()), f"max error {error.max():.3g}"
