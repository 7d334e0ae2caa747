"""Shared fixtures: small CPU settings, and reaping of every process a test started."""

from __future__ import annotations

import os
import signal

# Before hivemind is imported: its default tensor sharing strategy aborts pytest at exit
# ("terminate called ... Broken pipe") once several DHTs have come and gone in one process.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.harness import reaping  # noqa: E402
from tests.harness.procs import Procs  # noqa: E402

torch.set_num_threads(1)
# Every process this session execs, and everything those start, carries the session's marker.
reaping.session_token()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# SIGTERM (`timeout`, a CI runner giving up) ends the session as Ctrl+C does: fixture teardowns
# and the session reaper still run, instead of leaving every swarm of the session behind.
signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(scope="session", autouse=True)
def reap_session():
    """At the end of the session, kill whatever is left: processes the harness started (also those
    that left their process group) and any descendant of this process (p2pd daemons, DHTs)."""
    yield
    reaping.reap_session()


@pytest.fixture
def procs():
    """Start a test's processes here (`procs.start(...)`): they and all they started die at teardown."""
    started = Procs()
    yield started
    started.close()
