"""benchmarks/swarm/churn.py's pure parts: the seeded fault schedule (churn.py), and what it makes of
round records (churn_report.py)."""

import importlib

import pytest


@pytest.fixture(scope="module")
def churn():
    return importlib.import_module("benchmarks.swarm.churn")


@pytest.fixture(scope="module")
def stats():
    return importlib.import_module("benchmarks.swarm.churn_report")


KINDS = ("kill", "stop", "term", "partition")


def test_the_schedule_is_a_function_of_the_seed(churn):
    a = churn.schedule(7, 4, 480, KINDS, (30, 60))
    assert a == churn.schedule(7, 4, 480, KINDS, (30, 60))
    assert a != churn.schedule(8, 4, 480, KINDS, (30, 60))
    assert len(a) >= 6  # 480 s at one fault every 30-60 s, each ending before the run does


@pytest.mark.parametrize("nodes,interval", [(4, (30, 60)), (8, (30, 60)), (2, (5, 10)), (3, (1, 4))])
def test_the_schedule_keeps_the_interval_and_never_hits_a_node_that_is_away(churn, nodes, interval):
    for seed in range(20):
        check_schedule(churn, seed, nodes, interval)


def check_schedule(churn, seed: int, nodes: int, interval: tuple[float, float], seconds: float = 480) -> None:
    faults = churn.schedule(seed, nodes, seconds, KINDS, interval)
    assert faults
    lo, hi = interval
    assert lo <= faults[0].at
    gaps = [b.at - a.at for a, b in zip(faults, faults[1:], strict=False)]
    # a draw that found every node away (or one too long to end in time) is dropped, so a gap is
    # whole multiples of the interval's draws, each within [lo, hi]
    assert all(g >= lo - 1e-6 for g in gaps), gaps
    if nodes >= 4 and lo >= 20:  # nobody is ever away a whole interval: no draw is dropped but at the end
        assert all(g <= hi + 1e-6 for g in gaps), gaps
    back = [0.0] * nodes
    for f in faults:
        assert f.kind in KINDS and sorted(f.order) == list(range(nodes))
        assert back[f.node] <= f.at, (f, back)
        assert f.node == next(i for i in f.order if back[i] <= f.at)  # the first free one in its order
        assert f.at + churn.LENGTH[f.kind] <= seconds  # every fault ends (restart, SIGCONT) within the run
        back[f.node] = f.at + f.away
    assert {f.kind for f in churn.schedule(seed, nodes, seconds, ("stop",), interval)} == {"stop"}


def test_a_restart_counts_the_time_to_rejoin_as_away(churn):
    kill = churn.Fault(10.0, "kill", 0, (0, 1))
    stop = churn.Fault(10.0, "stop", 0, (0, 1))
    assert kill.away == churn.LENGTH["kill"] + churn.REJOIN_S
    assert stop.away == churn.LENGTH["stop"]


def rec(node, rnd, status="committed", h="a", group=4, t=0.0, seconds=3.0, eval_loss=None):
    return {"t": t, "node": node, "round": rnd, "status": status, "params_sha256": h, "group_size": group,
            "seconds": seconds, "eval_loss": eval_loss}


def test_forks_and_disagreements_within_a_group(stats):
    seen = [
        *(rec(n, 1) for n in range(4)),  # one θ: no fork
        rec(0, 2, h="x", group=2), rec(1, 2, h="x", group=2), rec(2, 2, h="y", group=2), rec(3, 2, h="y", group=2),
        rec(0, 3, h="p", group=3), rec(1, 3, h="p", group=3), rec(2, 3, h="q", group=3),  # 3 + 3 > 4
        rec(0, 4), rec(1, 4, status="alone", h="solo", group=1), rec(2, 4, status="resynced", h="old", group=0),
    ]
    forked, disagree = stats.forks(seen, nodes=4)
    assert forked == [2, 3]  # round 2: two disjoint pairs (a split); round 3: a group of 3 that disagrees
    assert disagree == [3]


def test_summary_counts_goodput_inputs_and_round_times_while_a_node_is_away(stats):
    seen = [
        rec(0, 0, status="init", t=0.0, seconds=0.0),
        rec(0, 1, t=3, seconds=3.0), rec(1, 1, t=3, seconds=3.0),
        rec(1, 2, status="alone", h="b", group=1, t=20, seconds=9.0),  # n0 away: the other's round is slow
        rec(0, 2, status="resynced", h="c", group=0, t=31, seconds=1.0),
        rec(0, 3, h="d", group=2, t=35, seconds=4.0, eval_loss=2.5), rec(1, 3, h="d", group=2, t=36, seconds=4.0,
                                                                            eval_loss=2.7),
    ]
    log = [{"kind": "kill", "node": 0, "fired": 5.0, "ended": 15.0, "back": 35.0},
           {"kind": "stop", "node": None, "fired": None, "skipped": "every node away or down"}]
    s = stats.summarize(seen, nodes=2, seconds=60, log=log)
    assert (s["committed"], s["highest_round"], s["resyncs"], s["alone"]) == (4, 3, 1, 1)
    assert s["forks"] == [] and s["eval_loss"] == pytest.approx(2.6)
    assert (s["faults"], s["faults_skipped"], s["restarts"]) == (1, 1, 1)
    assert s["median_round_s_others_while_away"] == 9.0  # n1's rounds in [5, 35]: the alone one only
    assert s["median_round_s_nobody_away"] == 3.0
    assert stats.progress(seen) == [(0.0, 0), (3, 1), (35, 3)]


def test_a_restart_failed_if_its_process_exited_or_it_never_came_back(stats):
    late = stats.RESTART_FAILED_S + 1
    assert stats.restart_failed({"ended": 10.0, "back": 30.0}, end=480) is False
    assert stats.restart_failed({"ended": 10.0, "back": 10.0 + late}, end=480) is True
    assert stats.restart_failed({"ended": 10.0, "back": None, "exit_code_after_restart": 1}, end=480) is True
    assert stats.restart_failed({"ended": 10.0, "back": None}, end=10.0 + late) is True
    assert stats.restart_failed({"ended": 470.0, "back": None}, end=480) is None  # the run ended first
