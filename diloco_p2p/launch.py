"""Local ranks of one node: spawning them, and joining them into a process group.

A node may be N processes on one machine (one per GPU) that shard the model with FSDP2 and
behave as one DiLoCo node towards the swarm (see `diloco_p2p.fsdp`). Two ways to start them:

- ``diloco-p2p train --nproc-per-node N ...``: `launch_local_ranks` is a small torchrun. It
  spawns N copies of ``python -m diloco_p2p train ...`` with torchrun's environment variables
  (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and waits.
- ``torchrun --nproc-per-node N -m diloco_p2p train ...``: torchrun sets the same variables.

Either way each rank calls `init_local_ranks`, which reads those variables and joins the
process group (NCCL on CUDA, gloo on CPU). Every collective runs under a timeout so a peer
rank that stalls does not hang the others forever.

When one rank dies the node cannot go on: the FSDP collectives of the others would wait for
it. The launcher then stops the other ranks (SIGTERM, then SIGKILL after `grace_s`) and exits
non-zero with one line naming the rank and its exit code; torchrun does the same. The swarm
carries on without the node: its peers see it miss a round, as for any dead node.

Each rank runs in its own session (and process group), so whatever it forks (hivemind's DHT
process, p2pd) is killed with it when the launcher cleans up after a dead rank. Signals: a
Ctrl-C in the terminal reaches only the launcher, which forwards exactly one SIGTERM per signal
to every rank (the first asks the ranks to stop at the next safe point, node-wide; a second
makes them exit at once).
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from diloco_p2p.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from diloco_p2p.config import TrainConfig

log = logging.getLogger(__name__)

NPROC_FLAG = "--nproc-per-node"
# How long a collective may wait for a peer rank. It must exceed the longest stretch one rank
# spends alone: a checkpoint write on rank 0, or a swarm round (matchmaking + all-reduce +
# state download) that each rank runs for its own shard while the others wait at the next
# collective. A rank that is dead, rather than stalled, is caught much sooner by the launcher.
DEFAULT_TIMEOUT_S = 900.0
DEFAULT_GRACE_S = 5.0
_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# -- the launcher ---------------------------------------------------------------------------


def split_nproc_arg(argv: Sequence[str]) -> tuple[list[str], int | None]:
    """`argv` without ``--nproc-per-node N`` (or ``=N``), and N (None when absent)."""
    rest: list[str] = []
    nproc: int | None = None
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in (NPROC_FLAG, "--nproc_per_node"):
            value = value if eq else next(it, "")
            try:
                nproc = int(value)
            except ValueError:
                raise UserError(f"{NPROC_FLAG} needs a whole number of local ranks, got {value!r}") from None
            if nproc < 1:
                raise UserError(f"{NPROC_FLAG} must be at least 1, got {nproc}")
            continue
        rest.append(arg)
    return rest, nproc


def launched_as_rank() -> bool:
    """True inside a rank started by `launch_local_ranks` or torchrun."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (the usual torchrun way)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL if the launcher dies, so no rank is orphaned."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Ranks:
    """The spawned rank processes and their exit codes."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.codes: dict[int, int] = {}
        self.pidfds = {os.pidfd_open(p.pid): rank for rank, p in enumerate(procs)}

    def live(self) -> list[int]:
        return [r for r in range(len(self.procs)) if r not in self.codes]

    def wait_any(self, timeout: float | None) -> list[int]:
        """Ranks that exited within `timeout` (reaped), in rank order; [] on timeout."""
        fds = [fd for fd, r in self.pidfds.items() if r not in self.codes]
        if not fds:
            return []
        ready, _, _ = select.select(fds, [], [], timeout)
        done = sorted(self.pidfds[fd] for fd in ready)
        for rank in done:
            self.codes[rank] = self.procs[rank].wait()
        return done

    def signal(self, sig: int) -> None:
        for rank in self.live():
            try:
                self.procs[rank].send_signal(sig)
            except ProcessLookupError:
                pass

    def kill_groups(self) -> None:
        """SIGKILL what is left in each rank's process group: a rank that was killed leaves its
        forked helpers (hivemind's DHT process and its p2pd) behind, orphaned."""
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self) -> None:
        for fd in self.pidfds:
            os.close(fd)


def launch_local_ranks(argv: Sequence[str], nproc: int, *, module: str = "diloco_p2p",
                       grace_s: float = DEFAULT_GRACE_S) -> int:
    """Run ``python -m <module> train <argv>`` as `nproc` local ranks; returns the node's exit code.

    0 when every rank exits 0. When a rank fails, the others get SIGTERM, then SIGKILL after
    `grace_s` seconds; one line on stderr names the first failed rank and its exit code, and
    that code is returned (128 + signal number for a rank killed by a signal).
    """
    argv, _ = split_nproc_arg(argv)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    cmd = [sys.executable, "-m", module, "train", *argv]
    procs = []
    for rank in range(nproc):
        procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                      start_new_session=True, preexec_fn=_die_with_parent))
        log.info("started local rank %d of %d (pid %d)", rank, nproc, procs[-1].pid)
    ranks = _Ranks(procs)

    def forward(signum: int, frame: Any) -> None:
        log.info("launcher got %s: asking the local ranks to stop", signal.Signals(signum).name)
        ranks.signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while ranks.live():
            for rank in ranks.wait_any(None):
                if ranks.codes[rank] != 0:
                    return _fail(ranks, rank, grace_s)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ranks.signal(signal.SIGKILL)  # nothing should be left; never leave an orphan behind
        ranks.kill_groups()
        ranks.close()


