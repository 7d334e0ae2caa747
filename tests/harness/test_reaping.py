"""The harness reaps what a test started, also a grandchild that escaped its process group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.harness import reaping
from tests.harness.procs import Procs, child_env

# A child that starts a grandchild in a session of its own, prints its pid and exits: the
# grandchild is orphaned outside the child's process group, as a node's DHT process and p2pd
# are when the node is SIGKILLed.
ORPHANER = (
    "import subprocess, sys\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
    "                     stdout=subprocess.DEVNULL, start_new_session=True)\n"
    "print('grandchild', g.pid, flush=True)\n"
)


def test_teardown_kills_a_grandchild_that_left_the_process_group(tmp_path: Path):
    procs = Procs()
    try:
        child = procs.start(["-c", ORPHANER], tmp_path / "orphaner.log")
        assert child.wait(timeout=30) == 0
        grandchild = int(child.output().split()[1])
        assert reaping.alive(grandchild) and os.getpgid(grandchild) != child.pid
    finally:
        procs.close()  # what the fixtures' teardown does, on failure too
    assert not reaping.alive(grandchild)


def test_session_reaper_kills_what_a_test_started_outside_the_harness(tmp_path: Path):
    before = set(reaping.marked(reaping.SESSION_VAR, reaping.session_token())) | set(reaping.descendants(os.getpid()))
    child = subprocess.Popen([sys.executable, "-c", ORPHANER], stdout=subprocess.PIPE, text=True, env=child_env())
    out, _ = child.communicate(timeout=30)
    grandchild = int(out.split()[1])
    assert reaping.alive(grandchild)
    assert grandchild in reaping.reap_session(spare=before)  # what conftest runs at the end of the session
    assert not reaping.alive(grandchild)


def test_an_xdist_worker_marks_its_processes_with_a_token_of_its_own(monkeypatch):
    """Workers inherit the controller's token; keeping it, the first worker to finish would reap
    every other worker (seen on a 16-core run with -n 12)."""
    monkeypatch.setenv(reaping.SESSION_VAR, "controller-token")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    token = reaping.session_token()
    assert token != "controller-token" and token.startswith("gw3-")
    assert reaping.session_token() == token == os.environ[reaping.SESSION_VAR]  # stable within the worker
