"""`diloco-p2p demo`, the README's main command: it trains, summarizes, and leaves nothing behind."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import reaping
from tests.harness.procs import child_env

FAST = ["--set", "outer.inner_steps=5", "--set", "data.max_bytes=300000"]


@contextlib.contextmanager
def _demo(root: Path, *args: str, sigint_ignored: bool = False) -> Iterator[subprocess.Popen]:
    """The demo as a child; whatever it started is killed when the test ends, also on failure."""
    token = reaping.new_token()
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.Popen([sys.executable, "-m", "diloco_p2p", "demo", "--dir", str(root), *args, *FAST],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(None, token), preexec_fn=ignore)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        reaping.reap_marked(reaping.PROC_VAR, token)


def _left_behind(root: Path) -> list[str]:
    """Processes whose command line names the demo's directory (seed, nodes)."""
    out = subprocess.run(["pgrep", "-af", str(root)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_demo_trains_a_swarm_and_reports_agreement(tmp_path):
    with _demo(tmp_path, "--nodes", "2", "--rounds", "2") as proc:
        out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("round ")] == ["round 0", "round 1", "round 2"]
    summary = next(line for line in lines if line.startswith("summary:"))
    assert "2 rounds on 2 nodes" in summary and "identical on every node every round" in summary
    start, end = (float(x) for x in summary.split("eval loss ")[1].split(";")[0].split(" -> "))
    assert end < start - 1.0  # it learned
    assert _left_behind(tmp_path) == []


@pytest.mark.parametrize("sig, sigint_ignored", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c-with-sigint-ignored-at-start", "sigterm"])
def test_ctrl_c_or_sigterm_stops_every_process_the_demo_started(tmp_path, sig, sigint_ignored):
    """Started with SIGINT ignored (a background job of a non-interactive shell), Ctrl+C must still
    stop the demo; SIGTERM must stop what it started before it exits."""
    with _demo(tmp_path, "--nodes", "2", "--rounds", "50", sigint_ignored=sigint_ignored) as proc:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # wait until the nodes are training: round 0 is reported
            seen.append(line)
            if line.startswith("round 0"):
                break
        assert seen and seen[-1].startswith("round 0"), "".join(seen)
        assert len(_left_behind(tmp_path)) >= 3  # the seed and two nodes are running
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 128 + sig, out
        assert f"interrupted ({sig.name})" in out
        deadline = time.monotonic() + 10
        while _left_behind(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _left_behind(tmp_path) == []
