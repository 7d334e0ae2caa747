"""Faults during the all-reduce, on real p2pd daemons (three hivemind DHTs on loopback).

Each test asserts the exact outcome: who is left out and why, which parts are committed, that the
survivors hold bit-identical finite averages equal to the weighted mean of what was accepted, and
that nobody waits past the timeout plus a small margin. Process-level SIGKILL/SIGSTOP tests live in
the node's integration suite; here a member "dies" by shutting down its DHT (and with it its p2pd)
from the test hook `on_phase`, or "stalls" by never answering.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch

from diloco_p2p.swarm.collective import aggregate, wire
from diloco_p2p.swarm.collective.allreduce import AllreduceResult, AllreduceService
from diloco_p2p.swarm.collective.allreduce_state import Session
from diloco_p2p.swarm.collective.allreduce_streams import GO, NO_GO
from diloco_p2p.swarm.transport import streams
from tests.harness.loopback import AllreducePeers

pytestmark = pytest.mark.timeout(60)

N = 3 * 5000 + 1
CHUNK = 2048
T = 3.0  # all-reduce timeout in these tests
MARGIN = 0.5
WEIGHTS = [1000.0, 3000.0, 2000.0]


@pytest.fixture(scope="module")
def swarm():
    with AllreducePeers(3, prefix="ftest", chunk_elements=CHUNK) as peers:
        yield peers


def inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=g) * (i + 1) for i in range(3)]


def assert_weighted_mean(result: AllreduceResult, xs, names, weights=WEIGHTS):
    """Each committed part equals the fp16 weighted mean of exactly its reported contributors; the rest is 0."""
    bounds = wire.partition(N, result.num_parts)
    for p, (lo, hi) in enumerate(bounds):
        got = result.average[lo:hi].double()
        if p not in result.committed_parts:
            assert torch.equal(got, torch.zeros(hi - lo, dtype=torch.float64)), (
                f"uncommitted part {p} not zero"
            )
            continue
        members = [names.index(c) for c in result.part_contributors[p]]
        total = sum(weights[i] for i in members)
        exact = sum(weights[i] * xs[i][lo:hi].double() for i in members) / total
        weighted_abs = sum(weights[i] * xs[i][lo:hi].double().abs() for i in members) / total
        bound = 2.0**-11 * (weighted_abs + exact.abs()) * 1.001 + 1e-6
        assert bool(((got - exact).abs() <= bound).all()), f"part {p} is not the mean of {members}"


def assert_agree(results: list[AllreduceResult]):
    for r in results:
        assert torch.equal(r.average, results[0].average)
        assert r.committed_parts == results[0].committed_parts
        assert bool(torch.isfinite(r.average).all())


def assert_survivors_commit_two_parts(swarm, scenario) -> list[AllreduceResult]:
    """Run `scenario` (members 0 and 1 against a faulty member 2): within T + MARGIN the two agree
    and commit parts 0 and 1. Returns their results."""
    started = time.monotonic()
    results = swarm.loop.run(scenario, 30)
    assert time.monotonic() - started < T + MARGIN
    assert_agree(results)
    for r in results:
        assert r.status == "partial" and r.committed_parts == [0, 1]
    return results


def test_member_that_never_calls_allreduce(swarm):
    """Member 2 is in the group, its handler is up, but it never starts (a stall from the outset)."""
    xs, group = inputs(1), f"stall-{uuid.uuid4().hex}"

    async def two():
        return await asyncio.gather(
            *(swarm.services[i].allreduce(group, swarm.peers, xs[i], WEIGHTS[i], timeout=T) for i in (0, 1))
        )

    for r in assert_survivors_commit_two_parts(swarm, two()):
        assert r.rejected == {swarm.names[2]: "timeout"}
        assert r.contributors == swarm.names[:2] and r.agreed_with == swarm.names[:2]
        assert_weighted_mean(r, xs, swarm.names)


def test_member_without_a_handler_is_not_waited_for(swarm):
    """Member 2 runs no service for this run id: its stream cannot be opened, so it is 'gone' at once."""
    services = [swarm.service(swarm.p2ps[i], "ftest-absent") for i in (0, 1)]
    xs = inputs(2)
    try:

        async def two():
            return await asyncio.gather(
                *(services[i].allreduce("absent", swarm.peers, xs[i], WEIGHTS[i], timeout=T) for i in (0, 1))
            )

        results = swarm.loop.run(two(), 30)
    finally:
        for service in services:
            swarm.loop.run(service.stop(), 10)
    assert_agree(results)
    for r in results:
        assert r.status == "partial" and r.committed_parts == [0, 1]
        assert r.seconds < 0.4 * T  # no deadline was waited for
        assert_weighted_mean(r, xs, swarm.names)


@pytest.mark.parametrize("frames_read", [0, 2])
def test_a_refusal_stops_the_payload_and_is_not_taken_for_death(swarm, frames_read):
    """A sender writes its payload right after the header, without waiting for the go. A refusal,
    at the header or after some frames (as of a NaN mid-part), must reach it while it writes: it
    stops the payload well before its end, and the refuser is not taken for gone (a gone member
    is sent nothing more that round). The payload is paced to 4 s so "before its end" is clear."""
    prefix, frame, frames = f"refuse-{uuid.uuid4().hex[:8]}", 1 << 20, 32
    sender = AllreduceService(swarm.p2ps[0], prefix=prefix, chunk_elements=CHUNK, pace_bytes=frames * frame / 4.0)
    read: list[int] = []

    async def refuse(_info, reader, writer):
        await streams.read_frame(reader, wire.MAX_HEADER_BYTES)
        if frames_read:
            writer.write(GO)
            for _ in range(frames_read):
                read.append(len(await streams.read_frame(reader, frame)))
        writer.write(NO_GO)
        await writer.drain()
        await streams.linger(reader, 5.0, drain=True)
        writer.close()

    async def scenario():
        await swarm.p2ps[1].add_binary_stream_handler(sender.handler_name, refuse)
        try:
            loop = asyncio.get_running_loop()
            s = Session("refused", loop.time())
            s.start(swarm.peers, 0, N, "fp16", CHUNK, loop.time(), T)
            started = time.monotonic()
            accepted = await sender._send(s, 1, s.header("scatter"), [bytes(frame)] * frames, loop.time() + 10)
            return accepted, time.monotonic() - started, s
        finally:
            await swarm.p2ps[1].remove_binary_stream_handler(sender.handler_name)

    accepted, seconds, s = swarm.loop.run(scenario(), 30)
    assert accepted is False and 1 not in s.gone
    assert read == [frame] * frames_read
    assert seconds < 2.0 and s.bytes_sent < frames * frame / 2


def run_three(swarm, xs, weights, **kwargs) -> list[AllreduceResult]:
    group = f"g-{uuid.uuid4().hex}"

    async def three():
        return await asyncio.gather(
            *(
                svc.allreduce(group, swarm.peers, x, w, timeout=T, **kwargs)
                for svc, x, w in zip(swarm.services, xs, weights, strict=True)
            )
        )

    return swarm.loop.run(three(), 30)


def test_member_sending_nan_is_rejected_everywhere(swarm):
    xs = inputs(3)
    xs[2][7] = float("nan")  # lies in part 0 only: every reducer must still drop member 2
    xs[2][N - 1] = float("inf")
    results = run_three(swarm, xs, WEIGHTS)
    assert_agree(results)  # the NaN sender included: it gets the honest average too
    for r in results:
        assert r.status == "ok" and r.rejected == {swarm.names[2]: "nan"}
        assert r.contributors == swarm.names[:2]
        assert all(r.part_contributors[p] == swarm.names[:2] for p in range(3))
        assert_weighted_mean(r, xs, swarm.names)
        assert r.seconds < 0.4 * T


def test_absurd_weight_is_rejected_on_every_reducer(swarm):
    """Member 2 claims 1e12 tokens; even as a reducer it must not accept its own contribution."""
    xs, weights = inputs(4), [1000.0, 3000.0, 1e12]
    results = run_three(swarm, xs, weights)
    assert_agree(results)
    for r in results:
        assert r.status == "ok" and r.rejected == {swarm.names[2]: "weight"}
        assert r.contributors == swarm.names[:2]
        assert_weighted_mean(r, xs, swarm.names, weights)


def test_member_with_another_vector_size_is_left_out(swarm):
    xs = inputs(5)
    xs[2] = torch.randn(N + 7)
    results = run_three(swarm, xs, WEIGHTS)
    assert_agree(results[:2])
    for r in results[:2]:
        assert r.status == "partial" and r.committed_parts == [0, 1]
        assert r.rejected == {swarm.names[2]: "shape"} and r.contributors == swarm.names[:2]
        assert r.seconds < 0.4 * T
        assert_weighted_mean(r, xs, swarm.names)
    assert results[2].status == "failed"  # the odd one out agrees with nobody and gets nothing usable


@pytest.mark.parametrize("phase", ["scattered", "reduced"])
def test_member_dies_mid_allreduce(swarm, phase):
    """The victim's DHT and p2pd die after its scatter was delivered ("scattered") or once it fixed the
    contributors of its part ("reduced"), before its gather goes out: the survivors commit the other
    two parts identically (with the victim's contributions in them when they arrived)."""
    victim_dht = swarm.add_dht()
    victim_p2p = swarm.loop.run(victim_dht.replicate_p2p(), 30)
    victim = swarm.service(victim_p2p, "ftest")
    peers = swarm.peers[:2] + [victim_p2p.peer_id]
    names = [p.to_base58() for p in peers]
    xs, group = inputs(6), f"die-{uuid.uuid4().hex}"

    class Crash(Exception):
        pass

    async def die(name: str) -> None:
        if name == phase:
            await asyncio.to_thread(victim_dht.shutdown)
            raise Crash()

    async def scenario():
        survivors = [swarm.services[i].allreduce(group, peers, xs[i], WEIGHTS[i], timeout=T) for i in (0, 1)]
        dying = victim.allreduce(group, peers, xs[2], WEIGHTS[2], timeout=T, on_phase=die)
        return await asyncio.gather(*survivors, dying, return_exceptions=True)

    started = time.monotonic()
    *results, crash = swarm.loop.run(scenario(), 30)
    wall = time.monotonic() - started
    swarm.loop.run(victim.stop(), 10)
    swarm.loop.run(victim_p2p.shutdown(), 10)
    print(f"{phase}: survivors took {[round(r.seconds, 2) for r in results]} s (T={T})")
    assert isinstance(crash, Crash)
    assert wall < T + MARGIN
    assert_agree(results)
    # At "reduced" the victim dies before its gather goes out: its part is lost. At "scattered" its own
    # part streams out while it is still sending (the pipeline), so it may have reached both survivors
    # before the crash: then both commit it, else neither does (assert_agree: the same parts on both).
    lost = [[0, 1]] if phase == "reduced" else [[0, 1], [0, 1, 2]]
    for r in results:
        assert r.committed_parts in lost
        assert r.status == ("partial" if len(r.committed_parts) == 2 else "ok")
        assert r.agreed_with == names[:2]
        assert_weighted_mean(r, xs, names)


def test_member_stalls_after_reducing(swarm):
    """The victim reduces and then never sends anything again (its handler still answers, like a
    peer whose training thread hangs): the survivors wait for it until their deadlines, no longer."""
    xs, group = inputs(7), f"hang-{uuid.uuid4().hex}"
    forever = asyncio.Event()

    async def hang(phase: str) -> None:
        if phase == "reduced":
            await forever.wait()

    async def scenario():
        hung = asyncio.ensure_future(
            swarm.services[2].allreduce(group, swarm.peers, xs[2], WEIGHTS[2], timeout=60, on_phase=hang)
        )
        try:
            return await asyncio.gather(
                *(
                    swarm.services[i].allreduce(group, swarm.peers, xs[i], WEIGHTS[i], timeout=T)
                    for i in (0, 1)
                )
            )
        finally:
            hung.cancel()
            await asyncio.gather(hung, return_exceptions=True)

    for r in assert_survivors_commit_two_parts(swarm, scenario()):
        assert r.agreed_with == swarm.names[:2]
        assert r.seconds >= 0.9 * T  # it was heard from, so its mask was awaited to the deadline
        assert_weighted_mean(r, xs, swarm.names)


@pytest.mark.parametrize("robust", [aggregate.MEAN, aggregate.Robust(max_norm_ratio=8.0)], ids=["mean", "norm-bound"])
def test_contributor_that_breaks_off_mid_part_voids_the_streamed_part(swarm, monkeypatch, robust):
    """Member 2 claims a finite vector but a NaN sits in the second chunk of parts 0 and 1: their
    reducers have already streamed the first chunk of the average with member 2 in it. The streamed
    gather ends void and each part is reduced again, whole, without member 2; every member holds
    the same result, equal to the mean of members 0 and 1 on those parts (part 2, clean, keeps it).
    Under a norm bound (checked once every contribution is in) the reason stays "nan"."""
    xs = inputs(8)
    bounds = wire.partition(N, 3)
    for lo, _ in bounds[:2]:
        xs[2][lo + CHUNK + 5] = float("nan")
    liar = swarm.services[2]
    honest_scatter = type(liar)._scatter

    def lying_scatter(self, s, tensor, weight):
        if self is not liar:
            return honest_scatter(self, s, tensor, weight)
        with monkeypatch.context() as m:  # _scatter has no await: the patch covers its checks only
            m.setattr(wire, "is_finite", lambda x: True)
            return honest_scatter(self, s, tensor, weight)

    monkeypatch.setattr(type(liar), "_scatter", lying_scatter)
    results = run_three(swarm, xs, WEIGHTS, robust=robust)
    honest = results[:2]
    assert_agree(honest)
    for r in honest:
        assert r.status == "ok" and r.rejected == {swarm.names[2]: "nan"}
        assert all(r.part_contributors[p] == swarm.names[:2] for p in (0, 1))
        assert r.part_contributors[2] == swarm.names
        assert_weighted_mean(r, xs, swarm.names)  # a first chunk with member 2 in it would fail this
    assert torch.equal(results[2].average, honest[0].average)  # the liar gets the honest average too
