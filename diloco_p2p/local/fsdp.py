"""FSDP inside a node: N local ranks train as one DiLoCo node, each owning one shard of θ.

The model is wrapped with FSDP2 per transformer block (Zhao et al. 2023); the ranks are plain
data parallel on one data order, so an N-rank node with batch b sees exactly a 1-rank node's
windows with batch N·b. Each rank keeps θ and the outer momentum of its own shard on the host
(`ShardLayout.local_views`): N ranks hold one copy of the outer state, and the node's θ hash is
sha256 over the shard hashes. Across the WAN shard r meets only shard r of the other nodes
(`diloco_p2p.swarm.multirank`). Checkpoints hold full tensors in the 1-rank layout, so they move
freely between world sizes; `ShardLayout` is an identity on one rank.
The design: docs/architecture.md, "FSDP inside a node".
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
    """FSDP2 per transformer block and at the root; params become DTensors sharded on dim 0. The
    model is built whole on the host, so a seed gives the same θ at every world size."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if uses_bf16_params(ranks.device, precision) else MixedPrecisionPolicy())
    for block in model.model.layers:
        fully_shard(block, mesh=ranks.mesh, mp_policy=mp)
    fully_shard(model, mesh=ranks.mesh, mp_policy=mp)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Free what a forward without backward (an evaluation) leaves gathered at the root, so that θ
    written into the shards since (an eager correction, an adopted state) reaches the next forward."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no module is sharded (`is_dtensor`)
    for module in model.modules() if fsdp is not None else ():
        if isinstance(module, fsdp.FSDPModule):
            module.reshard()


def is_dtensor(x: Any) -> bool:
    """Whether `x` is a DTensor, without importing `torch.distributed.tensor`: that import costs a
    node's start about 0.7 s, so only `shard_model` imports FSDP and a 1-rank node never does."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def local_view(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (a view: writing to it writes the parameter)."""
    return p.to_local() if is_dtensor(p) else p


def local_rows(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The rows of `full` this rank holds for a parameter laid out like `like` (dim 0, `torch.chunk`
    order); the shape check refuses any other layout rather than load wrong rows."""
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
    """The AdamW state dict with every DTensor gathered full (the 1-rank layout). Collective; only
    the caller with `keep` gets it, and the others hold one full tensor at a time."""
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
    """How this rank's flat outer state maps onto the model's parameters: `local_views()` (this
    rank's shards), and `to_full` / `to_local` to and from the 1-rank layout (identities on one rank)."""

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
