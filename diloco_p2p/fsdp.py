"""FSDP inside a node: N local ranks train as one DiLoCo node, each owning one shard of θ.

A volunteer with N GPUs in one box runs one node of N ranks (`diloco_p2p.launch`). The design:

**Inner steps.** The model is wrapped with FSDP2 (`fully_shard`, Zhao et al. 2023, "PyTorch
FSDP") per transformer block and at the root, so each rank holds 1/N of every parameter (rows
of dim 0, `torch.chunk` order) and all-gathers a block only while it computes it. AdamW runs on
the sharded (DTensor) parameters: its state is sharded too, and `clip_grad_norm_` computes the
global norm across ranks. On GPU the block computes in bf16 and reduces gradients in fp32
(`MixedPrecisionPolicy`); on CPU (gloo) everything stays fp32. Inside the node the ranks are
plain data parallel on one data order: each step the node takes the next N·b windows of its
order and rank r keeps rows r, r+N, ... (`StridedBatches`). So an N-rank node with batch b sees
exactly the windows of a 1-rank node with batch N·b, its data position in a checkpoint means the
same thing at any N, and the averaged FSDP gradient is the 1-rank gradient up to fp rounding.

**Outer state per shard, on the host.** Each rank's `ShardedOuterOptimizer` keeps θ and the
Nesterov momentum of *its* shards only (the flattened ``p.to_local()`` of every parameter), in
fp32 on the host: N ranks together hold one copy of the outer state, not N. Δ and the outer step
are elementwise, so they run per shard unchanged. The node's hash of θ is sha256 over the N
shard hashes (hex, in rank order), gathered as raw bytes with `all_gather`; nothing gathers θ.

**Node-wide numbers and decisions.** Every inner step all-reduces (loss, tokens): the node
reports the mean loss and counts the tokens of all its ranks, so its weight in the swarm's
average is its total tokens. A stop request (SIGTERM on any rank) is an all-reduce(max) at each
point where the loop checks it, so all ranks leave the loop at the same step (`NodeStop`).

**Across the WAN, shard by shard.** Each rank runs its own swarm endpoint (`ShardSync`, at the
end of this module) whose run id is ``f"{run_id}.shard{r}of{N}"``: shard r of one node only
ever meets shard r of the others, in groups of its own, and averages just its 1/N of Δ; its
progress records carry the shard's hash and it serves its shard of the state to joiners, who
download shard by shard. Decisions that must be node-wide are made together: whether to resync
(any rank's shard is behind or in a minority: all ranks download at the highest round any of
them saw, and adopt only if every rank succeeded) and the round's status. Nodes with another
local world size live in other namespaces and would never meet ours, so the node-level record
that rank 0 publishes under the plain run id carries the world size in its config view, and a
node whose world size differs from the swarm's is refused at start with the differing field.

**Checkpoints** hold full tensors in the 1-rank layout (θ, momentum, AdamW state keyed by
parameter index): each DTensor is gathered with `full_tensor` for the checkpoint only, rank 0
writes, and loading slices each full tensor into the local shard. A checkpoint moves freely
between world sizes (1 → N, N → 1, N → M), and `export` reads it as a normal one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from diloco_p2p import __version__
from diloco_p2p.checkpoint import Checkpoint, join_tensors, load_checkpoint, save_checkpoint, split_tensors
from diloco_p2p.config import Config, InnerConfig, OuterConfig, save_config
from diloco_p2p.data import DataPosition, TextDataset, build_dataset
from diloco_p2p.faults import Faults
from diloco_p2p.inner import InnerTrainer, StepStats
from diloco_p2p.launch import LocalRanks, init_local_ranks, local_world_size
from diloco_p2p.logs import set_log_context
from diloco_p2p.model import build_model, build_tokenizer, count_parameters
from diloco_p2p.node import Node, SoloSync, StopRequested, Sync, node_key
from diloco_p2p.outer import OuterOptimizer, tensor_sha256

log = logging.getLogger(__name__)


# -- the model ----------------------------------------------------------------------------------


def uses_bf16_params(device: torch.device, precision: str) -> bool:
    return device.type == "cuda" and precision != "fp32"


def shard_model(model: torch.nn.Module, ranks: LocalRanks, precision: str = "auto") -> torch.nn.Module:
    """FSDP2 per transformer block and at the root; params become DTensors sharded on dim 0.

    The model is built whole on the host (the same seed gives the same θ at every world size)
    and `fully_shard` moves only this rank's shards to its device.
    """
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if uses_bf16_params(ranks.device, precision) else MixedPrecisionPolicy())
    for block in model.model.layers:
        fully_shard(block, mesh=ranks.mesh, mp_policy=mp)
    fully_shard(model, mesh=ranks.mesh, mp_policy=mp)
    return model


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (a view: writing to it writes the parameter)."""
    return p.to_local() if isinstance(p, DTensor) else p


