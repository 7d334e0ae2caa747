"""The local ranks of one node: one process per GPU, or just this one.

A node is 1..N processes on one machine that shard the model with FSDP2 and behave as one DiLoCo
node towards the swarm. `Ranks` carries this process's place in the node and the few small
collectives the loop needs; with one rank every collective returns its input and nothing is
initialised, so the same loop serves 1 and N ranks. `Ranks.from_env` joins the process group
when torchrun's variables say so (NCCL on CUDA, gloo on CPU); every collective runs under a
timeout, so a stalled rank ends in an error instead of a hang.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from diloco_p2p.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

NPROC_FLAG = "--nproc-per-node"
# How long a collective may wait for a peer rank. It must exceed the longest stretch one rank
# spends alone: a checkpoint write on rank 0, or a swarm round (matchmaking + all-reduce +
# state download) that each rank runs for its own shard while the others wait at the next
# collective. A rank that is dead, rather than stalled, is caught much sooner by the launcher.
DEFAULT_TIMEOUT_S = 900.0
CLOSE_WAIT_S = 10.0  # how long a closing rank waits for the others before tearing gloo down


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    return torch.device(name)


class Ranks:
    """This process's rank in its node, and the node-wide collectives (no-ops for one rank)."""

    def __init__(self, device: torch.device, rank: int = 0, world_size: int = 1, mesh: DeviceMesh | None = None):
        self.device, self.rank, self.world_size, self.mesh = device, rank, world_size, mesh

    @property
    def leader(self) -> bool:
        """Rank 0 speaks for the node: run directory, metrics, checkpoints, the node's record."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        if not self.sharded:
            return [float(v) for v in values]
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)  # NCCL: CUDA, gloo: CPU
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank (a node-wide decision)."""
        return self.all_reduce([1.0 if flag else 0.0], "max")[0] > 0

    def broadcast_str(self, value: str, src: int = 0) -> str:
        """`value` of rank `src` on every rank, as raw bytes (no pickle)."""
        if not self.sharded:
            return value
        import torch.distributed as dist

        data = value.encode() if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == src and data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, src)
        return bytes(buf.cpu().tolist()).decode()

    def all_gather_fixed(self, data: bytes) -> list[bytes]:
        """Every rank's `data` (all the same length), in rank order (no pickle)."""
        if not self.sharded:
            return [data]
        import torch.distributed as dist

        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine)
        return [bytes(t.cpu().tolist()) for t in out]

    def node_sha256(self, shard_sha256: str) -> str:
        """The node's hash of θ from each rank's hash of its shard: the shard hash itself on one
        rank, else sha256 over the shard hashes in rank order (one small all-gather)."""
        if not self.sharded:
            return shard_sha256
        return hashlib.sha256(b"".join(self.all_gather_fixed(shard_sha256.encode()))).hexdigest()

    def barrier(self) -> None:
        if self.sharded:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.sharded:
            import torch.distributed as dist

            if dist.is_initialized():
                if dist.get_backend() == "gloo":  # the others may still be in the last collective:
                    try:  # tearing gloo down under them aborts their process (SIGABRT)
                        dist.monitored_barrier(timeout=timedelta(seconds=CLOSE_WAIT_S))
                    except Exception:  # a rank is gone or stuck: close anyway
                        pass
                dist.destroy_process_group()

    @classmethod
    def from_env(cls, device_name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Ranks:
        """One rank, or this process's rank of a node started by our launcher or torchrun."""
        device = resolve_device(device_name)
        world = local_world_size()
        if world <= 1:
            return cls(device)
        missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise UserError(f"WORLD_SIZE={world} but {', '.join(missing)} unset; start the node with "
                            f"`diloco-p2p train {NPROC_FLAG} N` or torchrun")
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if device.type == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise UserError(f"local rank {local_rank} needs a GPU but only {torch.cuda.device_count()} are "
                                f"visible; use {NPROC_FLAG} {torch.cuda.device_count()}")
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
        mesh = init_device_mesh(device.type, (world,))
        log.debug("local rank %d of %d on %s (%s)", rank, world, device, backend)
        return cls(device, rank, world, mesh)


def local_world_size() -> int:
    """WORLD_SIZE from the environment (1 outside torchrun and our launcher)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UserError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from None


def launched_as_rank() -> bool:
    """True inside a rank started by `diloco_p2p.local.launch` or torchrun."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_rank() -> int:
    """RANK from the environment, before the process group exists (0 outside a launch)."""
    return int(os.environ.get("RANK", "0"))


def peer_rank_failed(e: BaseException) -> bool:
    """Whether `e` is a collective failing because another rank died or stalled (NCCL's `DistError`,
    or gloo's RuntimeError by its message)."""
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out")
    )


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
