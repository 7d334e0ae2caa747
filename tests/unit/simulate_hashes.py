"""The per-round θ hashes of tiny runs in every overlap mode, with and without sync.fragments,
kept in ``tests/unit/data/simulate_hashes.json`` so a change to the loop is shown to leave
training bit for bit as it was (`test_simulate_hashes.py` recomputes them).

Two kinds of run: 2 replicas of `simulate` (every round committed with both), and one node
alone that a stop interrupts mid-round (a round in flight, under ``inner`` after its landing)
and that resumes from its checkpoint; for those the checkpoint's tensors are hashed too.
Regenerate only for a change meant to alter training, on the machine kind CI runs on:

    python -m tests.unit.simulate_hashes > tests/unit/data/simulate_hashes.json
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

from diloco_p2p.config import load_config
from diloco_p2p.contract import StopRequested
from diloco_p2p.hashing import tensor_sha256
from diloco_p2p.loop.checkpoint import load_checkpoint
from diloco_p2p.loop.node import Node
from diloco_p2p.planner.simulate import Rendezvous, ReplicaSync, simulate

BASE = ["model.preset=tiny", "data.max_bytes=200000", "data.eval_fraction=0.05", "inner.batch_size=2",
        "inner.seq_len=32", "inner.warmup_steps=1", "outer.inner_steps=3", "train.eval_batches=1",
        "train.num_threads=1", "train.device=cpu", "train.max_rounds=4"]
INNER = ["sync.overlap=inner", "sync.overlap_steps=1", "sync.overlap_mix=0.25"]
LOSSY = ["sync.compression=int4", "sync.error_feedback=true"]

# name -> the settings on top of BASE, for 2 replicas of `simulate` (under inner a fixed τ: with
# sync.overlap_steps=0 which replica lands first depends on the threads' turns)
REPLICAS = {
    "none": [],
    "delayed": ["sync.overlap=delayed"],
    "eager": ["sync.overlap=eager"],
    "inner": INNER,
    "inner_rebase": [*INNER, "sync.overlap_merge=rebase"],
    "inner_lossy": [*INNER, *LOSSY],
    "eager_lossy": ["sync.overlap=eager", *LOSSY],
    "fragments": ["sync.fragments=2"],
    "fragments_inner": ["sync.fragments=2", *INNER],
    "fragments_inner_rebase_lossy": ["sync.fragments=2", *INNER, "sync.overlap_merge=rebase", *LOSSY],
}

# name -> (settings, the inner step after which a stop comes), for one node stopped and resumed
RESUMED = {
    "none_stopped": ([], 4),
    "eager_stopped": (["sync.overlap=eager"], 5),
    "inner_stopped_after_landing": (INNER, 5),
    "inner_rebase_stopped_before_landing": (["sync.overlap=inner", "sync.overlap_steps=2",
                                             "sync.overlap_merge=rebase"], 4),
    "fragments_inner_stopped": (["sync.fragments=2", *INNER, *LOSSY], 5),
}


def _rounds(records) -> list[dict]:
    """What each round record says of θ and of where the round stands."""
    return [{"round": r.round, "status": r.status, "params_sha256": r.params_sha256, "train_loss": r.train_loss,
             "eval_loss": r.eval_loss, "applied_round": r.applied_round, "landed_step": r.landed_step,
             "fragment": r.fragment} for r in records]


def replicas(settings: list[str], root: Path) -> list[dict]:
    records = simulate(load_config(None, [*BASE, *settings]), root, ["a", "b"])
    a, b = _rounds(records["a"]), _rounds(records["b"])
    assert [r["params_sha256"] for r in a] == [r["params_sha256"] for r in b]
    return a


def _alone(config, run_dir: Path, stop: StopRequested, stop_after: int | None = None) -> list:
    """One node whose averages are its own Δ (a rendezvous of one), stopped after `stop_after` steps."""
    node = Node(config, run_dir, ReplicaSync("a", Rendezvous(["a"], config.sync)), stop=stop, progress=False)
    real, done = node.trainer.step, [0]

    def step(next_batch):
        out = real(next_batch)
        done[0] += 1
        if done[0] == stop_after:
            stop.requested = True
        return out

    node.trainer.step = step
    with node.sync.rendezvous.baton:  # what `simulate` holds for each replica
        return node.run()


def resumed(settings: list[str], stop_after: int, root: Path) -> dict:
    config = load_config(None, [*BASE, *settings])
    first = _alone(config, root, StopRequested(), stop_after)
    ckpt = load_checkpoint(root / "checkpoints")
    tensors = {k: tensor_sha256(t.reshape(-1)) for k, t in sorted(ckpt.tensors.items())}
    inner = hashlib.sha256(json.dumps({k: v for k, v in tensors.items() if k.startswith("inner.")}).encode())
    checkpoint = {"round": ckpt.round, "step": ckpt.step, "overlap": ckpt.meta["overlap"],
                  "params_sha256": ckpt.meta["params_sha256"], "inner": inner.hexdigest(),  # AdamW's state
                  "tensors": {k: v for k, v in tensors.items() if not k.startswith("inner.")}}
    second = _alone(config, root, StopRequested())
    return {"stopped": _rounds(first), "checkpoint": checkpoint, "resumed": _rounds(second)}


def compute() -> dict:
    out: dict = {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
                 "replicas": {}, "resumed": {}}
    with TemporaryDirectory() as tmp:
        for name, settings in REPLICAS.items():
            out["replicas"][name] = replicas(settings, Path(tmp) / name)
        for name, (settings, stop_after) in RESUMED.items():
            out["resumed"][name] = resumed(settings, stop_after, Path(tmp) / name)
    return out


if __name__ == "__main__":
    json.dump(compute(), sys.stdout, indent=1)
    sys.stdout.write("\n")
