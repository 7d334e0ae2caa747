"""A node of 2 local ranks (FSDP2 on CPU, gloo) as a user starts it: real processes, real run dirs.

The reference is a 1-rank node with twice the per-rank batch, trained in this process: with
one data order per node split across ranks, both see the same windows at every step, so
their global parameters (and AdamW state) must agree up to fp32 rounding.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diloco_p2p.config import load_config
from diloco_p2p.node import Node
from tests.conftest import set_args

# Until `diloco-p2p train` delegates to diloco_p2p.launch, the launcher is started directly.
ENTRY = ["-m", "diloco_p2p.launch", "train"]
PER_RANK_BATCH = 2
COMMON = [
    "model.preset=tiny", "data.max_bytes=200000", "inner.seq_len=32", "inner.warmup_steps=2", "inner.lr=0.003",
    "outer.inner_steps=4", "inner.total_steps=12", "train.eval_batches=1", "train.num_threads=1",
    "data.order_key=fsdp-test",
]


def _overrides(batch: int, rounds: int) -> list[str]:
    return COMMON + [f"inner.batch_size={batch}", f"train.max_rounds={rounds}"]


def _launch(run_dir: Path, rounds: int, env_extra: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env_extra or {}))
    args = [sys.executable, *ENTRY, "--nproc-per-node", "2", *set_args(_overrides(PER_RANK_BATCH, rounds)),
            "--run-dir", str(run_dir)]
    return subprocess.Popen(args, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def _train_two_ranks(run_dir: Path, rounds: int) -> str:
    proc = _launch(run_dir, rounds)
    _, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err
    return err


def _one_rank_node(run_dir: Path, rounds: int) -> Node:
    config = load_config(None, _overrides(2 * PER_RANK_BATCH, rounds))
    return Node(config, run_dir, progress=False)


def _ckpt(run_dir: Path, round_: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"round-{round_:06d}.safetensors"))


def _assert_same_state(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """θ, momentum and every AdamW tensor, at fp32 reordering tolerance."""
    assert sorted(ours) == sorted(ref)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 1-rank reference (rounds 1-3, and a copy of its dir at round 2) and a 2-rank run (rounds 1-2)."""
    root = tmp_path_factory.mktemp("fsdp")
    ref = root / "ref"
    _one_rank_node(ref, 2).run()
    shutil.copytree(ref, root / "ref_at_2")
    _one_rank_node(ref, 3).run()
    err = _train_two_ranks(root / "two", 2)
    return {"ref": ref, "ref_at_2": root / "ref_at_2", "two": root / "two", "two_stderr": err, "root": root}


@pytest.mark.timeout(240)
def test_two_ranks_train_like_one_rank_with_twice_the_batch(runs):
    import json

    assert "sharded over 2 local ranks" in runs["two_stderr"]
    for round_ in (1, 2):
        _assert_same_state(_ckpt(runs["two"], round_), _ckpt(runs["ref_at_2"], round_))  # keeps rounds 1-2
    two = [json.loads(line) for line in (runs["two"] / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (runs["ref"] / "metrics.jsonl").read_text().splitlines()][:3]
    assert [r["round"] for r in two] == [0, 1, 2]
    assert [r["tokens"] for r in two] == [r["tokens"] for r in ref]  # node tokens = sum over ranks
    for a, b in zip(two[1:], ref[1:], strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)  # mean over ranks
    meta = json.loads((runs["two"] / "checkpoints" / "round-000002.json").read_text())
    ref_meta = json.loads((runs["ref_at_2"] / "checkpoints" / "round-000002.json").read_text())
    assert meta["inner"] == ref_meta["inner"] and meta["data_position"] == ref_meta["data_position"]
    assert meta["local_world_size"] == 2


def test_two_rank_checkpoint_resumes_in_a_one_rank_node(runs, tmp_path):
    run_dir = tmp_path / "resumed"
    shutil.copytree(runs["two"], run_dir)
    node = _one_rank_node(run_dir, 3)
    full = _ckpt(runs["two"], 2)
    assert node.round == 2 and node.step == 8
    assert torch.equal(node.outer.theta, full["outer.theta"])  # the full θ, bit for bit
    assert torch.equal(node.outer.momentum, full["outer.momentum"])
    node.run()
    _assert_same_state(_ckpt(run_dir, 3), _ckpt(runs["ref"], 3))  # and it trains on as the 1-rank run did


@pytest.mark.timeout(180)
def test_one_rank_checkpoint_resumes_in_a_two_rank_node(runs, tmp_path):
    run_dir = tmp_path / "resumed"
    shutil.copytree(runs["ref_at_2"], run_dir)
    err = _train_two_ranks(run_dir, 3)
    assert "resumed from checkpoint at round 2 (step 8; written by 1 local rank(s))" in err
    _assert_same_state(_ckpt(run_dir, 3), _ckpt(runs["ref"], 3))


@pytest.mark.timeout(180)
def test_a_dead_local_rank_stops_the_node_within_a_bound(tmp_path):
    """SIGKILL rank 1 at its second inner step: the launcher must name it, stop rank 0 (blocked
    in an FSDP all-gather), and exit within a bound, leaving no rank behind."""
    proc = _launch(tmp_path / "r", 2, {"DILOCO_P2P_FAULTS": "kill@rank1.step:2"})
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    rc = proc.wait(timeout=150)
    ended = time.monotonic()
    reader.join(timeout=10)
    text = "".join(line for _, line in lines)
    fired = [t for t, line in lines if "fault injection: kill at rank1.step" in line]
    assert fired, text
    assert rc == 128 + signal.SIGKILL, text
    errors = [line for _, line in lines if line.startswith("error: local rank 1 ")]
    assert errors == ["error: local rank 1 of 2 was killed by SIGKILL; stopping the node (1 other rank(s) terminated)\n"]
    assert ended - fired[0] < 20, f"the node took {ended - fired[0]:.1f}s to stop"
    assert "Traceback" not in text, text
    pids = [int(p) for p in re.findall(r"started local rank \d of 2 \(pid (\d+)\)", text)]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
