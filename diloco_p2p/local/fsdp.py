"""FSDP inside a node: N local ranks train as one DiLoCo node, each owning one shard of θ.

A volunteer with N GPUs in one box runs one node of N ranks (`diloco_p2p.local.launch`). The design:

**Inner steps.** The model is wrapped with FSDP2 (`fully_shard`, Zhao et al. 2023, "PyTorch
FSDP") per transformer block and at the root, so each rank holds 1/N of every parameter (rows
of dim 0, `torch.chunk` order) and all-gathers a block only while it computes it. AdamW runs on
the sharded (DTensor) parameters: its state is sharded too, and `clip_grad_norm_` computes the
global norm across ranks. On GPU the block computes in bf16 and reduces gradients in fp32
(`MixedPrecisionPolicy`); on CPU (gloo) everything stays fp32. Inside the node the ranks are
plain data parallel on one data order: each step the node takes the next N·b windows of its
order and rank r keeps rows r, r+N, ... (`Node._next_batch`). So an N-rank node with batch b sees
exactly the windows of a 1-rank node with batch N·b, its data position in a checkpoint means the
same thing at any N, and the averaged FSDP gradient is the 1-rank gradient up to fp rounding.

**Outer state per shard, on the host.** Each rank's `OuterOptimizer` is built on the local
views of the parameters (`ShardLayout.local_views`): it keeps θ and the Nesterov momentum of
*its* shards only, in fp32 on the host: N ranks together hold one copy of the outer state, not N. Δ and the outer step
are elementwise, so they run per shard unchanged. The node's hash of θ is sha256 over the N
shard hashes (hex, in rank order), gathered as raw bytes with `all_gather`; nothing gathers θ.

**Node-wide numbers and decisions.** Every inner step all-reduces (loss, tokens): the node
reports the mean loss and counts the tokens of all its ranks, so its weight in the swarm's
average is its total tokens. A stop request (SIGTERM on any rank) is an all-reduce(max) at each
point where the loop checks it, so all ranks leave the loop at the same step (`Node._stopping`).

**Across the WAN, shard by shard.** Each rank runs its own swarm endpoint
(`diloco_p2p.swarm.multirank.ShardSync`) whose run id is ``f"{run_id}.shard{r}of{N}"``: shard r of one node only
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
writes, and loading slices each full tensor into the local shard (`ShardLayout`). A checkpoint moves freely
between world sizes (1 → N, N → 1, N → M), and `export` reads it as a normal one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from diloco_p2p.local.ranks import Ranks

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# -- the model ----------------------------------------------------------------------------------


def uses_bf16_params(device: torch.device, precision: str) -> bool:
    return device.type == "cuda" and precision != "fp32"


def shard_model(model: torch.nn.Module, ranks: Ranks, precision: str = "auto") -> torch.nn.Module:
    """FSDP2 per transformer block and at the root; params become DTensors sharded on dim 0.

    The model is built whole on the host (the same seed gives the same θ at every world size)
    and `fully_shard` moves only this rank's shards to its device.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if uses_bf16_params(ranks.device, precision) else MixedPrecisionPolicy())
    for block in model.model.layers:
        fully_shard(block, mesh=ranks.mesh, mp_policy=mp)
    fully_shard(model, mesh=ranks.mesh, mp_policy=mp)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Free what a forward without backward (an evaluation) leaves unsharded: FSDP2 keeps the root
    module's parameters gathered after forward, for the backward it expects, and the next forward
    would use them as they are. θ written into the shards since (a round that starts from θ + c
    under sync.overlap=eager, a state adopted from the swarm) must reach that forward too."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no module is sharded (`is_dtensor`)
    for module in model.modules() if fsdp is not None else ():
        if isinstance(module, fsdp.FSDPModule):
            module.reshard()


def is_dtensor(x: Any) -> bool:
    """Whether `x` is a DTensor (a parameter FSDP2 sharded, or its optimizer state). Nothing is one
    before `torch.distributed.tensor` is imported, and importing it (with FSDP) takes about 0.7 s of
    a node's 2.5 s start on a quiet CPU, several seconds on a loaded one: a restart waits on it.
    So only `shard_model` imports FSDP, and a node of one rank never does."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def local_view(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (a view: writing to it writes the parameter)."""
    return p.to_local() if is_dtensor(p) else p


