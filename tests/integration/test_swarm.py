"""Three real nodes and a seed on loopback: every round averages, and the average is right.

The nodes save each round's Δ and the average they applied (DILOCO_P2P_FAULTS=keep@average); the
test recomputes the token-weighted mean from the saved Δs itself instead of trusting the code.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.harness.procs import run_cli, run_clis
from tests.harness.settings import TINY, set_args
from tests.harness.swarm import ProcessSwarm

ROUNDS = 3


def _saved(node, round_: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    with safe_open(str(node.run_dir / "deltas" / f"round-{round_:06d}.safetensors"), "pt") as f:
        meta = f.metadata()
        return f.get_tensor("delta"), f.get_tensor("average"), float(meta["weight"])


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with ProcessSwarm(tmp_path_factory.mktemp("swarm")) as swarm:
        overrides = [f"train.max_rounds={ROUNDS}", "sync.target_group_size=3", "sync.matchmaking_timeout=20"]
        # node-0 declares a 20 Mbit/s uplink: its all-reduce writes at `sync.pace` (0.97) of it
        nodes = [swarm.node(f"node-{i}", overrides + (["sync.link_mbit=20"] if i == 0 else []),
                            env={"DILOCO_P2P_FAULTS": "keep@average"}) for i in range(3)]
        swarm.wait_joined(*nodes)
        # A node whose config differs is refused by the nodes' `started` records, naming the field.
        refused = run_cli(["train", *set_args(TINY + ["run_id=swarm-test", "outer.lr=0.5",
                                                      "p2p.host_maddrs=['/ip4/127.0.0.1/tcp/0']"]),
                           "--initial-peers", swarm.maddr, "--run-dir", str(swarm.root / "refused")], timeout=120)
        swarm.release(*nodes)
        for node in nodes:
            assert node.wait(timeout=180) == 0, node.tail()
        yield swarm, nodes, refused


def test_every_node_ends_every_round_with_the_same_parameters(swarm):
    _, nodes, _ = swarm
    per_node = [n.by_round() for n in nodes]
    for round_ in range(ROUNDS + 1):
        hashes = {records[round_]["params_sha256"] for records in per_node}
        assert len(hashes) == 1, f"round {round_}: {hashes}"
    for records in per_node:
        for round_ in range(1, ROUNDS + 1):
            r = records[round_]
            assert (r["status"], r["group_size"], r["contributors"]) == ("committed", 3, 3), r
            assert r["compression"] == "fp16" and r["allreduce_seconds"] > 0
    assert len({per_node[0][r]["params_sha256"] for r in range(ROUNDS + 1)}) == ROUNDS + 1  # θ moved


def test_the_applied_average_is_the_token_weighted_mean_of_the_nodes_deltas(swarm):
    _, nodes, _ = swarm
    for round_ in range(1, ROUNDS + 1):
        saved = [_saved(n, round_) for n in nodes]
        averages = [avg for _, avg, _ in saved]
        assert all(torch.equal(averages[0], a) for a in averages[1:]), "members applied different averages"
        average, total = averages[0].double(), sum(w for _, _, w in saved)
        expected = sum(w * d.double() for d, _, w in saved) / total
        # fp16 on the wire rounds each Δ once (relative 2^-11) and the average once more.
        eps, tiny = 2.0**-11, 6e-8  # fp16 unit roundoff; its subnormal spacing
        magnitude = sum(w * d.double().abs() for d, _, w in saved) / total
        assert ((average - expected).abs() <= eps * (magnitude + expected.abs()) + tiny).all()
        # Sharper: the exact mean of the fp16-rounded Δs, rounded to fp16 once.
        mean_of_wire = sum(w * d.half().double() for d, _, w in saved) / total
        assert ((average - mean_of_wire).abs() <= eps * mean_of_wire.abs() + tiny).all()
        # The check can fail: the average is far from any one node's Δ.
        for delta, _, _ in saved:
            assert (delta.double() - expected).abs().max() > 100 * (average - expected).abs().max()


def test_bytes_on_the_wire_are_at_the_all_reduce_lower_bound(swarm):
    _, nodes, _ = swarm
    numel = _saved(nodes[0], 1)[0].numel()
    k = 3
    lower_bound = 2 * (k - 1) / k * 2 * numel  # fp16: 2 bytes per value
    for node in nodes:
        for round_ in range(1, ROUNDS + 1):
            sent = node.by_round()[round_]["bytes_sent"]
            assert lower_bound <= sent <= 1.02 * lower_bound, (sent, lower_bound)


def test_a_node_that_declares_its_uplink_writes_no_faster_than_its_pace(swarm):
    """On loopback an unpaced all-reduce takes a small fraction of its bytes' time at 20 Mbit/s;
    node-0's (paced at 0.97 of 20 Mbit/s) takes at least about 1/0.97 of it. The others (no
    link_mbit) record no ratio; the θ they all end with is checked above."""
    _, nodes, _ = swarm
    for round_ in range(1, ROUNDS + 1):
        r = nodes[0].by_round()[round_]
        assert r["wire_ratio"] >= 0.97, r
        assert all(n.by_round()[round_]["wire_ratio"] is None for n in nodes[1:])


def test_a_node_with_another_config_is_refused_naming_the_field(swarm):
    _, _, refused = swarm
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("error:") and "outer.lr" in line, line


@pytest.fixture(scope="module")
def bad_peers(tmp_path_factory):
    """`train` with a malformed and with an unreachable initial peer, both at once."""
    root = tmp_path_factory.mktemp("bad-peers")
    for run_dir in (root / "m", root / "u"):
        run_dir.mkdir()  # an empty run directory, as a test's tmp_path
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmWj4GYJGLYLBFJxtD7Utymq2CsW4HNVtbSUrLD1k8mXsq"
    malformed, unreachable = run_clis(
        ["train", *set_args(TINY), "--initial-peers", "/ip4/127.0.0.1/tcp/notaport", "--run-dir", str(root / "m")],
        ["train", *set_args(TINY + ["p2p.connect_timeout=5", "p2p.host_maddrs=['/ip4/127.0.0.1/tcp/0']"]),
         "--initial-peers", nobody, "--run-dir", str(root / "u")], timeout=90)
    return {"malformed": (malformed, root / "m"), "unreachable": (unreachable, root / "u")}


def test_malformed_initial_peer_is_one_clear_line(bad_peers):
    result, _ = bad_peers["malformed"]
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "initial_peers" in lines[0] and "not a valid multiaddr" in lines[0], lines


def test_unreachable_initial_peer_fails_after_a_bounded_wait(bad_peers):
    result, run_dir = bad_peers["unreachable"]
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error:") and "127.0.0.1/tcp/9" in line, line
    assert not (run_dir / "metrics.jsonl").exists()  # it never trained


def test_round_records_are_json_lines_with_the_swarm_fields(swarm):
    _, nodes, _ = swarm
    lines = (nodes[0].run_dir / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[-1])
    for key in ("status", "group_size", "allreduce_seconds", "bytes_sent", "bytes_received", "compression",
                "params_agree", "config_agree", "dropped_peers"):
        assert key in record, key
    assert record["params_agree"] is True and record["config_agree"] is True and record["dropped_peers"] == 0
