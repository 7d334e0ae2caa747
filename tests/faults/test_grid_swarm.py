"""Six real nodes with `sync.target_group_size=3`: every round is one group of the whole swarm,
averaged on a 2 x 3 grid (`diloco_p2p.swarm.collective.hierarchy`), and one node SIGKILLed in the middle of
round 2's all-reduce (right after its row scatter) changes nothing of that for the five others.
The victim has the smallest peer id, so it is member 0 of the ordered membership: index 0 of row
0, the reducer of part 0 of its row's agreement step (it died with a third of the runs before the
mask was copied into every part of that step: peer ids were random).

Before issue 17 these six nodes formed two groups of three every round, which forked θ into two
lineages that resynced into each other. Now: every node holds the same `params_sha256` after
every round, no round of any node is `resynced`, and round 1's applied average is the token-
weighted mean of the six nodes' Δ (saved by `keep@average`), recomputed here.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from diloco_p2p.swarm.transport.dht import load_or_create_identity, peer_id_of
from tests.harness.swarm import ProcessSwarm

ROUNDS = 3
OVERRIDES = [f"train.max_rounds={ROUNDS}", "sync.target_group_size=3", "sync.matchmaking_timeout=12",
             "sync.allreduce_timeout=30", "outer.inner_steps=3"]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    root = tmp_path_factory.mktemp("grid")
    _identities(root, ["victim", *(f"node-{i}" for i in range(5))])
    with ProcessSwarm(root) as swarm:
        keep = {"DILOCO_P2P_FAULTS": "keep@average"}
        nodes = [swarm.node(f"node-{i}", OVERRIDES, env=keep) for i in range(5)]
        victim = swarm.node("victim", OVERRIDES, env={"DILOCO_P2P_FAULTS": "keep@average,kill@allreduce:2"})
        swarm.release(*nodes, victim)
        assert victim.wait(timeout=240) == -signal.SIGKILL, victim.tail()
        for node in nodes:
            assert node.wait(timeout=240) == 0, node.tail()
        yield nodes, victim


def _identities(root: Path, names: list[str]) -> None:
    """An identity key in each node's run directory, the first name's the smallest peer id (the
    membership is ordered by peer id, and the grid's rows are contiguous runs of it)."""
    keys = [load_or_create_identity(root / "keys" / f"{i}.key") for i in range(len(names))]
    for name, key in zip(names, sorted(keys, key=lambda k: peer_id_of(k)), strict=True):
        (root / name).mkdir()
        os.replace(key, root / name / "identity.key")


def test_one_theta_every_round_and_nobody_resyncs(grid):
    nodes, victim = grid
    for round_ in range(ROUNDS + 1):
        hashes = {n.by_round()[round_]["params_sha256"] for n in nodes}
        assert len(hashes) == 1, f"round {round_}: {hashes}"
    assert victim.by_round()[1]["params_sha256"] == nodes[0].by_round()[1]["params_sha256"]
    for node in nodes:
        assert all(r["status"] != "resynced" for r in node.records()), [r["status"] for r in node.records()]
        records = node.by_round()
        # Round 1: all six in one group, on the grid (3 intervals: a butterfly of six would have 6 parts).
        assert (records[1]["status"], records[1]["group_size"], records[1]["parts"]) == ("committed", 6, 3)
        assert records[1]["parts_committed"] == 3
        # Round 2: the victim died after its scatter; its part is dropped on every survivor alike, or
        # it reached its row before the kill. Round 3: the five others, one group, rows of 3 and 2.
        assert (records[2]["status"], records[2]["group_size"], records[2]["contributors"]) == ("committed", 6, 6)
        assert (records[3]["status"], records[3]["group_size"], records[3]["contributors"]) == ("committed", 5, 5)
        assert records[1]["contributors"] == 6 and records[2]["dropped_peers"] == 0
        assert records[3]["parts_committed"] == records[3]["parts"]
    assert len({n.by_round()[2]["parts_committed"] for n in nodes}) == 1


def _saved(node, round_: int) -> tuple[torch.Tensor, torch.Tensor, float, list[str]]:
    with safe_open(str(node.run_dir / "deltas" / f"round-{round_:06d}.safetensors"), "pt") as f:
        meta = f.metadata()
        return f.get_tensor("delta"), f.get_tensor("average"), float(meta["weight"]), json.loads(meta["contributors"])


def test_round_one_average_is_the_weighted_mean_of_all_six(grid):
    """Round 1 on the grid is the token-weighted mean of the six Δ: each rounded to fp16 once, the
    row means once more, the column mean once more (three roundings where the butterfly has two)."""
    nodes, victim = grid
    saved = [_saved(n, 1) for n in [*nodes, victim]]
    average = saved[0][1]
    assert all(torch.equal(s[1], average) for s in saved), "members applied different averages"
    assert all(len(s[3]) == 6 for s in saved)
    total = sum(w for _, _, w, _ in saved)
    expected = sum(w * d.double() for d, _, w, _ in saved) / total
    eps, tiny = 2.0**-11, 1e-7  # fp16 unit roundoff; its subnormal spacing (and a margin)
    magnitude = sum(w * d.double().abs() for d, _, w, _ in saved) / total
    error = (average.double() - expected).abs()
    assert (error <= eps * (2 * magnitude + expected.abs()) + tiny).all(), error.max()
    for delta, _, _, _ in saved:  # the check can fail: the average is far from any one node's Δ
        assert (delta.double() - expected).abs().max() > 50 * error.max()
