"""``sync.average_moments`` on real nodes (issue 49): the moments' all-reduce keeps θ bit-identical.

Real `diloco-p2p train` processes on loopback, Muon inside. Honest nodes end every round with the
θ that `simulate` computes for their peer ids, so the moments travel and are applied as the
simulation's arithmetic says. With a hostile member sending its moments × 1000 (round 1) and NaN
moments (round 2), every round still commits with all three members and identical θ, the honest
members' moments are the mean of theirs, and the attacker is named in their logs and records.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from diloco_p2p.config import load_config
from diloco_p2p.planner.simulate import simulate
from diloco_p2p.swarm.transport.dht import peer_id_of
from tests.harness.settings import SWARM
from tests.harness.swarm import ProcessSwarm

pytestmark = pytest.mark.timeout(300)

OPTS = ["inner.optimizer=muon", "inner.muon_lr=0.01", "sync.average_moments=true", "sync.matchmaking_timeout=10"]


def _committed_together(nodes, rounds: int) -> None:
    for round_ in range(1, rounds + 1):
        records = [n.by_round()[round_] for n in nodes]
        assert {(r["status"], r["group_size"]) for r in records} == {("committed", len(nodes))}, records
        assert len({r["params_sha256"] for r in records}) == 1, records


def test_honest_nodes_average_their_moments_as_simulate_does(tmp_path):
    opts = [*OPTS, "train.max_rounds=3"]  # every check at its default: none drops an honest part here
    with ProcessSwarm(tmp_path) as swarm:
        nodes = [swarm.node(f"node-{i}", opts) for i in range(2)]
        swarm.release(*nodes)
        for node in nodes:
            assert node.wait(timeout=240) == 0, node.tail()
    _committed_together(nodes, 3)
    assert all(n.by_round()[r]["moments"] == "ok" for n in nodes for r in (1, 2, 3))
    keys = [peer_id_of(n.run_dir / "identity.key") for n in nodes]
    simulated = simulate(load_config(None, [*SWARM, *opts]), tmp_path / "sim", keys)
    assert [r.params_sha256 for r in simulated[keys[0]]] == [nodes[0].by_round()[r]["params_sha256"] for r in range(4)]


def test_a_member_sending_huge_then_nan_moments_is_refused_and_named_and_theta_stays_one(tmp_path):
    keep = "keep@average"
    opts = [*OPTS, "train.max_rounds=2"]
    with ProcessSwarm(tmp_path) as swarm:
        a, b = (swarm.node(name, opts, env={"DILOCO_P2P_FAULTS": keep}) for name in "ab")
        x = swarm.node("x", opts, env={"DILOCO_P2P_FAULTS": f"{keep},scale@moments:1,nan@moments:2"})
        swarm.release(a, b, x)
        for node in (a, b, x):
            assert node.wait(timeout=240) == 0, node.tail()
    _committed_together([a, b, x], 2)
    attacker = peer_id_of(x.run_dir / "identity.key")
    kept = {n: {r: load_file(str(node.run_dir / "moments" / "deltas" / f"round-{r:06d}.safetensors"))
                for r in (1, 2)} for n, node in {"a": a, "b": b, "x": x}.items()}
    for round_, reason in ((1, "norm"), (2, "malformed")):
        for node in (a, b):
            record = node.by_round()[round_]
            assert record["moments"] == "ok" and reason in record["rejections"][attacker], record
        # every member holds the same average, and it is the honest members' mean (fp16 on the wire)
        averages = [kept[n][round_]["average"] for n in "abx"]
        assert all(torch.equal(averages[0], avg) for avg in averages[1:])
        honest = (kept["a"][round_]["delta"] + kept["b"][round_]["delta"]) / 2
        assert (averages[0] - honest).abs().max() <= 2e-3 * honest.abs().max()
    assert not torch.isfinite(kept["x"][2]["delta"]).all()
    assert kept["x"][1]["delta"].abs().max() > 100 * kept["a"][1]["delta"].abs().max()
    for node in (a, b):
        log = node.output()
        assert f"refused peer {attacker}: norm" in log and f"refused peer {attacker}: malformed" in log, node.tail()
