"""State sharing on a real swarm: 4 hivemind DHT peers (each its own p2pd) on loopback, two
donors and two joiners, all driven from one BackgroundLoop in this process.

Every test uses its own run id (its own DHT key and stream protocol), so tests cannot see each
other's donors. Ordering is expressed with awaits and events, never with sleeps.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Iterator

import pytest
import torch
from hivemind.utils import get_dht_time

from diloco_p2p.swarm.state.announcements import (
    LEGACY_VERSION,
    VERIFIED,
    handler_name,
    list_donors,
    state_key,
)
from diloco_p2p.swarm.state.client import StateUnavailable, fetch_state
from diloco_p2p.swarm.state.codec import pack_state, unpack_state
from diloco_p2p.swarm.state.server import StateServer
from diloco_p2p.swarm.state.stripes import PIPELINE
from diloco_p2p.swarm.transport import streams
from diloco_p2p.swarm.trust.signing import own_subkey
from tests.harness.loopback import LoopbackPeers

_run_ids = itertools.count()


class StatePeers(LoopbackPeers):
    """[donor A, donor B, joiner 1, joiner 2]"""

    def server(self, i: int, **kw) -> StateServer:
        return StateServer(self.dhts[i], self.p2ps[i], **kw)


@pytest.fixture(scope="module")
def swarm() -> Iterator[StatePeers]:
    with StatePeers(4) as peers:
        yield peers


def _run_id() -> str:
    return f"sstest{next(_run_ids)}"


def _blob(numel: int, round: int = 3, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    half = numel // 2
    return pack_state(
        {"params/w": torch.randn(half, generator=g), "momentum/w": torch.randn(numel - half, generator=g)},
        {"round": round, "tokens": 1000 * round},
    )


def test_one_donor_one_joiner_gets_the_identical_verified_blob(swarm: StatePeers):
    """Also the throughput measurement: a 32 MB state over loopback p2pd streams."""
    run_id = _run_id()
    blob = _blob(8 << 20)  # 8 Mi float32 = 32 MiB of tensors
    theta = hashlib.sha256(b"theta").hexdigest()

    async def scenario():
        donor = swarm.server(0, run_id=run_id)
        await donor.start()
        try:
            await donor.set_state(3, blob, params_hash=theta)
            listed = await list_donors(swarm.dhts[2], run_id)
            fetched = await fetch_state(swarm.dhts[2], swarm.p2ps[2], run_id=run_id, timeout=60)
            return listed, fetched, donor
        finally:
            await donor.stop()

    listed, fetched, donor = swarm.loop.run(scenario(), timeout=90)
    sha = hashlib.sha256(blob).hexdigest()
    assert [(a.peer_id, a.round, a.sha256, a.size, a.params_hash) for a in listed] == [
        (donor.peer_id, 3, sha, len(blob), theta)
    ]
    assert fetched.blob == blob
    assert (fetched.sha256, fetched.round, fetched.donor, fetched.params_hash) == (sha, 3, donor.peer_id, theta)
    assert fetched.attempts == 1 and fetched.bytes == len(blob) and fetched.failures == []
    assert (donor.served_count, donor.rejected_count, donor.bytes_served) == (1, 0, len(blob))
    tensors, meta = unpack_state(fetched.blob)
    assert meta == {"round": 3, "tokens": 3000} and tensors["params/w"].numel() == 4 << 20
    mb_s = len(blob) / 1e6 / fetched.seconds
    print(f"\nstate transfer over loopback: {len(blob) / 1e6:.1f} MB in {fetched.seconds:.2f} s = {mb_s:.0f} MB/s")
    assert mb_s > 5  # far below what loopback gives; catches a transfer that degenerated


def test_two_joiners_spread_over_two_donors(swarm: StatePeers):
    """Each donor serves one transfer at a time (`max_concurrent=1`). Joiner 1 takes one donor
    (`max_donors=1`) and holds its transfer open until joiner 2 is done; joiner 2 asks both, is
    told busy by joiner 1's and streams every stripe from the other."""
    run_id = _run_id()
    blob = _blob(1 << 19)  # 2 MiB

    async def scenario():
        donors = [swarm.server(i, run_id=run_id, max_concurrent=1, chunk_size=1 << 16) for i in (0, 1)]
        for d in donors:
            await d.start()
            await d.set_state(5, blob)
        try:
            first_bytes, second_done = asyncio.Event(), asyncio.Event()

            async def hold(donor: str, received: int, size: int) -> None:
                first_bytes.set()
                await second_done.wait()

            j1 = asyncio.ensure_future(
                fetch_state(swarm.dhts[2], swarm.p2ps[2], run_id=run_id, timeout=30, progress=hold, max_donors=1)
            )
            await asyncio.wait_for(first_bytes.wait(), 20)
            try:
                f2 = await fetch_state(swarm.dhts[3], swarm.p2ps[3], run_id=run_id, timeout=20)
            finally:
                second_done.set()
            f1 = await j1
            return donors, f1, f2
        finally:
            for d in donors:
                await d.stop()

    donors, f1, f2 = swarm.loop.run(scenario(), timeout=60)
    assert f1.blob == blob and f2.blob == blob
    assert {f1.donor, f2.donor} == {d.peer_id for d in donors}
    assert [d.served_count for d in donors] == [1, 1]
    assert (f1.attempts, f2.attempts) == (1, 2) and list(f2.by_donor) == [f2.donor]
    assert sum(d.refused_count for d in donors) == 1 and f2.failures == []


