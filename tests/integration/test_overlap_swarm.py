"""Two real nodes with ``sync.overlap: eager`` on loopback: the global θ agrees every round, and
each round's all-reduce runs in the background while the next round computes.

Node `fast` does 1/32 of `slow`'s work per inner step, so in every round it reaches the
all-reduce long before `slow` and its averaging (waiting for `slow` in matchmaking, then the
all-reduce) is still under way when its next round's inner steps start: the phase timestamps of
its round records show the overlap structurally, with no threshold on seconds.
"""

from __future__ import annotations

import pytest

from tests.harness.swarm import ProcessSwarm

ROUNDS = 4


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with ProcessSwarm(tmp_path_factory.mktemp("overlap")) as swarm:
        common = [f"train.max_rounds={ROUNDS}", "sync.overlap=eager", "sync.target_group_size=2",
                  "sync.matchmaking_timeout=20", "outer.inner_steps=4"]
        fast = swarm.node("fast", [*common, "inner.batch_size=1"])
        slow = swarm.node("slow", [*common, "inner.batch_size=8", "inner.grad_accum=4"])  # 32x the work
        swarm.wait_joined(fast, slow)
        swarm.release(fast, slow)
        for node in (fast, slow):
            assert node.wait(timeout=180) == 0, node.tail()
        yield fast.by_round(), slow.by_round()


def test_members_hold_the_same_global_theta_every_round(swarm):
    fast, slow = swarm
    for round_ in range(ROUNDS + 1):
        assert fast[round_]["params_sha256"] == slow[round_]["params_sha256"], f"round {round_}"
    assert len({fast[r]["params_sha256"] for r in range(ROUNDS + 1)}) == ROUNDS  # θ moved (round 1 applies none)
    for records in (fast, slow):
        assert [records[r]["applied_round"] for r in range(1, ROUNDS + 1)] == [None, 1, 2, ROUNDS]
        assert [records[r]["status"] for r in range(2, ROUNDS + 1)] == ["committed"] * (ROUNDS - 1)
        assert all(records[r]["group_size"] == 2 and records[r]["overlap"] == "eager" for r in range(2, ROUNDS + 1))


def test_the_all_reduce_runs_behind_the_next_rounds_compute(swarm):
    fast, slow = swarm
    for records in (fast, slow):
        for r in range(2, ROUNDS):  # the rounds that applied the previous round's average
            p, exposed = records[r]["phases"], records[r]["exposed_seconds"]
            assert p["average_start"] < p["compute_start"] < p["compute_end"], (r, p)
            span = p["average_done"] - p["average_start"]
            assert exposed < span and records[r]["allreduce_seconds"] > 0, (r, exposed, p)
    for r in range(2, ROUNDS):
        p = fast[r]["phases"]
        # Still averaging when the next round's inner steps began: communication behind compute.
        assert p["average_start"] < p["compute_start"] < p["average_done"], (r, p)
