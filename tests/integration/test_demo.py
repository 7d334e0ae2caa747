"""`diloco-p2p demo`, the README's main command: it trains, summarizes, and leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FAST = ["--set", "outer.inner_steps=5", "--set", "data.max_bytes=300000"]


def _demo(root: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "diloco_p2p", "demo", "--dir", str(root), *args, *FAST],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _left_behind(root: Path) -> list[str]:
    """Processes whose command line names the demo's directory (seed, nodes)."""
    out = subprocess.run(["pgrep", "-af", str(root)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_demo_trains_a_swarm_and_reports_agreement(tmp_path):
    proc = _demo(tmp_path, "--nodes", "2", "--rounds", "2")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("round ")] == ["round 0", "round 1", "round 2"]
    summary = next(line for line in lines if line.startswith("summary:"))
    assert "2 rounds on 2 nodes" in summary and "identical on every node every round" in summary
    start, end = (float(x) for x in summary.split("eval loss ")[1].split(";")[0].split(" -> "))
    assert end < start - 1.0  # it learned
    assert _left_behind(tmp_path) == []


def test_ctrl_c_stops_every_process_the_demo_started(tmp_path):
    proc = _demo(tmp_path, "--nodes", "2", "--rounds", "50")
    assert proc.stdout is not None
    for line in proc.stdout:  # wait until the nodes are training: round 0 is reported
        if line.startswith("round 0"):
            break
    assert len(_left_behind(tmp_path)) >= 3  # the seed and two nodes are running
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, out
    assert "interrupted" in out
    deadline = time.monotonic() + 10
    while _left_behind(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _left_behind(tmp_path) == []