def test_min_round_newer_than_any_donor_fails_fast_with_a_clear_message(swarm: StatePeers):
    run_id = _run_id()

    async def scenario():
        donor = swarm.server(0, run_id=run_id)
        await donor.start()
        try:
            await donor.set_state(3, _blob(1024))
            t0 = time.perf_counter()
            with pytest.raises(StateUnavailable) as e:
                await fetch_state(swarm.dhts[2], swarm.p2ps[2], run_id=run_id, min_round=4, timeout=30)
            return str(e.value), time.perf_counter() - t0, donor
        finally:
            await donor.stop()

    msg, elapsed, donor = swarm.loop.run(scenario(), timeout=40)
    assert elapsed < 3.0
    assert "\n" not in msg
    assert f"run {run_id!r}, round >= 4" in msg and "newest: round 3" in msg
    assert donor.served_count == 0 and donor.bytes_served == 0


def test_new_round_replaces_the_old_and_stop_withdraws(swarm: StatePeers):
    run_id = _run_id()
    old, new = _blob(1024, round=3), _blob(1024, round=4, seed=1)

    async def scenario():
        donor = swarm.server(1, run_id=run_id)
        await donor.start()
        stopped = False
        try:
            await donor.set_state(3, old)
            await donor.set_state(4, new)
            listed = await list_donors(swarm.dhts[3], run_id)
            fetched = await fetch_state(swarm.dhts[3], swarm.p2ps[3], run_id=run_id, timeout=20)
            await donor.stop()
            stopped = True
            after = await list_donors(swarm.dhts[3], run_id)
            with pytest.raises(StateUnavailable) as e:
                await fetch_state(swarm.dhts[3], swarm.p2ps[3], run_id=run_id, timeout=20)
            return listed, fetched, after, str(e.value)
        finally:
            if not stopped:
                await donor.stop()

    listed, fetched, after, msg = swarm.loop.run(scenario(), timeout=60)
    assert [(a.round, a.size) for a in listed] == [(4, len(new))]
    assert fetched.blob == new and fetched.round == 4
    assert after == []
    assert "no peer announces a state" in msg