def local_rows(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The rows of `full` that this rank holds for a parameter laid out like `like`.

    FSDP2 shards dim 0 in `torch.chunk` order (trailing ranks may get fewer rows, or none);
    the shape check catches any other layout instead of silently loading wrong rows.
    """
    from torch.distributed.tensor import Shard

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
    from torch.distributed.tensor import DTensor

    shard = local.reshape(like.to_local().shape).to(like.device)
    dt = DTensor.from_local(shard, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(),
                            run_check=False)
    return dt.full_tensor().cpu()


def gather_optimizer_state(state: dict, keep: bool) -> dict | None:
    """The AdamW state dict with every DTensor gathered into a full tensor: the 1-rank layout.

    Collective; only the caller with `keep` gets the dict (others None), and the others never
    hold more than one full tensor at a time.
    """
    out: dict[int, dict[str, Any]] = {}
    for idx in sorted(state["state"]):
        entry = {}
        for key, value in state["state"][idx].items():
            full = value.full_tensor().cpu() if is_dtensor(value) else value
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
            if is_dtensor(p) and isinstance(value, torch.Tensor) and value.dim() > 0:
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {idx}.{key} has shape {tuple(value.shape)}, "
                                     f"the parameter {tuple(p.shape)}")
                value = type(p).from_local(local_rows(value, p).to(p.device), p.device_mesh, p.placements,
                                         shape=p.shape, stride=p.stride(), run_check=False)
            sharded[idx][key] = value
    return {"state": sharded, "param_groups": state["param_groups"]}


class ShardLayout:
    """How this rank's flat outer state maps onto the model's parameters.

    The outer optimizer works on `local_views()`: plain parameters on one rank, this rank's
    DTensor shards on N. Checkpoints and exports hold full tensors in the 1-rank layout;
    `to_full` and `to_local` convert between the two (identities on one rank).
    """

    def __init__(self, params: Sequence[torch.Tensor], ranks: Ranks):
        self.params, self.ranks = list(params), ranks
        self.full_numels = [p.numel() for p in self.params]

    def local_views(self) -> list[torch.Tensor]:
        return [local_view(p) for p in self.params]

    def to_full(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The full flat tensor of which `flat` is this rank's part (collective). On N ranks only
        rank 0 gets it (the others None) and no rank holds more than one full parameter extra."""
        if not self.ranks.sharded:
            return flat
        local_numels = [local_view(p).numel() for p in self.params]
        parts = [full_tensor_of(chunk, like).reshape(-1)
                 for chunk, like in zip(flat.split(local_numels), self.params, strict=True)]
        return torch.cat(parts) if self.ranks.leader else None

    def local_range(self, lo: int, hi: int) -> tuple[int, int]:
        """The values [lo, hi) of the full flat layout that this rank holds, as a range of its own
        flat layout (sync.fragments). FSDP2 keeps each parameter's rows in `torch.chunk` order, so a
        rank's values are in full-layout order and those in [lo, hi) are contiguous."""
        if not self.ranks.sharded:
            return lo, hi
        return self._held_below(lo), self._held_below(hi)

    def _held_below(self, x: int) -> int:
        """How many of this rank's values have a full-layout index below x."""
        held = start = 0
        for p in self.params:
            local, rows = local_view(p), p.shape[0] if p.dim() else 1
            per_row = p.numel() // max(rows, 1)
            if is_dtensor(p):
                size, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
                first = min(rank * -(-rows // size), rows)  # torch.chunk: ceil(rows / size) rows a rank
            else:
                first = 0
            held += min(max(x - (start + first * per_row), 0), local.numel())
            start += p.numel()
        return held

    def to_local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full flat tensor (written at any world size)."""
        if full.numel() != sum(self.full_numels):
            raise ValueError(f"outer state has {full.numel()} parameters, this model has {sum(self.full_numels)}")
        if not self.ranks.sharded:
            return full
        return torch.cat([local_rows(c.view(like.shape), like).reshape(-1)
                          for c, like in zip(full.split(self.full_numels), self.params, strict=True)])
