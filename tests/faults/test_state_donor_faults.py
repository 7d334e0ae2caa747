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
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import hivemind
import pytest
import torch

from diloco_p2p.swarm.runner import BackgroundLoop
from diloco_p2p.swarm.state.client import StateUnavailable, fetch_state
from diloco_p2p.swarm.state.codec import pack_state
from diloco_p2p.swarm.state.server import StateServer
from tests.dht_cluster import loopback_dhts

REPO = Path(__file__).resolve().parents[2]
ROUND = 9
THROTTLE = 2e6  # bytes/s: the faulty donor needs ~2 s for the whole blob
FAULT_AT = 256 << 10  # inject the fault once this many bytes arrived from the faulty donor
_run_ids = itertools.count()


@dataclass
class Swarm:
    dhts: list[hivemind.DHT]  # [good donor (bootstrap), joiner, corrupt donor]
    p2ps: list
    loop: BackgroundLoop
    blob: bytes
    blob_path: Path


@pytest.fixture(scope="module")
def swarm(tmp_path_factory) -> Iterator[Swarm]:
    g = torch.Generator().manual_seed(0)
    blob = pack_state({"params/w": torch.randn(1 << 20, generator=g)}, {"round": ROUND})  # 4 MiB
    path = tmp_path_factory.mktemp("state") / "blob.safetensors"
    path.write_bytes(blob)
    with loopback_dhts(3) as (dhts, p2ps, loop):
        yield Swarm(dhts, p2ps, loop, blob, path)


@dataclass
class DonorProcess:
    proc: subprocess.Popen
    peer_id: str
    sha256: str


@contextmanager
def donor_process(swarm: Swarm, run_id: str, tmp_path: Path, **flags) -> Iterator[DonorProcess]:
    """Start a donor process and wait for its READY line; on exit kill its whole process group
    (its DHT process and p2pd too), waking it first in case a test stopped it."""
    args = [sys.executable, "-m", "tests.faults.state_donor", "--run-id", run_id, "--round", str(ROUND),
            "--blob", str(swarm.blob_path), "--initial-peer", str(swarm.dhts[0].get_visible_maddrs()[0])]
    for name, value in flags.items():
        args += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    log = tmp_path / "donor.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(log, "wb") as err:
        # unbuffered stdout: select() must see every byte that read(1) has not consumed yet
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                bufsize=0, start_new_session=True)
    try:
        line, deadline = b"", time.monotonic() + 40
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                raise TimeoutError(f"donor not ready in 40 s; its log:\n{log.read_text()[-3000:]}")
            byte = proc.stdout.read(1)
            if not byte:
                raise RuntimeError(f"donor exited with {proc.wait()}; its log:\n{log.read_text()[-3000:]}")
            line += byte
        word, peer_id, sha = line.decode().split()
        assert word == "READY"
        yield DonorProcess(proc, peer_id, sha)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)


def _run_id() -> str:
    return f"sdfault{next(_run_ids)}"


def _fetch_with_fault(swarm: Swarm, run_id: str, faulty: str, fault, **kw):
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


def test_donor_killed_mid_transfer_joiner_resumes_from_another(swarm: Swarm, tmp_path: Path):
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


def test_stalled_donor_is_left_after_stall_timeout(swarm: Swarm, tmp_path: Path):
    run_id = _run_id()
    stall = 1.5
    with donor_process(swarm, run_id, tmp_path, throttle=THROTTLE) as d:
        fetched, good, fired, elapsed = _fetch_with_fault(
            swarm, run_id, d.peer_id, lambda: os.kill(d.proc.pid, signal.SIGSTOP), stall_timeout=stall
        )
        assert d.proc.poll() is None  # still there, only stopped
    assert fired
    assert fetched.blob == swarm.blob and fetched.attempts == 2 and fetched.donor == good.peer_id
    assert len(fetched.failures) == 1 and f"stalled: nothing for {stall:g} s" in fetched.failures[0]
    assert stall <= elapsed < stall + 8
    assert good.served_count == 1


def test_corrupt_donor_is_rejected_by_hash_and_the_good_one_serves(swarm: Swarm):
    run_id = _run_id()

    async def scenario():
        good = StateServer(swarm.dhts[0], swarm.p2ps[0], run_id=run_id)
        bad = StateServer(swarm.dhts[2], swarm.p2ps[2], run_id=run_id, corrupt=True, chunk_size=1 << 16)
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


def test_corrupt_donor_killed_mid_transfer_mixed_blob_is_refetched_from_one_donor(swarm: Swarm, tmp_path: Path):
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