def test_stale_announcement_is_answered_gone_and_the_joiner_moves_on(swarm: StatePeers):
    """Donor B's DHT record says round 5 but B now holds round 4 (it moved, or the record is a
    leftover): B answers `gone` and the joiner takes round 4 from A."""
    run_id = _run_id()
    blob4 = _blob(1024, round=4)

    async def scenario():
        a, b = swarm.server(0, run_id=run_id), swarm.server(1, run_id=run_id)
        for d in (a, b):
            await d.start()
            await d.set_state(4, blob4)
        try:
            # outlives B's own record (announce_ttl 60 s): per subkey, the later expiration wins.
            # B's own DHT stores it: only B can sign an entry under its subkey (`swarm.trust.signing`)
            stale = {"round": 5, "sha256": "5" * 64, "size": 999, "params_hash": None}
            stored = await swarm.dhts[1].store(
                state_key(run_id), stale, get_dht_time() + 120, subkey=own_subkey(swarm.dhts[1], b.peer_id),
                return_future=True,
            )
            fetched = await fetch_state(swarm.dhts[2], swarm.p2ps[2], run_id=run_id, timeout=20)
            return stored, fetched, a, b
        finally:
            for d in (a, b):
                await d.stop()

    stored, fetched, a, b = swarm.loop.run(scenario(), timeout=60)
    assert stored
    assert fetched.blob == blob4 and fetched.round == 4 and fetched.donor == a.peer_id
    assert fetched.attempts == 2 and len(fetched.failures) == 1
    assert "round 5: gone: the donor no longer holds it; it now serves round 4" in fetched.failures[0]
    assert (b.refused_count, b.bytes_served, a.served_count) == (1, 0, 1)


def test_announcement_is_refreshed_while_serving(swarm: StatePeers):
    """With a 1 s lifetime, the record is still there 2.5 s later only if the server refreshed it."""
    run_id = _run_id()

    async def scenario():
        donor = swarm.server(0, run_id=run_id, announce_ttl=1.0)
        await donor.start()
        try:
            await donor.set_state(2, _blob(1024, round=2))
            first = await list_donors(swarm.dhts[3], run_id)
            await asyncio.sleep(2.5)  # time passing is the point here, not an ordering
            later = await list_donors(swarm.dhts[3], run_id)
            return first, later, donor.peer_id
        finally:
            await donor.stop()

    first, later, peer = swarm.loop.run(scenario(), timeout=30)
    assert [a.peer_id for a in first] == [peer] and [a.peer_id for a in later] == [peer]


def test_donors_serving_another_theta_under_the_vouched_hash_are_refused_and_named(swarm: StatePeers):
    """The forged-state attack: donors B and D announce the θ hash the swarm vouches for at round
    4, but serve a made-up θ (their blob's sha256 matches their announcement, so the joiner
    streams it from both). The joiner checks θ itself (`StateCheck`), refuses their state, names
    both and takes A's; tried first, they cost it one download. A stranger or a node of another
    round can never be adopted this way either."""
    from diloco_p2p.swarm.state.codec import StateCheck, theta_sha256

    run_id = _run_id()
    honest = {"outer.theta": torch.arange(1 << 16, dtype=torch.float32), "outer.momentum": torch.zeros(64)}
    made_up = {"outer.theta": torch.full((1 << 16,), 9.0), "outer.momentum": torch.zeros(64)}
    vouched = theta_sha256(honest)
    good, forged = pack_state(honest, {"round": 4}), pack_state(made_up, {"round": 4})

    async def scenario():
        a, b, d = (swarm.server(i, run_id=run_id, stripe_size=STRIPE) for i in (0, 1, 3))
        for donor, blob in ((a, good), (b, forged), (d, forged)):
            await donor.start()
            await donor.set_state(4, blob, params_hash=vouched)  # B and D lie about their θ
        try:
            check = StateCheck(4, vouched, max_round=10)
            fetched = await fetch_state(swarm.dhts[2], swarm.p2ps[2], run_id=run_id, params_hash=vouched,
                                        prefer=[b.peer_id], verify=check, timeout=30)
            return fetched, check, a, b, d
        finally:
            for donor in (a, b, d):
                await donor.stop()

    fetched, check, a, b, d = swarm.loop.run(scenario(), timeout=60)
    assert fetched.blob == good and list(fetched.by_donor) == [a.peer_id]
    assert sorted(fetched.forged) == sorted([b.peer_id, d.peer_id])
    assert all("served θ" in why for why in fetched.forged.values())
    assert theta_sha256(check.unpacked[0]) == vouched
    assert fetched.attempts == 3 and b.bytes_served + d.bytes_served == len(forged)


