"""`diloco-p2p demo`: a whole swarm on loopback with zero setup.

Starts a DHT seed and three training nodes as real processes on 127.0.0.1, trains the tiny
model on the embedded corpus for a few rounds, prints one line per round as the nodes report
it, and ends with a summary: rounds, eval loss start -> end, group sizes, and whether every
node ended every round with the same `params_sha256`. Every process it started is stopped on
the way out, also on Ctrl+C (SIGINT) and SIGTERM: the demo installs its own handlers rather than
rely on Python's KeyboardInterrupt, which never comes when SIGINT was ignored at start (a
background job of a non-interactive shell, some supervisors).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from diloco_p2p.errors import UserError

DEMO_OVERRIDES = [
    "run_id=demo", "model.preset=tiny", "inner.lr=0.003", "inner.batch_size=8", "inner.seq_len=128",
    "inner.warmup_steps=10", "outer.inner_steps=20", "train.eval_batches=4", "train.num_threads=1",
    "sync.min_group_size=2", "sync.matchmaking_timeout=10", "sync.allreduce_timeout=20",
    "p2p.host_maddrs=['/ip4/127.0.0.1/tcp/0']", "p2p.connect_timeout=30",
]


class _Stopped(Exception):
    """The demo was asked to stop by `signum`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StopSignals:
    """SIGINT and SIGTERM set `signum`; the demo's waits call `check`, which raises `_Stopped`. The
    handler only records: a raise could land between starting a process and recording it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = self.signum or signum

    def check(self) -> None:
        if self.signum is not None:
            raise _Stopped(self.signum)


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(log_path, "w") as log_file:
        return subprocess.Popen([sys.executable, "-m", "diloco_p2p", *args], stdout=log_file,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for_file(path: Path, proc: subprocess.Popen, timeout: float, stop: _StopSignals) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stop.check()
        if path.exists() and path.read_text().strip():
            return path.read_text().split()[0]
        if proc.poll() is not None:
            raise UserError(f"the demo seed exited early (code {proc.returncode}); see {path.parent / 'seed.log'}")
        time.sleep(0.1)
    raise UserError(f"the demo seed did not publish its address within {timeout:g} s")


def _read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_demo(nodes: int = 3, rounds: int = 5, root: Path | None = None, extra: list[str] | None = None) -> int:
    root = Path(root) if root else Path(tempfile.mkdtemp(prefix="diloco-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    print(f"demo: a seed and {nodes} nodes on 127.0.0.1, {rounds} rounds; logs in {root}", flush=True)
    with _StopSignals() as stop:
        try:
            return _run(nodes, rounds, root, extra or [], procs, stop)
        except _Stopped as e:
            print(f"\ndemo: interrupted ({e}); stopping every process", flush=True)
            return 128 + e.signum
        finally:
            _stop_all(procs)


def _run(nodes: int, rounds: int, root: Path, extra: list[str], procs: list[subprocess.Popen],
         stop: _StopSignals) -> int:
    """Start the seed and the nodes (each goes into `procs` as soon as it exists), then watch them."""
    seed = _spawn(["seed", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(root / "seed.key"),
                   "--maddrs-file", str(root / "seed.maddrs"), "--witness", "demo"], root / "seed.log")
    procs.append(seed)
    seed_addr = _wait_for_file(root / "seed.maddrs", seed, timeout=60, stop=stop)
    print(f"seed: {seed_addr}", flush=True)
    overrides = DEMO_OVERRIDES + [f"train.max_rounds={rounds}", f"sync.target_group_size={nodes}"] + extra
    set_args = [a for o in overrides for a in ("--set", o)]
    dirs = [root / f"node-{i}" for i in range(nodes)]
    for d in dirs:
        d.mkdir(exist_ok=True)
        procs.append(_spawn(["train", *set_args, "--initial-peers", seed_addr, "--run-dir", str(d)], d / "node.log"))
    return _watch(dirs, procs[1:], rounds, stop)


def _watch(dirs: list[Path], nodes: list[subprocess.Popen], rounds: int, stop: _StopSignals) -> int:
    shown = 0
    while True:
        stop.check()
        records = [{r["round"]: r for r in _read_records(d)} for d in dirs]
        while all(shown in r for r in records):
            rows = [r[shown] for r in records]
            hashes = {row["params_sha256"] for row in rows}
            evals = " ".join(f"{row['eval_loss']:.3f}" if row.get("eval_loss") is not None else "-" for row in rows)
            groups = "/".join(str(row.get("group_size", "-")) for row in rows)
            status = "/".join(row.get("status", "-") for row in rows)
            print(f"round {shown}: eval {evals} | {status} | group {groups} | params "
                  f"{'agree' if len(hashes) == 1 else 'DIFFER'} {next(iter(hashes))[:12]}", flush=True)
            shown += 1
        if all(p.poll() is not None for p in nodes):
            break
        time.sleep(0.5)
    failed = [(d, p.returncode) for d, p in zip(dirs, nodes, strict=True) if p.returncode != 0]
    for d, code in failed:
        print(f"node {d.name} exited with code {code}; last lines of {d / 'node.log'}:", flush=True)
        print("".join((d / "node.log").read_text().splitlines(True)[-5:]), flush=True)
    return _summary(dirs) if not failed else 1


def _summary(dirs: list[Path]) -> int:
    per_node = [{r["round"]: r for r in _read_records(d)} for d in dirs]
    common = sorted(set.intersection(*(set(r) for r in per_node)) - {0})
    if not common:
        print("demo: no round completed on every node", flush=True)
        return 1
    agree = all(len({r[k]["params_sha256"] for r in per_node}) == 1 for k in common)
    start = per_node[0][0].get("eval_loss") if 0 in per_node[0] else None
    end = per_node[0][common[-1]].get("eval_loss")
    groups = sorted({r[k].get("group_size") for r in per_node for k in common})
    statuses = sorted({r[k].get("status") for r in per_node for k in common})
    print(f"summary: {len(common)} rounds on {len(dirs)} nodes; eval loss {start:.3f} -> {end:.3f}; "
          f"group sizes {groups}; statuses {statuses}; params_sha256 "
          f"{'identical on every node every round' if agree else 'DIFFERED between nodes'}", flush=True)
    return 0 if agree else 1
