"""Real swarm processes for tests: a seed and training nodes on loopback, started with the CLI.

Every wait here is bounded and polls a file the process writes (the seed's maddrs file, a node's
metrics.jsonl), so a test waits for an event, never for a guessed duration. `Swarm` kills
every process group it started when the test ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.conftest import TINY, set_args
from tests.netns import Host

# A tiny swarm: 5 inner steps a round, short network timeouts so a fault costs seconds.
SWARM = TINY + [
    "run_id=swarm-test", "p2p.host_maddrs=['/ip4/127.0.0.1/tcp/0']", "p2p.connect_timeout=20",
    "sync.min_group_size=2", "sync.matchmaking_timeout=6", "sync.allreduce_timeout=8", "sync.state_timeout=16",
]


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(extra or {}))


class Proc:
    """One `python -m diloco_p2p ...` process in its own process group, output to a log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 prefix: Sequence[str] = ()):
        self.args, self.log_path = args, log_path
        self._log = open(log_path, "w")
        self.popen = subprocess.Popen([*prefix, sys.executable, "-m", "diloco_p2p", *args], stdout=self._log,
                                      stderr=subprocess.STDOUT, env=_env(env), start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        """Signal the process itself (not its p2pd children: a real crash leaves them to die)."""
        os.kill(self.popen.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.args[0]} still running after {timeout:g} s:\n{self.tail()}") from None

    def tail(self, lines: int = 30) -> str:
        return "".join(self.output().splitlines(True)[-lines:])

    def kill_group(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()
        self._log.close()


class Node(Proc):
    def __init__(self, run_dir: Path, args: list[str], env: dict[str, str] | None = None,
                 prefix: Sequence[str] = ()):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        super().__init__(["train", *args, "--run-dir", str(run_dir)], run_dir / "node.log", env, prefix)

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def by_round(self) -> dict[int, dict]:
        """The last record of each round (a resync and a later round may share a number)."""
        return {r["round"]: r for r in self.records()}

    def wait_round(self, round_: int, timeout: float = 120) -> dict:
        wait_until(lambda: round_ in self.by_round(), timeout, f"{self.run_dir.name} to reach round {round_}", self)
        return self.by_round()[round_]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, *procs: Proc) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            if p.popen.poll() is not None and not predicate():
                raise AssertionError(f"{p.args[0]} exited ({p.popen.returncode}) while waiting for {what}:\n{p.tail()}")
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.log_path}\n{p.tail()}" for p in procs)
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{tails}")
        time.sleep(0.1)


class Swarm:
    """A seed plus nodes under `root`; `close` kills them all (also what a failed test left).

    On loopback by default; give `seed_host` (and each node a `host`) from `tests.netns.Hosts`
    to put them on separate hosts of a test network."""

    def __init__(self, root: Path, seed_args: list[str] = (), seed_host: Host | None = None):
        self.root = root
        self.procs: list[Proc] = []
        maddrs = root / "seed.maddrs"
        listen = seed_host.maddr() if seed_host else "/ip4/127.0.0.1/tcp/0"
        self.seed = self._add(Proc(["seed", "--host-maddrs", listen, "--identity",
                                    str(root / "seed.key"), "--maddrs-file", str(maddrs), *seed_args],
                                   root / "seed.log", prefix=seed_host.prefix() if seed_host else ()))
        wait_until(lambda: maddrs.exists() and maddrs.read_text().strip() != "", 60, "the seed's address", self.seed)
        self.maddr = maddrs.read_text().split()[0]
        self.gate = root / "start-gate"  # nodes wait here before round 1 (faults.wait_at_start_gate)

    def wait_joined(self, *nodes: Node, timeout: float = 120) -> None:
        """Wait until `nodes` have joined the swarm and published their `started` records."""
        def ready() -> bool:
            return len(list(self.root.glob(f"{self.gate.name}.ready-*"))) >= len(nodes)

        wait_until(ready, timeout, f"{len(nodes)} nodes to join", *nodes)

    def release(self, *nodes: Node, timeout: float = 120) -> None:
        """Wait until `nodes` have all joined, then let them start round 1 together."""
        self.wait_joined(*nodes, timeout=timeout)
        self.gate.touch()

    def _add(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def node(self, name: str, overrides: list[str] = (), env: dict[str, str] | None = None,
             extra_args: list[str] = (), host: Host | None = None) -> Node:
        """A node joining through the seed, with `SWARM` settings plus `overrides`. It waits at
        the start gate: call `release` (a node started after that goes straight on)."""
        if host is not None:
            overrides = [f"p2p.host_maddrs=['{host.maddr()}']", *overrides]
        args = [*set_args([*SWARM, *overrides]), "--initial-peers", self.maddr, *extra_args]
        return self._add(Node(self.root / name, args, {"DILOCO_P2P_START_GATE": str(self.gate), **(env or {})},
                              prefix=host.prefix() if host else ()))

    def close(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)  # a stopped process ignores everything else
                except ProcessLookupError:
                    pass
            p.kill_group()