def local_rows(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The rows of `full` that this rank holds for a parameter laid out like `like`.

    FSDP2 shards dim 0 in `torch.chunk` order (trailing ranks may get fewer rows, or none);
    the shape check catches any other layout instead of silently loading wrong rows.
    """
    mesh = like.device_mesh
    if len(like.placements) != 1 or like.placements[0] != Shard(0):
        raise ValueError(f"expected a parameter sharded on dim 0, got placements {like.placements}")
    chunks = torch.chunk(full, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    local = chunks[rank] if rank < len(chunks) else full.narrow(0, 0, 0)
    if tuple(local.shape) != tuple(like.to_local().shape):
        raise ValueError(f"shard of shape {tuple(local.shape)} does not match the local parameter "
                         f"{tuple(like.to_local().shape)}")
    return local


def full_tensor_of(local: torch.Tensor, like: DTensor) -> torch.Tensor:
    """Gather a full CPU tensor from every rank's `local` shard of a parameter laid out like
    `like` (collective: every rank calls it, in the same order)."""
    shard = local.reshape(like.to_local().shape).to(like.device)
    dt = DTensor.from_local(shard, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(),
                            run_check=False)
    return dt.full_tensor().cpu()


# -- data and the inner step ----------------------------------------------------------------------


class StridedBatches:
    """Rank r's rows r, r+N, ... of the node's next N·b windows: one data order per node."""

    def __init__(self, data: TextDataset, rank: int, world_size: int):
        self.data, self.rank, self.world_size = data, rank, world_size

    def next_batch(self, batch_size: int) -> torch.Tensor:
        return self.data.next_batch(batch_size * self.world_size)[self.rank :: self.world_size]

    @property
    def position(self) -> DataPosition:
        return self.data.position

    @position.setter
    def position(self, value: DataPosition) -> None:
        self.data.position = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.data, name)


class ShardedInnerTrainer(InnerTrainer):
    """AdamW on DTensor params; each step's (loss, tokens) is made node-wide with one all-reduce.

    Fault point for tests: ``rank{R}.step:{S}`` fires on rank R before global inner step S.
    """

    def __init__(self, model: torch.nn.Module, cfg: InnerConfig, total_steps: int, ranks: LocalRanks,
                 precision: str = "auto", faults: Faults | None = None):
        # With bf16 params from the FSDP policy, autocast on top would only add casts.
        inner_precision = "fp32" if uses_bf16_params(ranks.device, precision) else precision
        super().__init__(model, cfg, total_steps, ranks.device, inner_precision)
        self.ranks, self.faults = ranks, faults or Faults()

    def step(self, next_batch: Callable[[], torch.Tensor]) -> StepStats:
        self.faults.fire(f"rank{self.ranks.rank}.step", self.scheduler.last_epoch + 1)
        stats = super().step(next_batch)
        loss_sum, tokens = self.ranks.all_reduce([stats.loss, float(stats.tokens)])
        return StepStats(loss=loss_sum / self.ranks.world_size, tokens=int(tokens))


def gather_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, keep: bool) -> dict | None:
    """The AdamW state dict with every DTensor gathered into a full tensor: the 1-rank layout.

    Collective; only the caller with `keep` gets the dict (others None), and the others never
    hold more than one full tensor at a time.
    """
    out: dict[int, dict[str, Any]] = {}
    for idx in sorted(state["state"]):
        entry = {}
        for key, value in state["state"][idx].items():
            full = value.full_tensor().cpu() if isinstance(value, DTensor) else value
            if keep:
                entry[key] = full
        out[idx] = entry
    return {"state": out, "param_groups": state["param_groups"]} if keep else None


def shard_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """Inverse of `gather_optimizer_state`: slice full state tensors into this rank's DTensors."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded: dict[int, dict[str, Any]] = {}
    for idx, entry in state["state"].items():
        p = params[int(idx)]
        sharded[idx] = {}
        for key, value in entry.items():
            if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0:
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {idx}.{key} has shape {tuple(value.shape)}, "
                                     f"the parameter {tuple(p.shape)}")
                value = DTensor.from_local(local_rows(value, p).to(p.device), p.device_mesh, p.placements,
                                           shape=p.shape, stride=p.stride(), run_check=False)
            sharded[idx][key] = value
    return {"state": sharded, "param_groups": state["param_groups"]}


# -- the outer state, per shard -------------------------------------------------------------------