STRIPE = 1 << 16  # small stripes: a 2 MiB state is 32 of them


def test_three_donors_stream_stripes_of_the_identical_blob(swarm: StatePeers):
    """Three donors of the same blob: the joiner streams stripes from all three at once (each one
    takes `PIPELINE` stripes as the download starts, so each serves some) and gets the blob."""
    run_id = _run_id()
    blob = _blob(1 << 19)  # 2 MiB

    async def scenario():
        donors = [swarm.server(i, run_id=run_id, stripe_size=STRIPE) for i in (0, 1, 3)]
        for d in donors:
            await d.start()
            await d.set_state(5, blob)
        try:
            return donors, await fetch_state(swarm.dhts[2], swarm.p2ps[2], run_id=run_id, timeout=30)
        finally:
            for d in donors:
                await d.stop()

    donors, fetched = swarm.loop.run(scenario(), timeout=60)
    assert fetched.blob == blob and fetched.sha256 == hashlib.sha256(blob).hexdigest()
    assert fetched.by_donor == {d.peer_id: d.bytes_served for d in donors}  # all three, nothing discarded
    assert fetched.donor == next(iter(fetched.by_donor))
    assert fetched.attempts == 3 and fetched.failures == [] and fetched.forged == {}
    assert all(d.bytes_served >= PIPELINE * STRIPE for d in donors)
    assert sum(d.bytes_served for d in donors) == fetched.bytes == len(blob)
    assert [d.served_count for d in donors] == [1, 1, 1]  # each got the verdict on the whole


def test_a_joiner_of_the_previous_release_is_still_served(swarm: StatePeers):
    """v1 (one stream, the whole blob from an offset) is still served beside v2."""
    run_id = _run_id()
    blob = _blob(4096)

    async def scenario():
        donor = swarm.server(0, run_id=run_id)
        await donor.start()
        try:
            await donor.set_state(2, blob)
            _, reader, writer = await swarm.p2ps[2].call_binary_stream_handler(
                swarm.p2ps[0].peer_id, handler_name(run_id, LEGACY_VERSION))
            streams.write_json(writer, {"sha256": hashlib.sha256(blob).hexdigest(), "offset": 100}, version=1)
            header = await streams.read_json(reader, 4096, version=1)
            data = await reader.readexactly(len(blob) - 100)
            writer.write(VERIFIED)
            await writer.drain()
            ack = await reader.readexactly(1)
            writer.close()
            return header, data, ack, donor
        finally:
            await donor.stop()

    header, data, ack, donor = swarm.loop.run(scenario(), timeout=30)
    assert header == {"v": 1, "ok": True, "size": len(blob)} and data == blob[100:] and ack == VERIFIED
    assert donor.served_count == 1


def test_a_donor_of_the_previous_release_is_refused_with_a_clear_reason(swarm: StatePeers):
    """A donor that serves v1 only (its v2 handler removed here) is named in one line, not retried."""
    run_id = _run_id()

    async def scenario():
        donor = swarm.server(0, run_id=run_id)
        await donor.start()
        try:
            await donor.set_state(2, _blob(4096))
            await swarm.p2ps[0].remove_binary_stream_handler(handler_name(run_id))
            with pytest.raises(StateUnavailable) as e:
                await fetch_state(swarm.dhts[2], swarm.p2ps[2], run_id=run_id, timeout=20)
            return str(e.value)
        finally:
            await donor.stop()

    msg = swarm.loop.run(scenario(), timeout=40)
    assert "every donor failed; 1 attempts" in msg and "speaks no state protocol v2" in msg, msg
