"""Unequal hardware: 3 nodes, one at about half speed, with and without dynamic local updates.

The slow node is throttled from outside: its training process is stopped and continued
(SIGSTOP/SIGCONT) every 50 ms, so it computes about half the time, as a slower machine would.
Per mode it prints the fast nodes' compute utilization (compute_seconds / seconds of their
rounds, from their records), the slow node's inner steps per round, the wall time and the final
eval loss. Rounds 2.. count (round 1 measures the speeds DyLU needs).

    python benchmarks/swarm/unequal.py [--config configs/tiny-cpu.yaml] [--rounds 6] [--set a.b=v ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.*

from benchmarks.swarm.round_cost import local_seed, records, train  # noqa: E402


def throttle(proc: subprocess.Popen, stop: threading.Event, period: float = 0.05) -> None:
    try:
        while not stop.is_set() and proc.poll() is None:
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(period)
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(period)
    except ProcessLookupError:  # it finished between the check and the signal
        pass


def run_mode(root: Path, config: str, overrides: list[str], seed_maddr: str) -> tuple[list[dict[int, dict]], float]:
    root.mkdir(parents=True)
    gate = root / "start-gate"
    env = {"DILOCO_P2P_START_GATE": str(gate)}
    procs = [train(root / f"node-{i}", config, overrides, [seed_maddr], env) for i in range(3)]
    while len(list(root.glob("start-gate.ready-*"))) < 3 and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    start = time.perf_counter()
    gate.touch()
    stop = threading.Event()
    slow = threading.Thread(target=throttle, args=(procs[2], stop), daemon=True)
    slow.start()
    codes = [p.wait() for p in procs]
    stop.set()
    slow.join()
    if any(codes):
        raise SystemExit(f"a node exited with {codes}; see {root}")
    return [records(root / f"node-{i}") for i in range(3)], time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with local_seed(root) as maddrs:
            results = {}
            for mode in ("off", "on"):
                overrides = [f"train.max_rounds={args.rounds}", f"run_id=unequal-{mode}",
                             f"outer.dynamic_local_updates={'true' if mode == 'on' else 'false'}", *args.overrides]
                results[mode] = run_mode(root / mode, args.config, overrides, maddrs[0])
    print(f"3 nodes ({args.config}), node 2 stopped half the time; rounds 2..{args.rounds}")
    print(f"{'DyLU':>4} {'fast nodes util':>15} {'slow node steps/round':>21} {'wall s':>7} {'final eval':>10}")
    for mode, (nodes, wall) in results.items():
        rounds = range(2, args.rounds + 1)
        util = statistics.mean(n[r]["utilization"] for n in nodes[:2] for r in rounds if n[r].get("utilization"))
        slow = [nodes[2][r]["step"] - nodes[2][r - 1]["step"] for r in rounds]
        final = nodes[0][args.rounds]["eval_loss"]
        print(f"{mode:>4} {util:>15.1%} {statistics.mean(slow):>21.1f} {wall:>7.1f} {final:>10.4f}")


if __name__ == "__main__":
    main()
