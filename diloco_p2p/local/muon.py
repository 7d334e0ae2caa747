"""Muon on a node of N local ranks: each matrix orthogonalized whole, by one rank.

FSDP2 shards parameters by rows; Newton–Schulz needs a whole matrix. `ShardedMuon` is torch's
Muon with the orthogonalization moved: momentum on each rank's rows, matrix i gathered on rank
i mod N (as distributed Muon does: Liu et al. 2025, arXiv:2502.16982), orthogonalized there, rows
sent back; the state dict is torch's. Why not torch's Muon on DTensors: docs/architecture.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from diloco_p2p.local.fsdp import is_dtensor


class ShardedMuon(torch.optim.Muon):
    """`torch.optim.Muon` over FSDP2's row-sharded 2-D parameters; every rank steps together."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            momentum = group["momentum"]
            updates = []
            for grad, buf in zip(grads, bufs, strict=True):  # torch's momentum, on this rank's rows
                grad, buf = _local(grad), _local(buf)
                buf.lerp_(grad, 1 - momentum)
                updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)
            ortho = self._orthogonalize(params, updates, group)
            lr = group["lr"]
            for p, update in zip(params, ortho, strict=True):
                local = _local(p)  # a view: writing it writes the parameter's shard
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(update.to(local.dtype), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss

    def _orthogonalize(self, params: list[torch.Tensor], updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """Each update's rows of NS(the whole update matrix), matrix i computed on rank i mod N."""

        def ns(full: torch.Tensor) -> torch.Tensor:
            return _zeropower_via_newtonschulz(full, group["ns_coefficients"], group["ns_steps"], group["eps"])

        sharded = [i for i, p in enumerate(params) if is_dtensor(p) and p.device_mesh.size() > 1]
        out = [ns(u) if i not in sharded else None for i, u in enumerate(updates)]
        if not sharded:
            return out
        import torch.distributed as dist

        mesh = params[sharded[0]].device_mesh
        size, me, pg = mesh.size(), mesh.get_local_rank(), mesh.get_group()
        # Every rank's rows in bf16, where torch's Newton-Schulz starts (so the bytes halve and the
        # arithmetic is a 1-rank node's), padded to torch.chunk's ceil(rows / N) (gather wants equal sizes).
        padded = {i: _pad(updates[i].bfloat16(), -(-params[i].shape[0] // size)) for i in sharded}
        owner = {i: k % size for k, i in enumerate(sharded)}
        gathered = {i: [torch.empty_like(padded[i]) for _ in range(size)] if owner[i] == me else None for i in sharded}
        for work in [dist.gather(padded[i], gathered[i], group=pg, group_dst=owner[i], async_op=True) for i in sharded]:
            work.wait()
        scattered = {i: torch.empty(padded[i].shape, dtype=torch.bfloat16, device=padded[i].device) for i in sharded}
        works = []
        for i in sharded:
            parts = None
            if owner[i] == me:  # the whole matrix: the ranks' rows in order, padding dropped
                rows = params[i].shape[0]
                full = ns(torch.cat(gathered[i])[_chunk_rows(rows, size)])
                parts = [_pad(c, padded[i].shape[0]).contiguous() for c in _chunks(full, size)]
            works.append(dist.scatter(scattered[i], parts, group=pg, group_src=owner[i], async_op=True))
        for work in works:
            work.wait()
        for i in sharded:
            out[i] = scattered[i][: updates[i].shape[0]]
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _pad(rows: torch.Tensor, n: int) -> torch.Tensor:
    """`rows` with zero rows appended up to n rows."""
    if rows.shape[0] == n:
        return rows
    return torch.cat([rows, rows.new_zeros((n - rows.shape[0], *rows.shape[1:]))])


def _chunks(full: torch.Tensor, size: int) -> list[torch.Tensor]:
    """torch.chunk's rows per rank (FSDP2's layout), an empty block for a rank it leaves none."""
    chunks = list(torch.chunk(full, size, dim=0))
    return chunks + [full[:0]] * (size - len(chunks))


def _chunk_rows(rows: int, size: int) -> torch.Tensor:
    """Indices of the real rows in the N padded blocks of ceil(rows / N) rows, in order."""
    per = -(-rows // size)
    held = [c.shape[0] for c in _chunks(torch.empty(rows, 0), size)]
    return torch.cat([torch.arange(r * per, r * per + n) for r, n in enumerate(held)])
