"""Per-round bandwidth and utilization numbers (issue: bytes at line rate, hidden behind compute):
the record carries compute and exposed seconds, utilization and the wire-time ratio, and
Prometheus exports them."""

from __future__ import annotations

import time

import pytest

from diloco_p2p.config import load_config
from diloco_p2p.contract import RoundOutcome
from diloco_p2p.loop.metrics import NodeMetrics, process_start_time
from diloco_p2p.swarm.sync import SwarmSync
from tests.unit.test_metrics import value as sample
from tests.unit.test_node import ScriptedSync, _node


def test_the_round_record_splits_compute_from_exposed_communication(tmp_path):
    def slow_average(delta):
        time.sleep(0.3)  # the swarm took 0.3 s: the loop stood still that long
        return RoundOutcome(status="committed", average=delta, group_size=2, allreduce_seconds=0.2,
                            bytes_sent=1000, bytes_received=1000)

    records = _node(tmp_path, ScriptedSync({1: slow_average}), rounds=1).run()
    last = records[-1].as_dict()
    assert last["exposed_seconds"] >= 0.3 and last["compute_seconds"] > 0
    assert last["compute_seconds"] + last["exposed_seconds"] <= last["seconds"]
    assert abs(last["utilization"] - last["compute_seconds"] / last["seconds"]) < 1e-12
    assert records[0].utilization is None  # round 0 (init) computed nothing


def test_wire_ratio_needs_the_declared_link():
    class Stub:
        guard = type("G", (), {"drain": staticmethod(lambda: {})})()
        _liveness: dict = {}

    outcome = RoundOutcome(status="committed", allreduce_seconds=2.0, bytes_sent=2_500_000)  # 20 Mbit in 1 s
    stub = Stub()
    stub.cfg = load_config(None, ["sync.link_mbit=20"]).sync
    assert SwarmSync._seen(stub, outcome).wire_ratio == 2.0
    stub.cfg = load_config(None, []).sync
    assert SwarmSync._seen(stub, RoundOutcome(status="committed", bytes_sent=5, allreduce_seconds=1)).wire_ratio is None


def test_prometheus_exports_exposed_seconds_utilization_and_wire_ratio():
    m = NodeMetrics()
    assert sample(m, "diloco_compute_utilization_ratio") != sample(m, "diloco_compute_utilization_ratio")  # NaN
    assert sample(m, "diloco_outer_step_seconds") != sample(m, "diloco_outer_step_seconds")  # NaN
    m.observe_round({"round": 1, "status": "committed", "exposed_seconds": 1.5, "utilization": 0.75,
                     "wire_ratio": 1.1, "outer_seconds": 0.25})
    assert sample(m, "diloco_exposed_sync_seconds") == 1.5
    assert sample(m, "diloco_outer_step_seconds") == 0.25
    assert sample(m, "diloco_compute_utilization_ratio") == 0.75
    assert sample(m, "diloco_allreduce_wire_time_ratio") == 1.1


def test_the_first_committed_round_of_a_process_says_how_long_it_took_to_be_back(tmp_path):
    """A (re)started node's time to be back in the swarm: on its first committed round only,
    the seconds since its process started (a round alone before that does not count)."""
    def committed(delta):
        return RoundOutcome(status="committed", average=delta, group_size=2)

    metrics = NodeMetrics()
    node = _node(tmp_path, ScriptedSync({2: committed, 3: committed}), rounds=3)
    node.round_log.metrics = metrics  # what Node(..., metrics=) hands it
    records = {r.round: r for r in node.run()}
    assert records[1].status == "alone" and records[1].first_commit_seconds is None
    assert 0 < records[2].first_commit_seconds <= time.time() - process_start_time()
    assert records[3].first_commit_seconds is None
    assert sample(metrics, "diloco_first_commit_seconds") == pytest.approx(records[2].first_commit_seconds)
