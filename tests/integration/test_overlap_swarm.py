"""Real nodes with ``sync.overlap: eager`` on loopback: the global θ agrees every round and each
round's all-reduce runs in the background while the next round computes. Under ``inner`` (the
average lands once known, τ steps into the next round; the pipeline and the served state are
eager's) with ``sync.fragments: 2`` (each round averages half of the parameters, Streaming
DiLoCo) a node that joins mid-run takes the average in flight (of its round's half) with the state
and ends every round with the members' θ.

Node `fast` does 1/128 of `slow`'s work per inner step, so in every round it reaches the
all-reduce long before `slow` and its averaging (waiting for `slow` in matchmaking, then the
all-reduce) is still under way when its next round's inner steps start: the phase timestamps of
its round records show the overlap structurally, with no threshold on seconds.
"""

from __future__ import annotations

import pytest

from tests.harness.procs import wait_until
from tests.harness.swarm import ProcessSwarm

ROUNDS = 4


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with ProcessSwarm(tmp_path_factory.mktemp("overlap")) as swarm:
        common = [f"train.max_rounds={ROUNDS}", "sync.overlap=eager", "sync.target_group_size=2",
                  "sync.matchmaking_timeout=20", "outer.inner_steps=4"]
        fast = swarm.node("fast", [*common, "inner.batch_size=1"])
        # 128x the work: at 32x a loaded machine once let `slow` reach the all-reduce before `fast` had
        # finished its round's eval, so the average was done before the next inner steps began.
        slow = swarm.node("slow", [*common, "inner.batch_size=16", "inner.grad_accum=8"])
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
    clocks = 0.01  # time.time against perf_counter over a few seconds
    for records in (fast, slow):
        for r in range(2, ROUNDS):  # the rounds that applied the previous round's average
            p, exposed = records[r]["phases"], records[r]["exposed_seconds"]
            assert p["average_start"] < p["compute_start"] < p["compute_end"] <= p["resumed"], (r, p)
            # The loop stood still from compute_end to resumed at most: the part of the average
            # that ran behind this round's compute is never counted as exposed.
            assert 0 <= exposed <= p["resumed"] - p["compute_end"] + clocks, (r, exposed, p)
            assert records[r]["allreduce_seconds"] > 0, (r, records[r])
    for r in range(2, ROUNDS):
        p, exposed = fast[r]["phases"], fast[r]["exposed_seconds"]
        # Still averaging when the next round's inner steps began: communication behind compute.
        assert p["average_start"] < p["compute_start"] < p["average_done"], (r, p)
        # ... and the wait for it past compute_end is exposed.
        assert exposed >= p["average_done"] - p["compute_end"] - clocks, (r, exposed, p)


JOIN_ROUNDS = 7


@pytest.fixture(scope="module")
def joined(tmp_path_factory):
    """Two inner nodes of two fragments, and a third that joins while the others' round-2+ averages
    are in flight."""
    with ProcessSwarm(tmp_path_factory.mktemp("overlap-join")) as swarm:
        common = [f"train.max_rounds={JOIN_ROUNDS}", "sync.overlap=inner", "sync.fragments=2", "sync.target_group_size=3",
                  "sync.matchmaking_timeout=10", "outer.inner_steps=4", "inner.batch_size=4"]
        a, b = swarm.node("a", common), swarm.node("b", common)
        late_gate = swarm.root / "late-gate"  # the late node is built and in the DHT, then waits here
        late = swarm.node("late", common, env={"DILOCO_P2P_START_GATE": str(late_gate)})
        swarm.wait_joined(a, b)
        wait_until(lambda: any(swarm.root.glob("late-gate.ready-*")), 120, "the late node to join", late)
        swarm.release(a, b)
        a.wait_round(2)
        late_gate.touch()
        for node in (a, b, late):
            assert node.wait(timeout=240) == 0, node.tail()
        yield a.by_round(), b.by_round(), late.records()


def test_a_joiner_takes_the_average_in_flight_and_ends_with_the_swarms_theta(joined):
    a, b, late = joined
    assert all(a[r]["params_sha256"] == b[r]["params_sha256"] for r in range(JOIN_ROUNDS + 1))
    joins = [r for r in late if r["status"] == "resynced"]
    assert joins and joins[0]["joined_at_round"] is not None, late
    last = {r["round"]: r for r in late}
    assert last[JOIN_ROUNDS]["params_sha256"] == a[JOIN_ROUNDS]["params_sha256"]
    # After its join the late node trained rounds in the members' groups with their θ.
    trained = [r for r in late if r["status"] == "committed" and r["round"] < JOIN_ROUNDS]
    assert trained and all(r["params_sha256"] == a[r["round"]]["params_sha256"] for r in trained)
    assert trained[0]["applied_round"] == joins[0]["round"]  # the members' average in flight, from the state
    for records in (a.values(), b.values(), trained):  # each round averaged its half: parts 0, 1, 0, ...
        assert all(r["fragment"] == (r["round"] - 1) % 2 for r in records if r["status"] == "committed")
    for records in (a.values(), b.values(), late):  # where each node's averages landed: its own τ
        steps = [r["landed_step"] for r in records if r.get("landed_step") is not None]
        assert steps and all(1 <= s <= 3 for s in steps), steps