def _fail(ranks: _Ranks, rank: int, grace_s: float) -> int:
    code = ranks.codes[rank]
    others = ranks.live()
    print(f"error: local rank {rank} of {len(ranks.procs)} {_describe(code)}; "
          f"stopping the node ({len(others)} other rank(s) terminated)", file=sys.stderr, flush=True)
    ranks.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while ranks.live() and time.monotonic() < deadline:
        ranks.wait_any(max(0.0, deadline - time.monotonic()))
    if ranks.live():
        ranks.signal(signal.SIGKILL)
        while ranks.live():
            ranks.wait_any(None)
    return code if code > 0 else 128 - code


# -- inside a rank ------------------------------------------------------------------------------


@dataclass
class LocalRanks:
    """This process's place in its node, and the few small collectives the node loop needs."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def comm_device(self) -> torch.device:
        return self.device  # NCCL wants CUDA tensors, gloo CPU tensors

    def all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank (a node-wide decision)."""
        return self.all_reduce([1.0 if flag else 0.0], "max")[0] > 0

    def broadcast_str(self, value: str, src: int = 0) -> str:
        """`value` of rank `src` on every rank, as raw bytes (no pickle)."""
        import torch
        import torch.distributed as dist

        data = value.encode() if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.comm_device)
        dist.broadcast(size, src)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.comm_device)
        if self.rank == src and data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, src)
        return bytes(buf.cpu().tolist()).decode()

    def all_gather_fixed(self, data: bytes) -> list[bytes]:
        """Every rank's `data` (all the same length), in rank order (no pickle)."""
        import torch
        import torch.distributed as dist

        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.comm_device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine)
        return [bytes(t.cpu().tolist()) for t in out]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def local_world_size() -> int:
    """WORLD_SIZE from the environment (1 outside torchrun and our launcher)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UserError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from None


def init_local_ranks(train_cfg: TrainConfig, timeout_s: float = DEFAULT_TIMEOUT_S) -> LocalRanks | None:
    """Join this node's process group if we are one of several local ranks; None otherwise.

    NCCL on CUDA (one GPU per LOCAL_RANK), gloo on CPU. `timeout_s` bounds every collective
    and the rendezvous, so a peer rank that stalls ends in an error here instead of a hang.
    """
    world = local_world_size()
    if world <= 1:
        return None
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise UserError(f"WORLD_SIZE={world} but {', '.join(missing)} unset; start the node with "
                        f"`diloco-p2p train {NPROC_FLAG} N` or torchrun")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from diloco_p2p.inner import resolve_device

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = resolve_device(train_cfg.device)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} needs a GPU but only {torch.cuda.device_count()} are visible; "
                            f"use {NPROC_FLAG} {torch.cuda.device_count()}")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    mesh = init_device_mesh(device.type, (world,))
    log.debug("local rank %d of %d on %s (%s)", rank, world, device, backend)
    return LocalRanks(rank=rank, world_size=world, local_rank=local_rank, device=device, mesh=mesh)


def peer_rank_failed(e: BaseException) -> bool:
    """Whether `e` is a collective failing because another rank died or stalled.

    NCCL raises `DistError`s; gloo raises plain RuntimeErrors, told apart by their message.
    """
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out")
    )


# -- entry point ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m diloco_p2p.launch train [--nproc-per-node N] ...``: the train command with local
    ranks; what ``diloco-p2p train`` does once `cli.cmd_train` delegates here (see `train`)."""
    from diloco_p2p.cli import build_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rest, nproc = split_nproc_arg(argv[1:] if argv[:1] == ["train"] else argv)
        args = build_parser().parse_args(["train", *rest])
        return train(args, rest, nproc or 1, module="diloco_p2p.launch")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


def train(args: Any, argv: Sequence[str], nproc: int, *, module: str = "diloco_p2p") -> int:
    """The train command: be the launcher of `nproc` ranks, one of the ranks, or a plain node."""
    from pathlib import Path

    from diloco_p2p import cli

    config = cli._config_from_args(args)  # a bad config fails here, once, before any rank starts
    cli._setup_logging(config.log.level, config.log.json_format)
    if not launched_as_rank():
        return launch_local_ranks(argv, nproc, module=module) if nproc > 1 else cli.cmd_train(args)
    if nproc > 1 and nproc != local_world_size():
        raise UserError(f"{NPROC_FLAG} {nproc} but the launcher started {local_world_size()} ranks; "
                        f"drop {NPROC_FLAG} under torchrun")
    if local_world_size() <= 1:
        return cli.cmd_train(args)
    from diloco_p2p.fsdp import train_local_rank
    from diloco_p2p.node import StopRequested

    run_dir = args.run_dir or Path("runs") / config.run_id
    stop = StopRequested()
    stop.install()
    try:
        records = train_local_rank(config, run_dir, stop, lambda: cli._start_metrics(config, run_dir))
    except Exception as e:
        if not peer_rank_failed(e):
            raise
        # The launcher (or torchrun) names the rank that failed; this rank only follows it.
        print(f"error: local rank {os.environ.get('RANK')}: another rank of this node failed, exiting "
              f"({' '.join(str(e).split())[:160]})", file=sys.stderr, flush=True)
        return 1
    if records and os.environ.get("RANK") == "0":
        last = records[-1]
        log.info("done: round %d, eval loss %s, params %s", last["round"], last["eval_loss"],
                 last["params_sha256"][:12])
    return 0


if __name__ == "__main__":
    sys.exit(main())
