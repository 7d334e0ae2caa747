"""A real 3-node swarm and `simulate` with the swarm's peer ids as order keys: the same θ every round.

The swarm follows a sync schedule (`diloco_p2p.config.schedule`: H doubling from 1, the outer step's
η and β warming up), so every round of it is shown to end with the same θ on every member and in
`simulate`, whatever H, η and β the round has.

The swarm runs with the default `sync.target_group_size` (16, never reached) and a long
`sync.matchmaking_timeout`: its groups must close because every live node has joined, not at the
timeout (matchmaking reads who is at the round from the progress records).
"""

from __future__ import annotations

import pytest

from diloco_p2p.config import load_config
from diloco_p2p.config.schedule import rounds
from diloco_p2p.planner.simulate import simulate, wire_average
from diloco_p2p.swarm.transport.dht import peer_id_of
from tests.harness.settings import SWARM
from tests.harness.swarm import ProcessSwarm

PLANNED = 3  # rounds of H = 5: 15 inner steps, run as H = 1, 2, 4, 5, 3
TIMEOUT = 30.0
OVERRIDES = [f"train.max_rounds={PLANNED}", f"sync.matchmaking_timeout={TIMEOUT}", "outer.h_schedule=ramp",
             "outer.warmup_rounds=3", "outer.lr_start=1.0"]
ROUNDS = rounds(load_config(None, [*SWARM, *OVERRIDES]).outer, PLANNED)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with ProcessSwarm(tmp_path_factory.mktemp("sim-swarm")) as swarm:
        nodes = [swarm.node(f"node-{i}", OVERRIDES) for i in range(3)]
        swarm.release(*nodes)
        for node in nodes:
            assert node.wait(timeout=240) == 0, node.tail()
        yield nodes


def test_three_node_rounds_close_when_the_swarm_is_in_not_at_the_timeout(swarm):
    for node in swarm:
        for round_ in range(1, ROUNDS + 1):
            r = node.by_round()[round_]
            assert (r["status"], r["group_size"]) == ("committed", 3), r
            # at most 5 tiny inner steps, an all-reduce and an eval take about a second; the timeout is 30 s
            assert r["seconds"] < TIMEOUT / 3, f"round {round_} took {r['seconds']:.1f}s: it waited for the timeout"


def test_simulated_replicas_with_the_swarms_order_keys_end_every_round_with_its_params(swarm, tmp_path):
    keys = [peer_id_of(node.run_dir / "identity.key") for node in swarm]
    config = load_config(None, [*SWARM, *OVERRIDES])
    simulated = simulate(config, tmp_path, keys)
    swarm_hashes = [[node.by_round()[r]["params_sha256"] for r in range(ROUNDS + 1)] for node in swarm]
    assert all(h == swarm_hashes[0] for h in swarm_hashes)
    assert ROUNDS == 5 and [swarm[0].by_round()[r]["step"] for r in range(1, ROUNDS + 1)] == [1, 3, 7, 12, 15]
    for key in keys:
        assert [r.params_sha256 for r in simulated[key]] == swarm_hashes[0]
        assert [r.group_size for r in simulated[key][1:]] == [3] * ROUNDS
    # the order keys matter: other keys give other data, hence another θ after round 1
    other = simulate(config, tmp_path / "other", ["a", "b", "c"])
    assert other["a"][1].params_sha256 != swarm_hashes[0][1]


def test_wire_average_is_the_token_weighted_mean_rounded_as_on_the_wire():
    import torch

    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(70_001, generator=g) for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    exact = sum(w * d for w, d in zip(weights, deltas, strict=True)) / sum(weights)
    fp32 = wire_average(deltas, weights, "fp32", 64.0, chunk=1000)
    assert torch.allclose(fp32, exact, atol=1e-6)
    fp16 = wire_average(deltas, weights, "fp16", 64.0, chunk=1000)
    assert torch.equal(fp16, fp16.half().float()) and not torch.equal(fp16, fp32)
    assert (fp16 - exact).abs().max() < 1e-2
    # an absurd weight is refused on every part, as the all-reduce's reducers refuse it
    heavy = wire_average(deltas, [1.0, 1.0, 1e6], "fp32", 64.0, chunk=1000)
    assert torch.allclose(heavy, (deltas[0] + deltas[1]) / 2, atol=1e-6)
