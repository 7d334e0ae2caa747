"""A node's checkpoint: what `Node` writes and how it resumes from one.

It holds θ, momentum, the inner optimizers, the data position, the error-feedback residual and
the overlap mode's fields. Always in
the 1-rank layout (`diloco_p2p.local.fsdp`), so a checkpoint resumes at any number of local ranks;
the file format is `diloco_p2p.loop.checkpoint`."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any, Protocol

from diloco_p2p import __version__
from diloco_p2p.config import Config
from diloco_p2p.data import DataPosition, TokenDataset
from diloco_p2p.local.fsdp import ShardLayout, gather_optimizer_state, shard_optimizer_state
from diloco_p2p.local.ranks import Ranks
from diloco_p2p.loop.checkpoint import Checkpoint, join_tensors, split_tensors
from diloco_p2p.loop.error_feedback import ErrorFeedback
from diloco_p2p.loop.inner import InnerTrainer
from diloco_p2p.loop.outer import OuterOptimizer
from diloco_p2p.loop.rounds import Blocking

log = logging.getLogger("diloco_p2p.loop.node")  # the node's lines, under the name they always had


class Checkpointed(Protocol):
    """What of a `Node` its checkpoint holds."""

    config: Config
    ranks: Ranks
    layout: ShardLayout
    outer: OuterOptimizer
    feedback: ErrorFeedback
    trainer: InnerTrainer
    data: TokenDataset
    rounds: Blocking
    swarm_view: dict[str, Any]
    round: int
    step: int
    tokens: int
    joined_at_round: int | None
    resyncs: int

    def params_sha256(self) -> str: ...


def checkpoint_of(node: Checkpointed) -> Checkpoint | None:
    """The node's checkpoint in the 1-rank layout (collective on N ranks; None off rank 0)."""
    leader, layout = node.ranks.leader, node.layout
    theta, momentum = layout.to_full(node.outer.theta), layout.to_full(node.outer.momentum)
    error = layout.to_full(node.feedback.error) if node.feedback.enabled else None
    trainer_state = node.trainer.state_dict()
    for key in node.trainer.optimizers:  # AdamW, and Muon under inner.optimizer=muon
        trainer_state[key] = gather_optimizer_state(trainer_state[key], keep=leader)
    params_sha256 = node.params_sha256()
    extra, overlap = node.rounds.checkpoint()  # the trained weights, the round in flight
    if not leader:
        return None
    tensors = {"outer.theta": theta, "outer.momentum": momentum, **extra}
    if error is not None:
        tensors["feedback.error"] = error
    inner = split_tensors(trainer_state, tensors, "inner")
    meta = {
        "inner": inner, "data_position": asdict(node.data.position), "swarm_view": node.swarm_view,
        "config_hash": node.config.swarm_hash(), "params_sha256": params_sha256, "version": __version__,
        "joined_at_round": node.joined_at_round, "resyncs": node.resyncs,
        "local_world_size": node.ranks.world_size, "overlap": overlap,
    }
    return Checkpoint(round=node.round, step=node.step, tokens=node.tokens, tensors=tensors, meta=meta)


def resume(node: Checkpointed, ckpt: Checkpoint) -> None:
    """Every rank reads the full checkpoint (any world size wrote it) and keeps its part."""
    layout = node.layout
    node.outer.load_state_tensors({k: layout.to_local(ckpt.tensors[k]) for k in ("outer.theta", "outer.momentum")})
    if "feedback.error" in ckpt.tensors and node.feedback.enabled:  # absent: written with feedback off
        node.feedback.load(layout.to_local(ckpt.tensors["feedback.error"]))
    if "inner" in ckpt.meta:  # absent in a state fetched from the swarm: a fresh AdamW then
        state = join_tensors(ckpt.meta["inner"], ckpt.tensors)
        node.trainer.check_state(state, f"checkpoint round {ckpt.round}")
        for key, optimizer in node.trainer.optimizers.items():
            state[key] = shard_optimizer_state(optimizer, state[key])
        node.trainer.load_state_dict(state)
    if "data_position" in ckpt.meta:
        node.data.position = DataPosition(**ckpt.meta["data_position"])
    node.round, node.step, node.tokens = ckpt.round, ckpt.step, ckpt.tokens
    node.joined_at_round = ckpt.meta.get("joined_at_round")
    node.resyncs = ckpt.meta.get("resyncs", 0)
    node.rounds.resume(ckpt)  # the trained weights, the round in flight
    log.info("resumed from checkpoint at round %d (step %d; written by %s local rank(s))",
             node.round, node.step, ckpt.meta.get("local_world_size", 1))
