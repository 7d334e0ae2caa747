"""The all-reduce on real p2pd daemons: three hivemind DHTs on loopback, their P2P replicas on one
background loop, three `AllreduceService`s run concurrently.

Checks: every member ends with bit-identical averages (fp32, fp16, int8); the average equals the
token-weighted mean computed here in float64 within the compression's error bound; bytes sent per
peer are close to the all-reduce lower bound 2(k-1)/k * bytes/element * n; a group of one gets the
exact tensor back; a member that starts late still gets every message (buffering).
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from diloco_p2p.swarm.collective import samples, wire
from diloco_p2p.swarm.transport import streams
from tests.harness.loopback import AllreducePeers

pytestmark = pytest.mark.timeout(60)

N = 3 * 20_000 + 2  # parts of unequal size (20001, 20001, 20000), several chunks each
CHUNK = 8192
WEIGHTS = [1000.0, 3000.0, 2000.0]
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def swarm():
    with AllreducePeers(3, prefix="itest", chunk_elements=CHUNK) as peers:
        yield peers.loop, peers.services, peers.peers


def run_group(loop, services, peers, tensors, weights, **kwargs):
    group_id = f"test-{uuid.uuid4().hex}"

    async def all_members():
        return await asyncio.gather(
            *(
                svc.allreduce(group_id, peers, t, w, **kwargs)
                for svc, t, w in zip(services, tensors, weights, strict=True)
            )
        )

    return loop.run(all_members(), 60)


def inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # different scales per member and an outlier, so a wrong weighting or blockwise bug shows
    xs = [torch.randn(N, generator=g) * (i + 1) for i in range(3)]
    xs[1][123] = 40.0
    return xs


def error_bound(xs: list[torch.Tensor], weights: list[float], mean: torch.Tensor, compression: str):
    """Elementwise bound on |result - exact mean|: input quantization (averaged) + output quantization."""
    total = sum(weights)
    if compression == "fp32":
        return 1e-6 * sum(w * x.double().abs() for w, x in zip(weights, xs, strict=True)) / total + 1e-7
    if compression == "fp16":  # round-to-nearest half: relative 2^-11; the 1e-6 covers subnormals
        weighted_abs = sum(w * x.double().abs() for w, x in zip(weights, xs, strict=True)) / total
        return 2.0**-11 * (weighted_abs + mean.abs()) * 1.001 + 1e-6
    # int8 absmax: <= absmax/254 per element; the global absmax bounds every block's
    weighted_max = sum(w * x.abs().max().item() for w, x in zip(weights, xs, strict=True)) / total
    return torch.full_like(mean, (weighted_max + mean.abs().max().item()) / 254 * 1.001 + 1e-6)


@pytest.mark.parametrize("compression", ["fp16", "fp32", "int8"])
def test_members_agree_bit_for_bit_on_the_weighted_mean(swarm, compression):
    loop, services, peers = swarm
    xs = inputs(seed=1)
    results = run_group(loop, services, peers, xs, WEIGHTS, compression=compression, timeout=TIMEOUT)

    names = [p.to_base58() for p in peers]
    for r in results:
        assert r.status == "ok" and r.committed_parts == [0, 1, 2] and r.num_parts == 3
        assert r.contributors == names and r.rejected == {}
        assert r.agreed_with == names
        assert torch.equal(r.average, results[0].average)  # bit-identical, not merely close
        # the phases in the order they happen (what `benchmarks/wire/allreduce_wan.py -v` prints)
        phases = [r.phases[p] for p in ("prepared", "scattered", "reduced", "gathered")]
        assert phases == sorted(phases) and phases[-1] <= r.seconds, r.phases

    exact = sum(w * x.double() for w, x in zip(WEIGHTS, xs, strict=True)) / sum(WEIGHTS)
    error = (results[0].average.double() - exact).abs()
    bound = error_bound(xs, WEIGHTS, exact, compression)
    assert bool((error <= bound).all()), (
        f"max error {error.max():.3g}, worst excess {(error - bound).max():.3g}"
    )
    if compression != "fp32":  # the wire really was lossy: catches a mode silently sending fp32
        assert error.max() > 0


@pytest.mark.parametrize("compression", ["fp16", "fp32", "int8"])
def test_bytes_sent_close_to_the_allreduce_lower_bound(swarm, compression):
    loop, services, peers = swarm
    results = run_group(
        loop, services, peers, inputs(seed=2), WEIGHTS, compression=compression, timeout=TIMEOUT
    )
    k = 3
    lower_bound = 2 * (k - 1) / k * wire.bytes_per_element(compression) * N
    quotes = (k - 1) * samples.frame_size(k, N // k)  # each reducer's samples, to each other member (fixed size)
    ratios = [(r.bytes_sent - quotes) / lower_bound for r in results]
    received = [(r.bytes_received - quotes) / lower_bound for r in results]
    print(f"{compression}: bytes sent / lower bound = {[f'{x:.4f}' for x in ratios]}, "
          f"received {[f'{x:.4f}' for x in received]}, seconds {[f'{r.seconds:.3f}' for r in results]}")  # fmt: skip
    # headers and masks are ~1.5 KB per peer here (~0.5-2% at this size); int8 adds 4 bytes per 1024 scales
    assert all(1.0 <= x < 1.03 for x in ratios + received), (ratios, received)


def test_a_paced_all_reduce_gives_the_same_bits_and_bytes_no_faster_than_its_rate(swarm):
    """`sync.pace`: every member writes through a `streams.Pacer`. Pacing changes when bytes
    leave, never which: the averages are bit-identical to an unpaced run's, the bytes received equal, and
    no member's sends beat the rate (its headers, a few hundred bytes each, are not paced)."""
    loop, services, peers = swarm
    xs = inputs(seed=3)
    rate = 400_000.0  # bytes/s: about 0.4 s for the ~160 KB each member sends
    probes = [svc.probe_interval for svc in services]
    for svc in services:  # no liveness pings (a member waiting past 1 s on a busy machine sends one)
        svc.probe_interval = 2 * TIMEOUT
    try:
        plain = run_group(loop, services, peers, xs, WEIGHTS, compression="fp16", timeout=TIMEOUT)
        for svc in services:
            svc.pacer = streams.Pacer(rate)
        paced = run_group(loop, services, peers, xs, WEIGHTS, compression="fp16", timeout=TIMEOUT)
    finally:
        for svc, probe in zip(services, probes, strict=True):
            svc.pacer, svc.probe_interval = None, probe
    for p, q in zip(plain, paced, strict=True):
        assert q.status == "ok" and q.committed_parts == [0, 1, 2]
        assert torch.equal(q.average, plain[0].average)
        # what a member received by its return is every message it waited for, so it is the same in
        # both runs; what it sent by then may lack a mask still opening its stream (sent in the background)
        assert q.bytes_received == p.bytes_received
        assert q.seconds >= (q.bytes_sent - 4096) / rate - 0.01, (q.seconds, q.bytes_sent)


