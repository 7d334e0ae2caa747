"""Spawning the local ranks of one node (a small torchrun).

``diloco-p2p train --nproc-per-node N`` spawns N copies of the train command with torchrun's
environment variables and waits (``torchrun -m diloco_p2p train`` does the same); each rank
then joins the process group in `Ranks.from_env`. When one rank dies the others cannot go on,
so the launcher stops them (SIGTERM, then SIGKILL after `grace_s`) and exits with one line naming
the rank. Each rank runs in its own session, so what it forks dies with it; a Ctrl-C reaches the
launcher, which forwards one SIGTERM per signal to every rank.
How a node of N ranks trains: docs/architecture.md, "FSDP inside a node".
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
from typing import Any

from diloco_p2p.errors import UserError
from diloco_p2p.local.ranks import NPROC_FLAG

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 5.0


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


class _RankProcs:
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


def entry_module() -> str:
    """The module this process runs as (``python -m X``), so that its ranks run the same entry:
    ``diloco_p2p`` for the ``diloco-p2p`` script, the test entry for a node the fault tests start."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return spec.name.removesuffix(".__main__") if spec is not None else "diloco_p2p"


def launch_local_ranks(argv: Sequence[str], nproc: int, *, module: str | None = None,
                       grace_s: float = DEFAULT_GRACE_S) -> int:
    """Run ``python -m <module> train <argv>`` as `nproc` local ranks; returns the node's exit code.
    A failed rank gets the others SIGTERM, then SIGKILL after `grace_s`, and one line naming it."""
    argv, _ = split_nproc_arg(argv)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    cmd = [sys.executable, "-m", module or entry_module(), "train", *argv]
    procs = []
    for rank in range(nproc):
        procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                      start_new_session=True, preexec_fn=_die_with_parent))
        log.info("started local rank %d of %d (pid %d)", rank, nproc, procs[-1].pid)
    ranks = _RankProcs(procs)

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


def _fail(ranks: _RankProcs, rank: int, grace_s: float) -> int:
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
