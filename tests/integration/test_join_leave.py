"""Elastic membership with real processes: fetch/export from a live swarm, a node joining at
round >= 3, SIGKILL + restart, SIGTERM leave. Two long-running nodes form the swarm; the tests
run in file order against it (each asserts on what the previous left behind: the joiner).
The bad-input test needs only the seed and comes first, before the nodes start: they train
until the module ends, and beside them its two one-line commands took 35-45 s."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from diloco_p2p.model.build import build_model, build_tokenizer
from diloco_p2p.ops.transfer import find_checkpoint, model_from_checkpoint
from tests.harness.procs import run_cli, run_clis, wait_until
from tests.harness.swarm import Node, ProcessSwarm

# Rounds of two nodes wait sync.matchmaking_timeout for a third; max_rounds only bounds a leak.
OVERRIDES = ["train.max_rounds=1000", "sync.target_group_size=3", "sync.matchmaking_timeout=3"]


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    with ProcessSwarm(tmp_path_factory.mktemp("elastic")) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def swarm(seed):
    a, b = seed.node("a", OVERRIDES), seed.node("b", OVERRIDES)  # stopped with the seed's processes
    seed.release(a, b)
    yield seed, a, b


def _status(swarm: ProcessSwarm) -> list[dict]:
    result = run_cli(["status", "--initial-peers", swarm.maddr, "--run-id", "swarm-test", "--json"], timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _agree_later(node: Node, reference: Node, after: int, timeout: float = 120) -> int:
    """Wait for a round > `after` that both finished; assert the same θ there. Returns the round."""
    def common() -> list[int]:
        mine, theirs = node.by_round(), reference.by_round()
        return [r for r in mine if r > after and r in theirs and mine[r]["status"] == "committed"]

    wait_until(lambda: bool(common()), timeout, f"{node.run_dir.name} to commit a round after {after}", node, reference)
    round_ = min(common())
    assert node.by_round()[round_]["params_sha256"] == reference.by_round()[round_]["params_sha256"]
    return round_


def test_fetch_and_export_bad_input_is_one_line(seed, tmp_path):
    fetch, export = run_clis(
        ["fetch", "--initial-peers", seed.maddr, "--run-id", "no-such-run", "--out", str(tmp_path / "x"),
         "--timeout", "10"],
        ["export", "--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "hf")], timeout=60)
    assert fetch.returncode == 2 and fetch.stderr.strip().splitlines()[-1].startswith("error: no node of run")
    assert export.returncode == 2
    assert export.stderr.strip().splitlines() == [
        f"error: --checkpoint {tmp_path / 'missing'}: no config.yaml in {tmp_path / 'missing'}; point it at a run directory"]
    assert not (tmp_path / "hf").exists()


def test_fetch_and_export_give_the_swarms_model(swarm, tmp_path):
    s, a, b = swarm
    a.wait_round(2)
    out = tmp_path / "fetched"
    result = run_cli(["fetch", "--initial-peers", s.maddr, "--run-id", "swarm-test", "--out", str(out)], timeout=120)
    assert result.returncode == 0, result.stderr
    config, ckpt = find_checkpoint(out)
    assert ckpt.round >= 2 and ckpt.meta["params_sha256"] == a.by_round()[ckpt.round]["params_sha256"]
    assert config.swarm_view() == find_checkpoint(a.run_dir)[0].swarm_view()
    hf = tmp_path / "hf"
    result = run_cli(["export", "--checkpoint", str(out), "--out", str(hf)], timeout=120)
    assert result.returncode == 0, result.stderr
    exported = AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    reference = model_from_checkpoint(config, ckpt).eval()  # θ straight from the checkpoint file
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, reference(tokens).logits)
        untrained = build_model(config.model, build_tokenizer(config.model).vocab_size, config.seed).eval()
        assert not torch.allclose(exported(tokens).logits, untrained(tokens).logits)


def test_a_node_joining_at_round_3_starts_from_the_swarms_state(swarm):
    s, a, b = swarm
    a.wait_round(3)
    started = time.monotonic()
    c = s.node("c", OVERRIDES)
    wait_until(lambda: any(r["status"] == "resynced" for r in c.records()), 120, "c to download the state", c)
    joined = next(r for r in c.records() if r["round"] > 0)  # its first round: the download, not training
    assert joined["status"] == "resynced" and joined["joined_at_round"] >= 3
    assert joined["state_bytes"] > 0 and joined["donor"] and joined["params_sha256"] == a.by_round()[
        joined["round"]]["params_sha256"]
    assert 1 not in c.by_round()  # it never trained from scratch
    first = _agree_later(c, a, joined["round"])
    print(f"join: {time.monotonic() - started:.1f} s from start to round {first} committed in agreement; "
          f"state {joined['state_bytes'] / 1e6:.2f} MB in {joined['state_seconds']:.3f} s")


def test_sigkill_then_restart_resumes_and_agrees(swarm):
    s, a, _ = swarm
    c = s.nodes("c")[0]
    before = max(c.by_round())
    c.signal(signal.SIGKILL)
    assert c.wait(timeout=30) == -signal.SIGKILL
    c.kill()  # what a crashed machine leaves behind is gone too
    restarted = s.node("c", OVERRIDES)
    wait_until(lambda: "resumed from checkpoint" in restarted.output(), 60, "the restart to resume", restarted)
    resumed_at = int(re.search(r"resumed from checkpoint at round (\d+)", restarted.output()).group(1))
    assert resumed_at >= before - 1
    _agree_later(restarted, a, max(a.by_round()))


def test_sigterm_leaves_with_a_checkpoint_and_withdraws_its_record(swarm):
    s, a, b = swarm
    c = s.nodes("c")[-1]
    wait_until(lambda: len(_status(s)) == 3, 60, "three nodes in status", c)
    c.signal(signal.SIGTERM)
    started = time.monotonic()
    assert c.wait(timeout=20) == 0, c.tail()
    print(f"SIGTERM to exit: {time.monotonic() - started:.1f} s")
    assert (c.run_dir / "checkpoints" / "latest.json").exists()
    assert len(_status(s)) == 2  # a and b go on; c's record is withdrawn, not left to expire
    round_ = max(a.by_round())
    wait_until(lambda: round_ + 1 in a.by_round(), 60, "a to go on", a)
