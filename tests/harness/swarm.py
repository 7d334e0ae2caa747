"""A real swarm for tests: a seed and training nodes started with the CLI, on loopback or on the
hosts of a test network (`tests.netns`). `ProcessSwarm.close` kills everything they started."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tests.harness.procs import Proc, Procs, diloco, faulty_train, read_records, wait_until
from tests.harness.settings import SWARM, set_args
from tests.netns import Host


class Node(Proc):
    """`python -m diloco_p2p train ARGS --run-dir RUN_DIR` with the faults its `env` plans
    (`tests.faults.node`), its output in RUN_DIR/node.log."""

    def __init__(self, run_dir: Path, args: list[str], env: dict[str, str] | None = None,
                 prefix: Sequence[str] = ()):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        argv = faulty_train(*args, "--run-dir", str(run_dir))
        super().__init__(argv, run_dir / "node.log", env, prefix, name=run_dir.name)

    def records(self) -> list[dict]:
        return read_records(self.run_dir)

    def by_round(self) -> dict[int, dict]:
        """The last record of each round (a resync and a later round may share a number)."""
        return {r["round"]: r for r in self.records()}

    def wait_round(self, round_: int, timeout: float = 120) -> dict:
        wait_until(lambda: round_ in self.by_round(), timeout, f"{self.run_dir.name} to reach round {round_}", self)
        return self.by_round()[round_]


class ProcessSwarm:
    """A seed plus nodes under `root`, each a process; `close` kills them all (also after a failure).

    On loopback by default; give `seed_host` (and each node a `host`) from `tests.netns.Hosts`
    to put them on separate hosts of a test network."""

    def __init__(self, root: Path, seed_args: Sequence[str] = (), seed_host: Host | None = None):
        self.root = root
        self.procs = Procs()
        maddrs = root / "seed.maddrs"
        maddrs.unlink(missing_ok=True)  # an earlier swarm's address: not this seed's
        listen = seed_host.maddr() if seed_host else "/ip4/127.0.0.1/tcp/0"
        args = diloco("seed", "--host-maddrs", listen, "--identity", str(root / "seed.key"),
                      "--maddrs-file", str(maddrs), *seed_args)
        try:
            self.seed = self.procs.start(args, root / "seed.log", prefix=seed_host.prefix() if seed_host else ())
            wait_until(lambda: maddrs.exists() and maddrs.read_text().strip() != "", 90, "the seed's address",
                       self.seed)
        except BaseException:
            self.close()
            raise
        self.maddr = maddrs.read_text().split()[0]
        self.gate = root / "start-gate"  # nodes wait here before round 1 (`tests.faults.injection`)

    def node(self, name: str, overrides: Sequence[str] = (), env: dict[str, str] | None = None,
             extra_args: Sequence[str] = (), host: Host | None = None, settings: Sequence[str] = SWARM) -> Node:
        """A node joining through the seed, with `settings` (tiny and quick; `()` to run a config
        file given in `extra_args` as it is) plus `overrides`. It waits at the start gate: call
        `release` (a node started after that goes straight on)."""
        if host is not None:
            overrides = [f"p2p.host_maddrs=['{host.maddr()}']", *overrides]
        args = [*set_args([*settings, *overrides]), "--initial-peers", self.maddr, *extra_args]
        env = {"DILOCO_P2P_START_GATE": str(self.gate), **(env or {})}
        node = Node(self.root / name, args, env, prefix=host.prefix() if host else ())
        self.procs.add(node)
        return node

    def nodes(self, name: str) -> list[Node]:
        """Every node started as `name`, in start order (a restart reuses the name)."""
        return [p for p in self.procs if isinstance(p, Node) and p.run_dir.name == name]

    def wait_joined(self, *nodes: Node, timeout: float = 120) -> None:
        """Wait until `nodes` have joined the swarm and published their `started` records."""
        def ready() -> bool:
            return len(list(self.root.glob(f"{self.gate.name}.ready-*"))) >= len(nodes)

        wait_until(ready, timeout, f"{len(nodes)} nodes to join", *nodes)

    def release(self, *nodes: Node, timeout: float = 120) -> None:
        """Wait until `nodes` have all joined, then let them start round 1 together."""
        self.wait_joined(*nodes, timeout=timeout)
        self.gate.touch()

    def close(self) -> None:
        self.procs.close()

    def __enter__(self) -> ProcessSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
