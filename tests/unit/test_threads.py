"""train.num_threads unset: the cores are shared among the training processes on the machine."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from diloco_p2p.local.threads import ThreadBudget, usable_cores


def test_unset_threads_share_the_cores_among_live_training_processes(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr("diloco_p2p.local.threads.usable_cores", lambda: 4)
    # Two other live processes of our own (not our parent: it may be pid 1 when pytest was detached).
    others = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        budget = ThreadBudget(None, registry=tmp_path)
        assert budget.threads() == 4 and torch.get_num_threads() == 4  # alone on 4 cores
        (tmp_path / str(others[0].pid)).touch()  # another live training process
        assert budget.apply() == 2 and torch.get_num_threads() == 2
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        (tmp_path / str(dead.pid)).touch()  # one that died without cleaning up: not counted, removed
        for _ in range(3):
            (tmp_path / str(others[0].pid)).touch()
        assert budget.threads() == 2 and not (tmp_path / str(dead.pid)).exists()
        other = ThreadBudget(None, registry=tmp_path)  # the same process again: one entry
        assert other.threads() == 2
        (tmp_path / str(others[1].pid)).touch()  # a third: 4 // 3
        assert budget.threads() == 1
        budget.close()
        assert not (tmp_path / str(os.getpid())).exists()
        assert ThreadBudget(3, registry=tmp_path / "unused").threads() == 3  # a set value wins
        assert not (tmp_path / "unused").exists()
    finally:
        torch.set_num_threads(before)
        for p in others:
            p.kill()
            p.wait()
    assert usable_cores() >= 1
