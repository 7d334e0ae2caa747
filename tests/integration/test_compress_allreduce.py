"""The lossy wires on real p2pd daemons (three `AllreduceService`s on loopback, one module swarm):
``int4`` through the butterfly and ``topk2`` through the sparse all-gather (`swarm.collective.allgather`).

Checks: bit-identical averages on every member; int4 within its per-element bound of the exact
mean; topk2 equal to the token-weighted mean of the contributions as decoded here in float64
(within fp32 rounding); topk2 bytes = (k-1) contributions + headers, >= 50x below the fp16
butterfly; a NaN contribution and an absent member are dropped on every member alike.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from diloco_p2p.swarm.collective import allgather, codecs, wire
from tests.harness.loopback import AllreducePeers

pytestmark = pytest.mark.timeout(60)

N = 3 * 20_000 + 2
CHUNK = 8192
WEIGHTS = [1000.0, 3000.0, 2000.0]
DENSITY = 0.01


@pytest.fixture(scope="module")
def swarm():
    with AllreducePeers(3, prefix="compress", chunk_elements=CHUNK) as peers:
        yield peers.loop, peers.services, peers.peers


def run_group(swarm, tensors, members=(0, 1, 2), **kwargs):
    loop, services, peers = swarm
    group_id = f"compress-{uuid.uuid4().hex}"

    async def all_members():
        return await asyncio.gather(*(services[i].allreduce(group_id, peers, tensors[i], WEIGHTS[i], **kwargs)
                                      for i in members))

    return loop.run(all_members(), 60)


def inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(N, generator=g) * (i + 1) for i in range(3)]
    xs[1][123] = 40.0
    return xs


def decoded_topk(x: torch.Tensor) -> torch.Tensor:
    """A contribution as a receiver decodes it: chunk by chunk, as the sender encodes it."""
    return torch.cat([codecs.decode_topk(codecs.encode_topk(x[a:b], DENSITY), b - a, DENSITY)
                      for a, b in wire.chunk_ranges(N, CHUNK)]) if N else torch.zeros(0)


def test_int4_members_agree_bit_for_bit_within_the_bound(swarm):
    xs = inputs(seed=1)
    results = run_group(swarm, xs, compression="int4", timeout=10.0)
    assert all(r.status == "ok" and torch.equal(r.average, results[0].average) for r in results)
    exact = sum(w * x.double() for w, x in zip(WEIGHTS, xs, strict=True)) / sum(WEIGHTS)
    # per element: each input off by <= absmax/14 (averaged by weight), the mean re-quantized once more
    weighted_max = sum(w * x.abs().max().item() for w, x in zip(WEIGHTS, xs, strict=True)) / sum(WEIGHTS)
    bound = (weighted_max + exact.abs().max().item()) / 14 * 1.001
    error = (results[0].average.double() - exact).abs()
    assert error.max() <= bound and error.max() > 0


def test_topk2_members_agree_bit_for_bit_on_the_mean_of_the_sparse_contributions(swarm):
    xs = inputs(seed=2)
    results = run_group(swarm, xs, compression="topk2", density=DENSITY, timeout=10.0)
    names = [p.to_base58() for p in swarm[2]]
    for r in results:
        assert r.status == "ok" and r.contributors == names and r.rejected == {}
        assert torch.equal(r.average, results[0].average)
    expected = sum(w * decoded_topk(x).double() for w, x in zip(WEIGHTS, xs, strict=True)) / sum(WEIGHTS)
    assert torch.allclose(results[0].average.double(), expected, rtol=1e-6, atol=1e-6)
    nonzero = int((results[0].average != 0).sum())
    assert DENSITY * N <= nonzero <= 3 * (DENSITY * N + N / codecs.TOPK_BLOCK + 8)  # the union of three top-k

    size = sum(codecs.topk_size(b - a, DENSITY) for a, b in wire.chunk_ranges(N, CHUNK))
    fp16_bound = 2 * (3 - 1) / 3 * 2 * N
    for r in results:
        assert 2 * size <= r.bytes_sent <= 2 * size + 3000  # two contributions, headers, frame prefixes, masks
        print(f"topk2: sent {r.bytes_sent} B, fp16 butterfly bound {fp16_bound:.0f} B: "
              f"{fp16_bound / r.bytes_sent:.1f}x fewer")
    # at this small size the headers weigh; the 50x goal holds for the payload itself
    assert fp16_bound / (2 * size) >= 50


def test_topk2_drops_a_nan_contribution_on_every_member(swarm):
    xs = inputs(seed=3)
    xs[2][7] = float("nan")
    results = run_group(swarm, xs, compression="topk2", density=DENSITY, timeout=10.0)
    names = [p.to_base58() for p in swarm[2]]
    for r in results:
        assert r.status == "ok" and r.contributors == names[:2] and r.rejected == {names[2]: "nan"}
        assert torch.equal(r.average, results[0].average)
    expected = sum(w * decoded_topk(x).double() for w, x in zip(WEIGHTS[:2], xs[:2], strict=True)) / sum(WEIGHTS[:2])
    assert torch.allclose(results[0].average.double(), expected, rtol=1e-6, atol=1e-6)


def test_topk2_without_an_absent_member(swarm):
    """Member 2 never joins the all-reduce: the others drop it alike at the deadline."""
    xs = inputs(seed=4)
    results = run_group(swarm, xs, members=(0, 1), compression="topk2", density=DENSITY, timeout=2.0)
    names = [p.to_base58() for p in swarm[2]]
    for r in results:
        assert r.status == "ok" and r.contributors == names[:2] and r.rejected == {names[2]: "timeout"}
    assert torch.equal(results[0].average, results[1].average)


def test_contribution_digest_covers_weight_and_bytes():
    frames = [b"abc", b"de"]
    d = allgather.contribution_digest(1.0, frames)
    assert d != allgather.contribution_digest(2.0, frames)
    assert d != allgather.contribution_digest(1.0, [b"abcd", b"e"])
    assert d == allgather.contribution_digest(1.0, list(frames))