def test_group_of_one_returns_the_exact_tensor(swarm):
    loop, services, peers = swarm
    x = torch.randn(1001)
    result = loop.run(services[0].allreduce("alone", [peers[0]], x, 5.0, compression="int8"), 10)
    assert result.status == "ok" and result.committed_parts == [0] and result.num_parts == 1
    assert torch.equal(result.average, x) and result.average is not x
    assert result.bytes_sent == 0 and result.bytes_received == 0
    assert result.contributors == [peers[0].to_base58()]


def test_member_that_starts_late_gets_buffered_messages(swarm):
    """Member 2 calls allreduce only once messages for the group have reached it (its service holds a
    not-yet-started session for the group_id): they wait for it instead of being dropped."""
    loop, services, peers = swarm
    xs, group_id = inputs(seed=3), f"late-{uuid.uuid4().hex}"

    async def scenario():
        async def late():
            async with asyncio.timeout(5):
                while group_id not in services[2]._sessions:  # created by the first incoming message
                    await asyncio.sleep(0.005)
            assert not services[2]._sessions[group_id].started.is_set()
            return await services[2].allreduce(group_id, peers, xs[2], WEIGHTS[2], timeout=TIMEOUT)

        early = [services[i].allreduce(group_id, peers, xs[i], WEIGHTS[i], timeout=TIMEOUT) for i in (0, 1)]
        return await asyncio.gather(*early, late())

    results = loop.run(scenario(), 60)
    assert [r.status for r in results] == ["ok"] * 3
    assert all(torch.equal(r.average, results[0].average) for r in results)
    assert all(r.seconds < TIMEOUT * 0.4 for r in results)  # nobody waited for a deadline


def test_nobody_else_shows_up_then_reusing_the_group_id_is_a_bug(swarm):
    loop, services, peers = swarm
    x = torch.randn(100)
    result = loop.run(services[0].allreduce("lonely", peers, x, 1.0, timeout=0.5), 10)
    assert (
        result.status == "failed"
        and result.committed_parts == []
        and result.agreed_with == [peers[0].to_base58()]
    )
    assert torch.equal(result.average, torch.zeros(100)) and result.seconds < 0.5 + 0.3
    with pytest.raises(ValueError, match="already used"):
        loop.run(services[0].allreduce("lonely", peers, x, 1.0, timeout=0.5), 10)


def test_private_member_reduces_nothing_and_members_still_agree(swarm):
    """Member 1 flagged private (behind NAT, `swarm.transport.reach`): it reduces no part, the two public
    members reduce half each, and every member ends with the same bits. Its bytes are n each way,
    the public ones' (k+P-2)/P·n (allreduce docstring, "Private members")."""
    loop, services, peers = swarm
    xs = inputs(seed=3)
    public = [True, False, True]
    results = run_group(loop, services, peers, xs, WEIGHTS, compression="fp16", timeout=TIMEOUT, public=public)
    names = [p.to_base58() for p in peers]
    for r in results:
        assert r.status == "ok" and r.committed_parts == [0, 1, 2]
        assert r.contributors == names and torch.equal(r.average, results[0].average)
        assert r.part_contributors[1] == []  # the private member's part is empty
    exact = sum(w * x.double() for w, x in zip(WEIGHTS, xs, strict=True)) / sum(WEIGHTS)
    assert bool(((results[0].average.double() - exact).abs() <= error_bound(xs, WEIGHTS, exact, "fp16")).all())
    k, p, per = 3, 2, wire.bytes_per_element("fp16") * N
    quotes = samples.frame_size(k, N // p)  # a public reducer's samples of its three contributors, to one member
    assert 1.0 <= results[1].bytes_sent / per < 1.03 and 1.0 <= (results[1].bytes_received - p * quotes) / per < 1.03
    for r in (results[0], results[2]):
        assert 1.0 <= (r.bytes_sent - (k - 1) * quotes) / ((k + p - 2) / p * per) < 1.03