class ShardedOuterOptimizer(OuterOptimizer):
    """θ and momentum of this rank's shards only (fp32, host); the outer step is unchanged."""

    def __init__(self, params: Sequence[torch.Tensor], cfg: OuterConfig, ranks: LocalRanks):
        self.layout = list(params)  # the DTensor params: global shapes and placements
        self.ranks = ranks
        super().__init__([_local(p) for p in self.layout], cfg)
        self.full_numels = [p.numel() for p in self.layout]

    def pseudo_gradient(self, local_params: Sequence[torch.Tensor]) -> torch.Tensor:
        return super().pseudo_gradient([_local(p) for p in local_params])

    def copy_into(self, params: Sequence[torch.Tensor]) -> None:
        super().copy_into([_local(p) for p in params])

    def shard_sha256(self) -> str:
        """Hash of this rank's θ shard (local, no collective)."""
        return tensor_sha256(self.theta)

    def params_sha256(self) -> str:
        """The node's hash of θ: sha256 over the shard hashes in rank order (collective)."""
        digests = self.ranks.all_gather_fixed(self.shard_sha256().encode())
        return hashlib.sha256(b"".join(digests)).hexdigest()

    def full_state_tensors(self) -> dict[str, torch.Tensor]:
        """Full flat θ and momentum, as a 1-rank node holds them (collective; rank 0 gets
        them, the others an empty dict). For checkpoints only."""
        out: dict[str, torch.Tensor] = {}
        for name, flat in (("outer.theta", self.theta), ("outer.momentum", self.momentum)):
            parts = []
            for chunk, like in zip(flat.split(self.numels), self.layout, strict=True):
                full = full_tensor_of(chunk, like)
                if self.ranks.rank == 0:
                    parts.append(full.reshape(-1))
            if self.ranks.rank == 0:
                out[name] = torch.cat(parts)
        return out

    def load_full_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take full flat θ and momentum (any world size wrote them) and keep our shards."""
        def shards(flat: torch.Tensor) -> torch.Tensor:
            if flat.numel() != sum(self.full_numels):
                raise ValueError(f"outer state has {flat.numel()} parameters, this model has {sum(self.full_numels)}")
            return torch.cat([local_rows(c.view(like.shape), like).reshape(-1)
                              for c, like in zip(flat.split(self.full_numels), self.layout, strict=True)])

        self.load_state_tensors({k: shards(tensors[k]) for k in ("outer.theta", "outer.momentum")})


# -- the node -------------------------------------------------------------------------------------


class NodeStop:
    """A stop request seen by every rank at the same point of the loop (all-reduce max).

    The loop reads `requested` at the same points on every rank, so each read is a collective
    in lockstep. Swarm code must get the rank's own `StopRequested` instead: it polls from
    other places.
    """

    def __init__(self, local: StopRequested, ranks: LocalRanks):
        self.local, self.ranks = local, ranks

    @property
    def requested(self) -> bool:
        return self.ranks.any(self.local.requested)

    def install(self) -> None:
        self.local.install()


class ShardedNode(Node):
    """`Node` whose model, data, inner trainer and outer state are this rank's share of a node.

    `Node.run` is reused as is; what differs is built here. Rank 0 owns the run directory
    (config, metrics.jsonl, checkpoints); rank r > 0 writes its own metrics.jsonl (the same
    node-wide numbers) under ``ranks/<r>/``.
    """

    def __init__(self, config: Config, run_dir: Path, ranks: LocalRanks, sync: Sync | None = None, *,
                 stop: StopRequested | None = None, metrics: Any = None, progress: bool | None = None,
                 faults: Faults | None = None):
        self.ranks, self.config, self.node_dir = ranks, config, run_dir
        leader = ranks.rank == 0
        self.run_dir = run_dir if leader else run_dir / "ranks" / str(ranks.rank)
        self.stop = NodeStop(stop or StopRequested(), ranks)  # type: ignore[assignment]
        self.metrics = metrics if leader else None
        self.progress = leader and (sys.stderr.isatty() if progress is None else progress)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if config.train.num_threads:
            torch.set_num_threads(config.train.num_threads)
        self.device = ranks.device
        # One data order per node, keyed like a 1-rank node's: rank 0's identity.
        self.sync = sync or SoloSync(ranks.broadcast_str(node_key(run_dir) if leader else ""))
        set_log_context(peer=self.sync.peer_id)

        tokenizer = build_tokenizer(config.model)
        model = build_model(config.model, tokenizer.vocab_size, config.seed)
        self.model = shard_model(model, ranks, config.train.precision)
        self.params = list(self.model.parameters())
        data = build_dataset(config.data, tokenizer, config.inner.seq_len, order_key=self.sync.peer_id)
        self.data = StridedBatches(data, ranks.rank, ranks.world_size)  # type: ignore[assignment]
        self.eval_set = self.data.eval_batches(config.inner.batch_size, config.train.eval_batches)
        total_steps = config.inner.total_steps or config.train.max_rounds * config.outer.inner_steps
        self.trainer = ShardedInnerTrainer(self.model, config.inner, total_steps, ranks, config.train.precision,
                                           faults)
        self.outer = ShardedOuterOptimizer(self.params, config.outer, ranks)
        self.round = self.step = self.tokens = 0
        self.swarm_view = config.swarm_view()
        self.joined_at_round: int | None = None
        self.resyncs = 0
        self._resume()
        if leader:
            save_config(config, run_dir / "config.yaml")
        log.info(
            "model: %s parameters sharded over %d local ranks on %s (%s outer-state values on this rank); "
            "data: %d train / %d eval windows; run dir %s",
            f"{count_parameters(self.model):,}", ranks.world_size, self.device, f"{self.outer.numel:,}",
            len(data.train_windows), len(data.eval_windows), run_dir,
        )

    def state_checkpoint(self) -> Checkpoint:
        """The node's checkpoint in the 1-rank layout (collective; complete on rank 0 only)."""
        leader = self.ranks.rank == 0
        tensors = self.outer.full_state_tensors()
        trainer_state = self.trainer.state_dict()
        optimizer = gather_optimizer_state(self.trainer.optimizer, trainer_state["optimizer"], keep=leader)
        params_sha256 = self.outer.params_sha256()
        meta: dict[str, Any] = {}
        if leader:
            inner = split_tensors({"optimizer": optimizer, "scheduler": trainer_state["scheduler"]}, tensors, "inner")
            meta = {
                "inner": inner, "data_position": {"epoch": self.data.position.epoch,
                                                  "offset": self.data.position.offset},
                "swarm_view": self.swarm_view, "config_hash": self.config.swarm_hash(),
                "params_sha256": params_sha256, "version": __version__, "joined_at_round": self.joined_at_round,
                "resyncs": self.resyncs, "local_world_size": self.ranks.world_size,
            }
        return Checkpoint(round=self.round, step=self.step, tokens=self.tokens, tensors=tensors, meta=meta)

    def _save(self) -> None:
        ckpt = self.state_checkpoint()
        if self.ranks.rank == 0:
            save_checkpoint(self.node_dir / "checkpoints", ckpt)

    def _resume(self) -> None:
        """Every rank reads the full checkpoint (any world size wrote it) and keeps its shards."""
        ckpt = load_checkpoint(self.node_dir / "checkpoints", self.swarm_view)
        if ckpt is None:
            return
        self.outer.load_full_state_tensors(ckpt.tensors)
        if "inner" in ckpt.meta:  # absent in a state fetched from the swarm: a fresh AdamW then
            state = join_tensors(ckpt.meta["inner"], ckpt.tensors)
            state["optimizer"] = shard_optimizer_state(self.trainer.optimizer, state["optimizer"])
            self.trainer.load_state_dict(state)
        if "data_position" in ckpt.meta:
            self.data.position = DataPosition(**ckpt.meta["data_position"])
        self.round, self.step, self.tokens = ckpt.round, ckpt.step, ckpt.tokens
        self.joined_at_round = ckpt.meta.get("joined_at_round")
        self.resyncs = ckpt.meta.get("resyncs", 0)
        self.outer.copy_into(self.params)
        log.info("resumed from checkpoint at round %d (step %d; written by %s local rank(s))",
                 self.round, self.step, ckpt.meta.get("local_world_size", 1))


