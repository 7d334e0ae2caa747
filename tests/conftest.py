"""Shared fixtures: small CPU settings, reaping of every process a test started, and the order in
which xdist hands out the test files."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path

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


# -- the longest files first ------------------------------------------------------------------------
# The README's command hands out whole files (`--dist loadfile`) in collection order
# (`--no-loadscope-reorder`). Ordered by their measured wall time, longest first, the multi-process
# files start at once on both workers and the seconds-long unit files fill the end, so neither worker
# waits for the other's last long file (longest-processing-time-first scheduling).
DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_UNIT, UNKNOWN_OTHER = 1.0, 30.0  # a file not yet measured: a unit file is short, others may not be


def pytest_addoption(parser):
    parser.addoption("--write-durations", action="store_true",
                     help=f"write each test file's wall time in this run (setup, call, teardown) to {DURATIONS.name}")


def file_cost(path: str, durations: dict[str, float]) -> float:
    if path in durations:
        return durations[path]
    return UNKNOWN_UNIT if path.startswith("tests/unit/") else UNKNOWN_OTHER


def pytest_collection_modifyitems(session, config, items):
    durations = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    index = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-file_cost(item.nodeid.split("::")[0], durations), index[item]))


_measured: Counter[str] = Counter()


def pytest_runtest_logreport(report):
    _measured[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("--write-durations") and not hasattr(session.config, "workerinput"):
        DURATIONS.write_text(json.dumps({f: round(s, 1) for f, s in _measured.most_common()}, indent=1) + "\n")
