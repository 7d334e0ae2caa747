"""The fault-injection spec the fault tests depend on (`tests.faults.injection`): a misspelt item
must fail loudly, a planned fault must fire exactly once at its point and round, and the start gate
must hold until released. The product's hook points (`diloco_p2p.faults`) do nothing."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from diloco_p2p import faults as hooks
from tests.faults.injection import GATE_ENV, PlannedFaults, wait_at_start_gate
from tests.harness.procs import REPO


def test_spec_parses_every_item():
    faults = PlannedFaults(" kill@allreduce:2, nan@delta:3 ,hold@group:10,exit@rank1.step:7,")
    assert faults.pending == {("kill", "allreduce", 2), ("nan", "delta", 3), ("hold", "group", 10),
                              ("exit", "rank1.step", 7)}


def test_empty_spec_plans_nothing(monkeypatch):
    monkeypatch.delenv("DILOCO_P2P_FAULTS", raising=False)
    assert PlannedFaults().pending == set()
    assert PlannedFaults("").pending == set()


@pytest.mark.parametrize("item", [
    "kill@allreduce",           # no round
    "kill@allreduce:two",       # round not a number
    "kill@allreduce:-1",
    "crash@allreduce:2",        # unknown action
    "kill@all_reduce:2",        # misspelt point: would never fire
    "kill@rank.step:2",
    "kill:2",                   # no point
    "nan@allreduce:2",          # nan only poisons the pseudo-gradient
    "flip@reduce:2",            # a flip is a contribution's lie
    "split@delta:2",            # a split is a reducer's lie
    "kill@reduce:2",            # reduce is a point of the lies only
])
def test_bad_items_are_refused_by_name(item):
    with pytest.raises(ValueError, match=f"bad item '{item}'"):
        PlannedFaults(f"stop@group:1,{item}")


def test_lies_happen_at_their_round_once():
    faults = PlannedFaults("flip@delta:1,scale@delta:2,scale@reduce:3,split@reduce:4")
    assert faults.lies_as_reducer and not PlannedFaults("flip@delta:1").lies_as_reducer
    delta = torch.tensor([1.0, -2.0])
    assert faults.lie(3, delta, 10.0, 16.0) == (delta, 10.0)  # nothing planned for round 3's Δ
    flipped, weight = faults.lie(1, delta, 10.0, 16.0)
    assert torch.equal(flipped, -delta) and weight == pytest.approx(0.999 * 16 * 10)
    scaled, weight = faults.lie(2, delta, 10.0, 16.0)
    assert torch.equal(scaled, delta * 1000) and weight == 10.0
    assert faults.lie(1, delta, 10.0, 16.0)[1] == 10.0  # spent
    assert [faults.reducer_lie(r) for r in (1, 2, 3, 4, 3)] == [None, None, "scale-output", "split-output", None]
    assert faults.pending == set()


def test_spec_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("DILOCO_P2P_FAULTS", "stop@group:4")
    assert PlannedFaults().pending == {("stop", "group", 4)}


def test_fire_only_at_its_point_and_round_and_only_once():
    faults = PlannedFaults("exit@group:2")
    faults.fire("group", 1)
    faults.fire("allreduce", 2)
    with pytest.raises(SystemExit) as exited:
        faults.fire("group", 2)
    assert exited.value.code == 3
    faults.fire("group", 2)  # spent: nothing happens the second time
    assert faults.pending == set()


def test_poison_returns_a_nan_copy_once():
    faults = PlannedFaults("nan@delta:2")
    delta = torch.ones(20)
    assert faults.poison("delta", 1, delta) is delta
    poisoned = faults.poison("delta", 2, delta)
    assert torch.isnan(poisoned).any() and not torch.isnan(poisoned).all()
    assert torch.equal(delta, torch.ones(20))  # the caller's tensor is untouched
    assert faults.poison("delta", 2, delta) is delta
    # a process-level fault at the same point is not consumed by poison, and vice versa
    faults = PlannedFaults("nan@delta:2,exit@delta:2")
    faults.poison("delta", 2, delta)
    assert faults.pending == {("exit", "delta", 2)}


def test_kill_is_a_real_sigkill():
    code = "from tests.faults.injection import PlannedFaults; PlannedFaults('kill@delta:1').fire('delta', 1); print('survived')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == -signal.SIGKILL
    assert "survived" not in result.stdout


def test_start_gate_waits_for_the_gate_file(tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(gate))
    passed = threading.Event()
    waiter = threading.Thread(target=lambda: (wait_at_start_gate(timeout=30), passed.set()))
    waiter.start()
    deadline = time.monotonic() + 30
    while not list(tmp_path.glob("gate.ready-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(tmp_path.glob("gate.ready-*")), "the waiter never said it was ready"
    assert not passed.is_set()
    gate.touch()
    waiter.join(timeout=30)
    assert passed.is_set()


def test_start_gate_times_out_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv(GATE_ENV, str(tmp_path / "never"))
    with pytest.raises(SystemExit, match="did not appear within 0.2 s"):
        wait_at_start_gate(timeout=0.2)


def test_no_gate_returns_at_once(monkeypatch):
    monkeypatch.delenv(GATE_ENV, raising=False)
    wait_at_start_gate(timeout=0)


def test_a_reducer_lie_reduces_with_the_lying_all_reduce(monkeypatch):
    class Honest:
        pass

    class Lying(Honest):
        lie = None

    monkeypatch.setattr(PlannedFaults, "lying_reducer", Lying)
    assert PlannedFaults("flip@delta:1").reducer(Honest) is Honest
    planned = PlannedFaults("scale@reduce:3")
    service = planned.reducer(Honest)()
    lies = []
    for round_ in (2, 3, 4):
        planned.arm_reducer(service, round_)
        lies.append(service.lie)
    assert lies == [None, "scale-output", None]


def test_the_product_hooks_do_nothing_until_a_test_entry_installs_its_faults(monkeypatch):
    quiet, delta = hooks.make_faults(), torch.ones(3)
    assert type(quiet) is hooks.Faults
    quiet.start_gate()
    quiet.fire("allreduce", 1)
    assert quiet.poison("delta", 1, delta) is delta and quiet.lie(1, delta, 2.0, 16.0) == (delta, 2.0)
    assert quiet.reducer(int) is int
    planned = PlannedFaults("nan@delta:1")
    monkeypatch.setattr(hooks, "_factory", hooks._factory)  # undone after the test
    hooks.install(lambda: planned)  # as `python -m tests.faults.node` does
    assert hooks.make_faults() is planned
