"""Shared fixtures: small CPU settings and a reaper for child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

# Before hivemind is imported: its default tensor sharing strategy aborts pytest at exit
# ("terminate called ... Broken pipe") once several DHTs have come and gone in one process.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# Overrides that make any run tiny: a few hundred thousand parameters, a 300 kB corpus slice.
TINY = [
    "model.preset=tiny", "data.max_bytes=300000", "inner.batch_size=4", "inner.seq_len=64",
    "inner.warmup_steps=2", "inner.lr=0.003", "outer.inner_steps=5", "train.max_rounds=4",
    "train.eval_batches=2", "train.num_threads=1",
]


def set_args(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def run_cli(args: list[str], timeout: float = 240, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "diloco_p2p", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kwargs)


@pytest.fixture(scope="session", autouse=True)
def reap_children():
    """Kill whatever child processes a test left behind (p2pd daemons, nodes)."""
    yield
    try:
        out = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
