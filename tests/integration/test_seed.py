"""The seed as a real process: serves the DHT, keeps its peer id, stops cleanly on signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from diloco_p2p.config import P2PConfig
from diloco_p2p.swarm.transport.dht import peer_id_of, start_dht
from tests.harness.reaping import alive, descendants

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


class Seed:
    """`python -m diloco_p2p seed` in its own process group, so teardown can reap all of it."""

    def __init__(self, tmp: Path, name: str, identity: Path):
        self.maddrs_file = tmp / f"{name}.maddrs"
        self.log = open(tmp / f"{name}.log", "w+")
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diloco_p2p", "seed", "--host-maddrs", *LOOPBACK, "--identity", str(identity),
             "--maddrs-file", str(self.maddrs_file)],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def wait_maddrs(self, deadline_s: float = 60.0) -> list[str]:
        deadline = time.monotonic() + deadline_s
        while not self.maddrs_file.exists():
            assert self.proc.poll() is None, f"seed exited early: {self.output()}"
            assert time.monotonic() < deadline, f"no --maddrs-file after {deadline_s} s: {self.output()}"
            time.sleep(0.05)
        return self.maddrs_file.read_text().split()

    def stop(self, sig: int) -> int:
        """Its exit code after `sig`; a seed that has not exited 15 s later fails the test (a bound for
        a hang, not a speed goal: a loaded machine took over 5 s)."""
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=15)

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def reap(self) -> None:
        if self.group_alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture
def seeds(tmp_path):
    started: list[Seed] = []

    def start(name: str, identity: Path) -> Seed:
        seed = Seed(tmp_path, name, identity)
        started.append(seed)
        return seed

    yield start
    for seed in started:
        seed.reap()


def _group_gone(seed: Seed, deadline_s: float) -> bool:
    deadline = time.monotonic() + deadline_s
    while seed.group_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not seed.group_alive()


def test_seed_serves_the_dht_and_stops_on_sigterm(seeds, tmp_path):
    identity = tmp_path / "seed.key"
    seed = seeds("first", identity)
    maddrs = seed.wait_maddrs()
    peer = peer_id_of(identity)  # created by the seed
    assert maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") and m.endswith(f"/p2p/{peer}") for m in maddrs)
    printed = [line for line in seed.output().splitlines() if line.startswith("/ip4/")]
    assert printed == maddrs

    # A stores through the seed and leaves; B, which knows only the seed, still finds the value:
    # the seed holds it.
    a = start_dht(P2PConfig(initial_peers=maddrs, host_maddrs=LOOPBACK), None)
    try:
        assert a.store("seedtest.key", "hello", get_dht_time() + 60)
    finally:
        a.shutdown()
    b = start_dht(P2PConfig(initial_peers=maddrs, host_maddrs=LOOPBACK), None)
    try:
        found = b.get("seedtest.key", latest=True)
        assert found is not None and found.value == "hello"
    finally:
        b.shutdown()

    assert seed.stop(signal.SIGTERM) == 0, seed.output()
    assert _group_gone(seed, 3.0), "the seed left its DHT process or p2pd running"


def test_seed_restart_keeps_its_peer_id_and_stops_on_sigint(seeds, tmp_path):
    identity = tmp_path / "seed.key"
    first = seeds("first", identity)
    peer = first.wait_maddrs()[0].rsplit("/p2p/", 1)[1]
    assert first.stop(signal.SIGINT) == 0, first.output()

    again = seeds("again", identity)
    assert all(m.endswith(f"/p2p/{peer}") for m in again.wait_maddrs())
    assert again.stop(signal.SIGINT) == 0, again.output()
    assert _group_gone(again, 3.0)


def test_a_seed_killed_with_sigkill_takes_its_dht_and_p2pd_along(seeds, tmp_path):
    """Its forked DHT process and p2pd exit by themselves; the restart keeps the peer id."""
    identity = tmp_path / "seed.key"
    first = seeds("first", identity)
    peer = first.wait_maddrs()[0].rsplit("/p2p/", 1)[1]
    helpers = descendants(first.proc.pid)
    assert len(helpers) == 2, helpers  # the DHT process and its p2pd
    first.proc.kill()
    first.proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while any(alive(p) for p in helpers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in helpers), "the seed's DHT process or p2pd outlived its SIGKILL"

    again = seeds("again", identity)
    assert all(m.endswith(f"/p2p/{peer}") for m in again.wait_maddrs())


def test_seed_with_a_corrupt_identity_exits_2_with_one_line(tmp_path):
    identity = tmp_path / "seed.key"
    identity.write_bytes(b"garbage")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "diloco_p2p", "seed", "--host-maddrs", *LOOPBACK, "--identity", str(identity)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: identity file {identity} is not a libp2p")
    assert "Traceback" not in proc.stderr
