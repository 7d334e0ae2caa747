"""Donors that die, stall or lie while a joiner downloads the state from them.

The faulty donor that must die or stall is a real process (`tests/faults/state_donor.py`, its
own DHT and p2pd, throttled so the transfer lasts seconds). The joiner names it in `prefer`, so
it is tried first; the fault is injected from the joiner's progress callback once bytes have
arrived, so it always lands mid-transfer. A good donor in this process holds the same state.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from diloco_p2p.swarm.state.client import StateUnavailable, fetch_state
from diloco_p2p.swarm.state.codec import pack_state
from diloco_p2p.swarm.state.server import StateServer
from tests.faults.injection import flip_first_byte
from tests.harness.loopback import LoopbackPeers
from tests.harness.procs import Proc, Procs, wait_until

ROUND = 9
THROTTLE = 2e6  # bytes/s: the faulty donor needs ~2 s for the whole blob
FAULT_AT = 256 << 10  # inject the fault once this many bytes arrived from the faulty donor
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
    args = ["-m", "tests.faults.state_donor", "--run-id", run_id, "--round", str(ROUND),
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
    """Run a good donor (DHT 0) and a fetch by the joiner (DHT 1) that tries `faulty` first and
    calls `fault()` once FAULT_AT bytes came from it. Returns (fetched, good donor, bytes at fault)."""

    async def scenario():
        good = StateServer(swarm.dhts[0], swarm.p2ps[0], run_id=run_id)
        await good.start()
        await good.set_state(ROUND, swarm.blob)
        fired: list[int] = []

        def progress(donor: str, received: int, size: int) -> None:
            if donor == faulty and received >= FAULT_AT and not fired:
                fired.append(received)
                fault()

        try:
            t0 = time.perf_counter()
            fetched = await fetch_state(swarm.dhts[1], swarm.p2ps[1], run_id=run_id, prefer=[faulty],
                                        progress=progress, timeout=30, **kw)
            return fetched, good, fired, time.perf_counter() - t0
        finally:
            await good.stop()

    return swarm.loop.run(scenario(), timeout=60)


def test_donor_killed_mid_transfer_joiner_resumes_from_another(swarm: DonorPeers, tmp_path: Path):
    run_id = _run_id()
    with donor_process(swarm, run_id, tmp_path, throttle=THROTTLE) as d:
        assert d.sha256 == hashlib.sha256(swarm.blob).hexdigest()
        fetched, good, fired, elapsed = _fetch_with_fault(
            swarm, run_id, d.peer_id, lambda: os.kill(d.proc.pid, signal.SIGKILL), stall_timeout=10
        )
        assert d.proc.wait(timeout=10) == -signal.SIGKILL
    assert fired and fired[0] >= FAULT_AT
    assert fetched.blob == swarm.blob and fetched.sha256 == d.sha256
    assert fetched.attempts == 2 and fetched.donor == good.peer_id
    assert len(fetched.failures) == 1 and "died" in fetched.failures[0], fetched.failures
    # resumed where the dead donor stopped: nothing was downloaded twice
    from_dead = len(swarm.blob) - good.bytes_served
    assert fetched.bytes == len(swarm.blob) and FAULT_AT <= from_dead < len(swarm.blob)
    assert good.served_count == 1
    assert elapsed < 10, "death must be noticed from the stream, not by the stall timeout"
    print(f"\nkilled at {from_dead / 1e6:.2f} MB, completed from the other donor in {elapsed:.2f} s")


def test_stalled_donor_is_left_after_stall_timeout(swarm: DonorPeers, tmp_path: Path):
    run_id = _run_id()
    stall = 1.5
    with donor_process(swarm, run_id, tmp_path, throttle=THROTTLE) as d:
        fetched, good, fired, elapsed = _fetch_with_fault(
            swarm, run_id, d.peer_id, lambda: os.kill(d.proc.pid, signal.SIGSTOP), stall_timeout=stall
        )
        assert not d.proc.exited()  # still there, only stopped
    assert fired
    assert fetched.blob == swarm.blob and fetched.attempts == 2 and fetched.donor == good.peer_id
    assert len(fetched.failures) == 1 and f"stalled: nothing for {stall:g} s" in fetched.failures[0]
    assert stall <= elapsed < stall + 8
    assert good.served_count == 1


def test_corrupt_donor_is_rejected_by_hash_and_the_good_one_serves(swarm: DonorPeers):
    run_id = _run_id()

    async def scenario():
        good = StateServer(swarm.dhts[0], swarm.p2ps[0], run_id=run_id)
        bad = StateServer(swarm.dhts[2], swarm.p2ps[2], run_id=run_id, chunk_size=1 << 16)
        bad._outgoing = flip_first_byte  # every chunk it serves has its first byte flipped
        for d in (good, bad):
            await d.start()
            await d.set_state(ROUND, swarm.blob)
        try:
            fetched = await fetch_state(swarm.dhts[1], swarm.p2ps[1], run_id=run_id, prefer=[bad.peer_id], timeout=30)
            await bad.withdraw()
            await good.withdraw()
            await bad.set_state(ROUND, swarm.blob)  # only the liar is left
            with pytest.raises(StateUnavailable) as e:
                await fetch_state(swarm.dhts[1], swarm.p2ps[1], run_id=run_id, timeout=30)
            return fetched, good, bad, str(e.value)
        finally:
            for d in (good, bad):
                await d.stop()

    fetched, good, bad, msg = swarm.loop.run(scenario(), timeout=60)
    assert fetched.blob == swarm.blob and fetched.donor == good.peer_id and fetched.attempts == 2
    assert len(fetched.failures) == 1 and "sha256 mismatch" in fetched.failures[0]
    assert fetched.bytes == 2 * len(swarm.blob)  # the corrupt copy was discarded whole, not resumed
    assert (bad.served_count, bad.rejected_count) == (0, 2) and good.served_count == 1
    assert "\n" not in msg and "every donor failed" in msg and "sha256 mismatch" in msg
    assert bad.peer_id[-8:] in msg


def test_corrupt_donor_killed_mid_transfer_mixed_blob_is_refetched_from_one_donor(swarm: DonorPeers, tmp_path: Path):
    """The dead donor's prefix was corrupt, the good donor resumed after it: the assembled blob
    fails its hash and no single donor can be blamed, so the joiner refetches it whole from one."""
    run_id = _run_id()
    with donor_process(swarm, run_id, tmp_path, throttle=THROTTLE, corrupt=True) as d:
        fetched, good, fired, _ = _fetch_with_fault(
            swarm, run_id, d.peer_id, lambda: os.kill(d.proc.pid, signal.SIGKILL), stall_timeout=10
        )
    assert fired
    assert fetched.blob == swarm.blob and fetched.donor == good.peer_id and fetched.attempts == 3
    assert len(fetched.failures) == 2, fetched.failures
    assert "died" in fetched.failures[0]
    assert "sha256 mismatch" in fetched.failures[1] and "assembled from 2 donors" in fetched.failures[1]
    assert (good.served_count, good.rejected_count) == (1, 1)  # the resumed tail, then the whole blob
    from_dead = fetched.bytes - good.bytes_served
    assert FAULT_AT <= from_dead < len(swarm.blob)
    assert good.bytes_served == (len(swarm.blob) - from_dead) + len(swarm.blob)