class _RankPrefix(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.prefix = f"[local rank {rank}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            record.msg = self.prefix + str(record.msg)
        return True


def quiet_other_ranks(rank: int) -> None:
    """Rank 0 speaks for the node; the others log warnings only, prefixed with their rank."""
    if rank == 0:
        return
    logging.getLogger("diloco_p2p").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_RankPrefix(rank))


def train_local_rank(config: Config, run_dir: Path, stop: StopRequested,
                     start_metrics: Callable[[], Any] = lambda: None) -> list[dict[str, Any]]:
    """Train as this process's rank of an N-rank node (solo, or in the swarm shard by shard).

    Called in each rank started by `launch_local_ranks` or torchrun; returns the node's records.
    """
    rank, world = int(os.environ["RANK"]), local_world_size()
    quiet_other_ranks(rank)
    sync = None
    if config.p2p.initial_peers:
        from diloco_p2p.fsdp_swarm import ShardSync

        sync = ShardSync(config, run_dir, stop, rank, world)  # before any thread of ours: hivemind forks
    try:
        ranks = init_local_ranks(config.train)
        assert ranks is not None
        if sync is not None:
            sync.attach(ranks)
        metrics = start_metrics() if ranks.rank == 0 else None
        node = ShardedNode(config, run_dir, ranks, sync, stop=stop, metrics=metrics)
        records = node.run()
        ranks.barrier()  # rank 0 may still be writing the last checkpoint
    finally:
        if sync is not None:
            sync.close()
    ranks.close()
    return records
