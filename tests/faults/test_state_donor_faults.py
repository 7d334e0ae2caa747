"""Donors that die, stall or lie while a joiner streams the state from them, in stripes.

The faulty donor that must die or stall is a real process (`tests/faults/state_donor.py`, its
own DHT and p2pd, throttled so the transfer lasts seconds). A good donor in this process holds
the same state; the joiner streams from both at once. The order is fixed from the joiner's
progress callback: the good donor's worker waits there until the fault was injected, which
happens once FAULT_AT bytes came from the faulty donor, so the fault always lands mid-transfer
with stripes of the faulty donor in flight, and those must then come from the good one.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from diloco_p2p.swarm.state.client import StateUnavailable, fetch_state
from diloco_p2p.swarm.state.codec import pack_state
from diloco_p2p.swarm.state.server import StateServer
from diloco_p2p.swarm.state.stripes import PIPELINE, stripe_digests
from tests.faults.injection import flip_first_byte
from tests.harness.loopback import LoopbackPeers
from tests.harness.procs import Proc, Procs, wait_until

ROUND = 9
THROTTLE = 2e6  # bytes/s: the faulty donor needs ~2 s for the whole blob
FAULT_AT = 256 << 10  # inject the fault once this many bytes arrived from the faulty donor
STRIPE = 1 << 16  # every donor's stripe size: the 4 MiB state is 64 stripes
_run_ids = itertools.count()


class DonorPeers(LoopbackPeers):
    """[good donor (bootstrap), joiner, corrupt donor], and the state they serve (`blob`, also at `blob_path`)."""

    def __init__(self, blob: bytes, blob_path: Path):
        super().__init__(3)
        self.blob, self.blob_path = blob, blob_path


@pytest.fixture(scope="module")
def swarm(tmp_path_factory) -> Iterator[DonorPeers]:
    g = torch.Generator().manual_seed(0)
    blob = pack_state({"params/w": torch.randn(1 << 20, generator=g)}, {"round": ROUND})  # 4 MiB
    path = tmp_path_factory.mktemp("state") / "blob.safetensors"
    path.write_bytes(blob)
    with DonorPeers(blob, path) as peers:
        yield peers


@dataclass
class DonorProcess:
    proc: Proc
    peer_id: str
    sha256: str


@contextmanager
def donor_process(swarm: DonorPeers, run_id: str, tmp_path: Path, **flags) -> Iterator[DonorProcess]:
    """Start a donor process and wait for its READY line; on exit kill it and all it started
    (its DHT process and p2pd too), waking it first in case a test stopped it."""
    args = ["-m", "tests.faults.state_donor", "--run-id", run_id, "--round", str(ROUND), "--stripe-size", str(STRIPE),
            "--blob", str(swarm.blob_path), "--initial-peer", str(swarm.dhts[0].get_visible_maddrs()[0])]
    for name, value in flags.items():
        args += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    with Procs() as procs:
        # its stdin is a pipe held open here: EOF would stop it
        proc = procs.start(args, tmp_path / "donor.log", name="donor", stdin=subprocess.PIPE)
        wait_until(lambda: proc.first("READY ") is not None, 40, "the donor to be ready", proc)
        word, peer_id, sha = next(line for _, line in proc.lines if line.startswith("READY ")).split()
        yield DonorProcess(proc, peer_id, sha)


def _run_id() -> str:
    return f"sdfault{next(_run_ids)}"


def _fetch_with_fault(swarm: DonorPeers, run_id: str, faulty: str, fault, **kw):
    """Run a good donor (DHT 0) and a fetch by the joiner (DHT 1) from it and `faulty` at once;
    `fault()` is called once FAULT_AT bytes came from `faulty`, and the good donor's stripes are
    read only after that. Returns (fetched, good donor, bytes from `faulty` at the fault)."""

    async def scenario():
        good = StateServer(swarm.dhts[0], swarm.p2ps[0], run_id=run_id, stripe_size=STRIPE)
        await good.start()
        await good.set_state(ROUND, swarm.blob)
        fired: list[int] = []
        after_fault = asyncio.Event()

        async def progress(donor: str, received: int, size: int) -> None:
            if donor == faulty and received >= FAULT_AT and not fired:
                fired.append(received)
                fault()
                after_fault.set()
            elif donor == good.peer_id:
                await after_fault.wait()

        try:
            fetched = await fetch_state(swarm.dhts[1], swarm.p2ps[1], run_id=run_id, progress=progress, timeout=30,
                                        **kw)
            return fetched, good, fired
        finally:
            await good.stop()

    return swarm.loop.run(scenario(), timeout=60)


def _kept_and_discarded(fetched, good: StateServer, blob: bytes, faulty: str) -> tuple[int, int]:
    """Bytes of the blob the faulty donor served, and bytes of it the joiner threw away."""
    assert sum(fetched.by_donor.values()) == len(blob) and set(fetched.by_donor) <= {good.peer_id, faulty}
    assert fetched.by_donor[good.peer_id] == good.bytes_served  # the good donor's stripes all count
    return fetched.by_donor.get(faulty, 0), fetched.bytes - len(blob)


def test_donor_killed_mid_transfer_its_stripes_go_to_the_other(swarm: DonorPeers, tmp_path: Path):
    run_id = _run_id()
    with donor_process(swarm, run_id, tmp_path, throttle=THROTTLE) as d:
        assert d.sha256 == hashlib.sha256(swarm.blob).hexdigest()
        fetched, good, fired = _fetch_with_fault(swarm, run_id, d.peer_id, lambda: os.kill(d.proc.pid, signal.SIGKILL))
        assert d.proc.wait(timeout=10) == -signal.SIGKILL
    assert fired and fired[0] >= FAULT_AT
    assert fetched.blob == swarm.blob and fetched.sha256 == d.sha256
    assert fetched.attempts == 2 and fetched.donor == good.peer_id and fetched.forged == {}
    # noticed from the stream (not by the stall timeout of 10 s: that would say "stalled")
    assert len(fetched.failures) == 1 and "died" in fetched.failures[0], fetched.failures
    kept, discarded = _kept_and_discarded(fetched, good, swarm.blob, d.peer_id)
    assert FAULT_AT <= kept < len(swarm.blob) and kept % STRIPE == 0  # its whole stripes were kept
    assert 0 <= discarded < PIPELINE * STRIPE  # only the stripes it had in flight were lost
    assert good.served_count == 1
    print(f"\nkilled after {fired[0] / 1e6:.2f} MB: kept {kept / 1e6:.2f} MB of it, {discarded} bytes discarded")


def test_stalled_donor_is_left_after_stall_timeout_and_its_stripes_go_to_the_other(swarm: DonorPeers, tmp_path: Path):
    run_id = _run_id()
    stall = 1.5
    with donor_process(swarm, run_id, tmp_path, throttle=THROTTLE) as d:
        fetched, good, fired = _fetch_with_fault(
            swarm, run_id, d.peer_id, lambda: os.kill(d.proc.pid, signal.SIGSTOP), stall_timeout=stall
        )
        assert not d.proc.exited()  # still there, only stopped
    assert fired
    assert fetched.blob == swarm.blob and fetched.attempts == 2 and fetched.donor == good.peer_id
    assert len(fetched.failures) == 1 and f"stalled: nothing for {stall:g} s" in fetched.failures[0]
    kept, _ = _kept_and_discarded(fetched, good, swarm.blob, d.peer_id)
    assert FAULT_AT - STRIPE <= kept < len(swarm.blob) and kept % STRIPE == 0
    assert good.served_count == 1


def test_corrupt_stripe_is_caught_and_blamed_and_the_honest_donor_serves(swarm: DonorPeers):
    """The liar's first stripe fails its digest: it is named in `forged` (not asked again) and its
    stripes come from the honest donor. Alone, it is caught again and the fetch fails."""
    run_id = _run_id()

    async def scenario():
        good = StateServer(swarm.dhts[0], swarm.p2ps[0], run_id=run_id, stripe_size=STRIPE)
        bad = StateServer(swarm.dhts[2], swarm.p2ps[2], run_id=run_id, chunk_size=1 << 14, stripe_size=STRIPE)
        bad._outgoing = flip_first_byte  # every chunk it serves has its first byte flipped
        for d in (good, bad):
            await d.start()
            await d.set_state(ROUND, swarm.blob)
        try:
            fetched = await fetch_state(swarm.dhts[1], swarm.p2ps[1], run_id=run_id, prefer=[bad.peer_id], timeout=30)
            await good.withdraw()  # only the liar is left
            with pytest.raises(StateUnavailable) as e:
                await fetch_state(swarm.dhts[1], swarm.p2ps[1], run_id=run_id, timeout=30)
            return fetched, good, bad, e.value
        finally:
            for d in (good, bad):
                await d.stop()

    fetched, good, bad, e = swarm.loop.run(scenario(), timeout=60)
    assert fetched.blob == swarm.blob and fetched.attempts == 2 and fetched.by_donor == {good.peer_id: len(swarm.blob)}
    assert list(fetched.forged) == [bad.peer_id] and "does not match the sha256 in its own header" in fetched.forged[
        bad.peer_id]
    assert fetched.failures == [f"{bad.peer_id[-8:]} round {ROUND}: {fetched.forged[bad.peer_id]}"]
    assert good.served_count == 1 and bad.served_count == 0
    assert "\n" not in str(e) and "every donor failed" in str(e) and "does not match" in str(e)
    assert list(e.forged) == [bad.peer_id]


class LayoutLiar(StateServer):
    """Announces the blob's sha256 but serves another blob of the same size, with that blob's own
    stripe digests: every stripe matches the header, the whole does not match the announcement."""

    async def set_state(self, round, blob, params_hash=None):
        await super().set_state(round, blob, params_hash)
        tampered = bytearray(blob)
        tampered[len(blob) // 2] ^= 0xFF
        self._blob, self._digests = bytes(tampered), stripe_digests(bytes(tampered), self.stripe_size)


def test_stripe_digests_that_do_not_make_up_the_announced_sha256_are_caught_by_the_whole_blob_check(
        swarm: DonorPeers):
    """Tried first (a tie of one layout each: candidate order), the liar's layout is used and the
    honest donor set aside; the whole blob fails its sha256, the liar is named, and the honest
    donor then serves the blob alone."""
    run_id = _run_id()

    async def scenario():
        good = StateServer(swarm.dhts[0], swarm.p2ps[0], run_id=run_id, stripe_size=STRIPE)
        liar = LayoutLiar(swarm.dhts[2], swarm.p2ps[2], run_id=run_id, stripe_size=STRIPE)
        for d in (good, liar):
            await d.start()
            await d.set_state(ROUND, swarm.blob)
        try:
            fetched = await fetch_state(swarm.dhts[1], swarm.p2ps[1], run_id=run_id, prefer=[liar.peer_id],
                                        timeout=30)
            return fetched, good, liar
        finally:
            for d in (good, liar):
                await d.stop()

    fetched, good, liar = swarm.loop.run(scenario(), timeout=60)
    assert fetched.blob == swarm.blob and fetched.by_donor == {good.peer_id: len(swarm.blob)}
    assert fetched.forged == {liar.peer_id: "its stripe digests do not make up the sha256 it announced"}
    assert len(fetched.failures) == 2 and "its stripe digests differ from 1 other donor(s)'" in fetched.failures[0]
    assert fetched.attempts == 3 and fetched.bytes == 2 * len(swarm.blob)
    assert (liar.served_count, liar.rejected_count, good.served_count) == (0, 1, 1)
