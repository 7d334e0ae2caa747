"""How many CPU threads torch may use when several training processes share one machine.

torch's default is one thread per core in *every* process: three nodes on two cores then fight
for the cores, and OpenMP's spinning makes an inner step ~20x slower than at one thread each.
With `train.num_threads` unset, each training process registers itself in a per-user directory
of this machine (one file named by its pid) and uses ``cores // live training processes`` threads
(at least one), re-checked every round, so the count follows nodes that start and stop.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from pathlib import Path

import torch


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class ThreadBudget:
    """torch's CPU threads for this process: `fixed`, or the machine's cores shared among the
    training processes running on it (see the module docstring)."""

    def __init__(self, fixed: int | None, registry: Path | None = None):
        self.fixed = fixed
        self.registry = registry or Path(tempfile.gettempdir()) / f"diloco-p2p-{os.getuid()}-nodes"
        self._entry: Path | None = None
        if fixed is None:
            try:
                self.registry.mkdir(parents=True, exist_ok=True)
                self._entry = self.registry / str(os.getpid())
                self._entry.touch()
                atexit.register(self.close)
            except OSError:  # no shared tmp: count ourselves only
                self._entry = None
        self.apply()

    def local_processes(self) -> int:
        """Training processes on this machine that registered (dead ones' files are removed)."""
        if self._entry is None:
            return 1
        count = 0
        for entry in self.registry.iterdir():
            if entry.name.isdigit() and _alive(int(entry.name)):
                count += 1
            elif entry.name.isdigit():
                entry.unlink(missing_ok=True)
        return max(count, 1)

    def threads(self) -> int:
        if self.fixed is not None:
            return self.fixed
        return max(1, usable_cores() // self.local_processes())

    def apply(self) -> int:
        n = self.threads()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def close(self) -> None:
        if self._entry is not None:
            self._entry.unlink(missing_ok=True)
            self._entry = None
