"""Two real nodes and a seed on loopback with ``sync.compression: topk2`` (sparse all-gather,
error feedback on by default) and the setting docs/recipes.md recommends for it (decaying feedback
whose residual the nodes' models half keep, outer lr 2, no outer momentum): the same θ every
round, and the θ `simulate` reaches with the nodes' peer ids (so its quality sweeps are this
swarm's), the applied average is the mean of the offered Δ + β·e as every member decodes them,
the bytes are >= 50x below the fp16 butterfly, and the error-feedback buffer in the last
checkpoint is what the last round did not send.

The nodes save each round's offered Δ and the average they applied (keep@average).
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diloco_p2p.config import load_config
from diloco_p2p.loop.error_feedback import sent_values
from diloco_p2p.planner.simulate import simulate
from diloco_p2p.swarm.collective import codecs, wire
from diloco_p2p.swarm.transport.dht import peer_id_of
from tests.harness.settings import SWARM
from tests.harness.swarm import ProcessSwarm

ROUNDS = 3
DENSITY = 0.01
OVERRIDES = [f"train.max_rounds={ROUNDS}", "sync.target_group_size=2", "sync.matchmaking_timeout=20",
             "sync.compression=topk2", f"sync.topk_density={DENSITY}", f"train.checkpoint_every={ROUNDS}",
             "sync.feedback_decay=0.9", "sync.feedback_carry=0.5", "outer.lr=2.0", "outer.momentum=0"]


def _saved(node, round_: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    with safe_open(str(node.run_dir / "deltas" / f"round-{round_:06d}.safetensors"), "pt") as f:
        return f.get_tensor("delta"), f.get_tensor("average"), float(f.metadata()["weight"])


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with ProcessSwarm(tmp_path_factory.mktemp("compress-swarm")) as swarm:
        nodes = [swarm.node(f"node-{i}", OVERRIDES, env={"DILOCO_P2P_FAULTS": "keep@average"}) for i in range(2)]
        swarm.wait_joined(*nodes)
        swarm.release(*nodes)
        for node in nodes:
            assert node.wait(timeout=180) == 0, node.tail()
        yield nodes


def test_topk2_nodes_end_every_round_with_the_same_parameters(swarm):
    per_node = [n.by_round() for n in swarm]
    for round_ in range(ROUNDS + 1):
        assert len({records[round_]["params_sha256"] for records in per_node}) == 1, round_
    for records in per_node:
        for round_ in range(1, ROUNDS + 1):
            r = records[round_]
            assert (r["status"], r["group_size"], r["contributors"], r["compression"]) == (
                "committed", 2, 2, "topk2"), r
    assert len({per_node[0][r]["params_sha256"] for r in range(ROUNDS + 1)}) == ROUNDS + 1  # θ moved


def test_simulated_replicas_with_the_nodes_order_keys_end_every_round_with_their_parameters(swarm, tmp_path):
    keys = [peer_id_of(node.run_dir / "identity.key") for node in swarm]
    simulated = simulate(load_config(None, [*SWARM, *OVERRIDES]), tmp_path, keys)
    theirs = [swarm[0].by_round()[r]["params_sha256"] for r in range(ROUNDS + 1)]
    for key in keys:
        assert [r.params_sha256 for r in simulated[key]] == theirs


def test_topk2_average_is_the_mean_of_the_decoded_offers_and_sends_few_bytes(swarm):
    chunk = wire.DEFAULT_CHUNK_ELEMENTS
    for round_ in range(1, ROUNDS + 1):
        saved = [_saved(n, round_) for n in swarm]
        assert torch.equal(saved[0][1], saved[1][1])
        n = saved[0][0].numel()
        decoded = [codecs.decode_chunks(codecs.encode_chunks(d, chunk, DENSITY), n, chunk, DENSITY).double()
                   for d, _, _ in saved]
        expected = sum(w * d for d, (_, _, w) in zip(decoded, saved, strict=True)) / sum(w for *_, w in saved)
        assert torch.allclose(saved[0][1].double(), expected, rtol=1e-6, atol=1e-9)
        for node in swarm:
            sent = node.by_round()[round_]["bytes_sent"]
            assert codecs.topk_size(n, DENSITY) <= sent <= 2 * n * 2 / 50  # one contribution; 50x below fp16


def test_the_checkpoint_holds_what_the_last_round_did_not_send(swarm):
    for node in swarm:
        offered, _, _ = _saved(node, ROUNDS)
        tensors = load_file(str(node.run_dir / "checkpoints" / f"round-{ROUNDS:06d}.safetensors"))
        error = tensors["feedback.error"]
        assert torch.allclose(error, offered - sent_values(offered, "topk2", 2, density=DENSITY))
        assert error.abs().max() > 0
