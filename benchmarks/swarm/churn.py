"""Goodput under churn: N tiny nodes with a seeded fault schedule, beside the same run without faults.

Each run is a seed and N nodes (`configs/tiny-cpu.yaml` with H=20, target group 4,
sync.allreduce_timeout=15, sync.matchmaking_timeout=5, and train.max_rounds far past what they
reach), real processes started with the CLI (`tests.harness.swarm.ProcessSwarm`), released into
round 1 together and left to train for `--minutes` of wall time. The faults run fires one fault
every `--interval` seconds (uniform), at a node drawn at random; the schedule (times, kinds, each
fault's order of nodes) comes from `--seed` alone:

- kill: SIGKILL of the node's main process. Its DHT process and p2pd must die with it: the script
  notes any still alive at the restart, 10 s later, then kills them, and restarts the node with the
  same command line and run directory (it resumes from its checkpoint or downloads the swarm's state);
- term: SIGTERM (the node stops at its next safe point), the same restart 10 s later;
- stop: SIGSTOP of the main process for 20 s (its DHT process and p2pd keep running), then SIGCONT;
- partition: the node's host link goes down for 20 s. Only with network namespaces (`tests/netns.py`,
  root): with `partition` among `--faults`, every node of both runs is on a host of its own.

A node is away from its fault until its first committed round after the restart (or SIGCONT, or
the link's return). A fault never hits an away node: the schedule allows 20 s from a restart to
that first round, and at run time a node slower than that is passed over for the next one in the
fault's seeded order (the fault log says so).

Measured from each node's round records (metrics.jsonl, time-stamped as this script sees them
appear, every 0.5 s), within the run's wall time: committed node-rounds (the goodput ratio is
faults / no faults), the highest committed round, forks (a round whose committed records hold
different θ: `params_sha256` is the hash after the round's outer step) and, among them, rounds
where two members of one group disagree (group sizes that add up to more than N: no two disjoint
groups could hold them), resyncs, restarts (time and rounds to the first committed round; a
restart whose process exits or never commits has failed), eval loss at the highest round, and the
median round time of the other nodes while one is away against the run without faults.

The inner steps' median time per round (`compute_seconds`) shows how much CPU the nodes got: where
the two runs differ by more than 15% the machine's load changed between them, and the table says
the runs are not comparable. One table (both runs side by side, the restarts, the fault log) is
printed and written beside the JSON; a PNG draws the highest committed round over time for both runs with the faults marked
(`bench` extra: matplotlib).

    python benchmarks/swarm/churn.py    # 4 nodes, 8 min a run: about 17 min in all
    python benchmarks/swarm/churn.py [--nodes 4] [--minutes 8] [--seed 0] [--faults kill,stop,term[,partition]]
        [--interval 30,60] [--set a.b=v ...] [--only faults|clean] [--out benchmarks/swarm/results/churn_4n.json]
        [--work DIR]    # keep the run directories and node logs there
    python benchmarks/swarm/churn.py --report benchmarks/swarm/results/churn_4n.json    # the table and plot again
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # for benchmarks.*, tests.harness

from benchmarks.swarm.churn_report import (  # noqa: E402
    CONFIG,
    SCENARIO,
    report,
    restart_failed,
    summarize,
)
from tests import netns  # noqa: E402
from tests.harness import reaping  # noqa: E402
from tests.harness.swarm import Node, ProcessSwarm  # noqa: E402

KINDS = ("kill", "stop", "term", "partition")
LENGTH = {"kill": 10.0, "term": 10.0, "stop": 20.0, "partition": 20.0}  # fault to restart / SIGCONT / link up
REJOIN_S = 20.0  # the schedule's allowance from a restart to the node's first committed round
TERM_GRACE_S = 60.0  # past the restart time, how long a SIGTERMed node may take to exit before SIGKILL
FIELDS = ("round", "status", "params_sha256", "group_size", "seconds", "compute_seconds", "eval_loss")


# -- the schedule (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the release into round 1
    kind: str
    node: int  # the node the schedule picks: the first of `order` that is not away
    order: tuple[int, ...]  # every node, in this fault's seeded order (run time falls back along it)

    @property
    def away(self) -> float:
        """How long the schedule takes the node to be away."""
        return LENGTH[self.kind] + (REJOIN_S if self.kind in ("kill", "term") else 0.0)


def schedule(seed: int, nodes: int, seconds: float, kinds: Sequence[str],
             interval: tuple[float, float]) -> list[Fault]:
    """One fault every uniform(interval) seconds, of a random kind, at a random node not away then;
    only faults that end (restart, SIGCONT, link up) within `seconds`. The same seed gives the same list."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    back = [0.0] * nodes  # when each node is back, by the schedule
    t = 0.0
    while True:
        t += rng.uniform(*interval)
        kind = rng.choice(list(kinds))
        order = tuple(rng.sample(range(nodes), nodes))
        if t >= seconds:
            return faults
        free = [i for i in order if back[i] <= t]
        if not free or t + LENGTH[kind] > seconds:
            continue
        fault = Fault(round(t, 3), kind, free[0], order)
        faults.append(fault)
        back[fault.node] = t + fault.away


# -- a run -----------------------------------------------------------------------------------


class Watch(threading.Thread):
    """Every node's new round records, stamped with the time (s after `t0`) this thread first saw
    them; and the machine's load average every 10 s."""

    def __init__(self, run_dirs: list[Path], t0: float):
        super().__init__(daemon=True)
        self.run_dirs, self.t0 = run_dirs, t0
        self.offsets = [0] * len(run_dirs)
        self.seen: list[dict] = []
        self.load: list[tuple[float, float]] = []
        self.lock = threading.Lock()
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.5):
            self.poll()

    def poll(self) -> None:
        t = time.monotonic() - self.t0
        with self.lock:
            for i, run_dir in enumerate(self.run_dirs):
                path = run_dir / "metrics.jsonl"
                if not path.exists():
                    continue
                with open(path, "rb") as f:
                    f.seek(self.offsets[i])
                    data = f.read()
                whole = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
                self.offsets[i] += whole
                for line in data[:whole].splitlines():
                    r = json.loads(line)
                    kept = {k: r.get(k) for k in FIELDS}
                    kept["params_sha256"] = (kept["params_sha256"] or "")[:16]  # plenty to tell θ apart
                    self.seen.append({"t": round(t, 2), "node": i, **kept})
            if not self.load or t - self.load[-1][0] >= 10:
                self.load.append((round(t, 1), os.getloadavg()[0]))

    def stop(self) -> None:
        self.halt.set()
        self.join()
        self.poll()

    def records(self) -> list[dict]:
        with self.lock:
            return list(self.seen)


class Churn:
    """One run: N nodes under `root`, released together, `faults` fired on time, `seconds` long."""

    def __init__(self, root: Path, nodes: int, overrides: list[str], seconds: float, faults: list[Fault],
                 hosts: netns.Hosts | None):
        self.root, self.n, self.overrides, self.seconds = root, nodes, overrides, seconds
        self.hosts, self.faults = hosts, faults
        self.log: list[dict] = []
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.order = itertools.count()  # ties in time keep their order
        self.open: dict[int, dict] = {}  # node -> its fault not yet back
        self.helpers: dict[int, list[int]] = {}  # node -> its DHT process and p2pd, at the fault

    def run(self) -> dict:
        root = self.root
        root.mkdir(parents=True, exist_ok=True)
        self.swarm = ProcessSwarm(root, seed_host=self.hosts[0] if self.hosts else None)
        try:
            self.procs = [self._start(i) for i in range(self.n)]
            self.swarm.release(*self.procs, timeout=600)
            self.t0 = time.monotonic()
            self.watch = Watch([root / f"n{i}" for i in range(self.n)], self.t0)
            self.watch.start()
            for f in self.faults:
                self._at(f.at, lambda f=f: self._fire(f))
            while (now := self._now()) < self.seconds:
                while self.events and self.events[0][0] <= now:
                    heapq.heappop(self.events)[2]()
                self._back()
                time.sleep(0.1)
            self.watch.stop()
            self._back()
            exits = {f"n{i}": p.popen.returncode for i, p in enumerate(self.procs) if p.popen.poll() is not None}
            for f in self.log:
                if f["kind"] in ("kill", "term") and f.get("ended") is not None:
                    f["restart_failed"] = restart_failed(f, self.seconds)
            seen = self.watch.records()
            return {"records": seen, "faults": self.log, "exited_on_their_own": exits, "load": self.watch.load,
                    "summary": summarize(seen, self.n, self.seconds, self.log)}
        finally:
            if hasattr(self, "watch"):
                self.watch.halt.set()
            self.swarm.close()

    # -- plumbing

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (t, next(self.order), action))

    def _start(self, i: int) -> Node:
        loopback = [] if self.hosts else ["p2p.host_maddrs=['/ip4/127.0.0.1/tcp/0']"]
        return self.swarm.node(f"n{i}", [*SCENARIO, *loopback, *self.overrides], settings=(),
                               extra_args=["--config", str(ROOT / CONFIG)],
                               host=self.hosts[i + 1] if self.hosts else None)

    def _say(self, entry: dict, what: str) -> None:
        print(f"  [{self._now():6.1f} s] n{entry['node']} {entry['kind']}: {what}", flush=True)

    def _back(self) -> None:
        """Close each open fault whose node has committed a round since it ended."""
        if not hasattr(self, "watch"):
            return
        seen = self.watch.records()
        for i, entry in list(self.open.items()):
            if entry.get("ended") is None:
                if entry["kind"] == "term" and "exit_s" not in entry and self.procs[i].popen.poll() is not None:
                    entry["exit_s"] = round(self._now() - entry["fired"], 2)  # SIGTERM to exit, within 0.1 s
                continue
            after = [r for r in seen if r["node"] == i and r["t"] >= entry["ended"]]
            first = next((k for k, r in enumerate(after) if r["status"] == "committed"), None)
            if first is not None:
                entry["back"] = after[first]["t"]
                entry["to_commit_s"] = round(entry["back"] - entry["ended"], 2)
                entry["records_to_commit"] = [r["status"] for r in after[:first + 1]]
                entry["first_round"] = after[first]["round"]
                self._say(entry, f"back: round {entry['first_round']} committed {entry['to_commit_s']:.1f} s "
                                 f"after the {'restart' if entry['kind'] in ('kill', 'term') else 'end'} "
                                 f"({', '.join(entry['records_to_commit'])})")
                del self.open[i]
            elif entry["kind"] in ("kill", "term") and "exit_code_after_restart" not in entry \
                    and self.procs[i].popen.poll() is not None:
                entry["exit_code_after_restart"] = self.procs[i].popen.returncode
                self._say(entry, f"the restarted process exited ({entry['exit_code_after_restart']})")

    # -- the faults

    def _fire(self, f: Fault) -> None:
        entry = {"at": f.at, "kind": f.kind, "scheduled_node": f.node, "node": None, "fired": None}
        self.log.append(entry)
        node = next((i for i in f.order if i not in self.open and self.procs[i].popen.poll() is None), None)
        if node is None:
            entry["skipped"] = "every node away or down"
            print(f"  [{self._now():6.1f} s] {f.kind}: skipped, every node away or down", flush=True)
            return
        if node != f.node:
            entry["note"] = f"n{f.node} still away: n{node}, the next in the fault's order"
        entry.update(node=node, fired=round(self._now(), 2))
        self.open[node] = entry
        proc = self.procs[node]
        self.helpers[node] = reaping.descendants(proc.pid)
        if f.kind == "kill":
            proc.signal(signal.SIGKILL)
            try:
                entry["main_exit"] = proc.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                entry["main_exit"] = None  # a SIGKILL that did not kill: the restart reaps it and says so
        elif f.kind == "term":
            proc.signal(signal.SIGTERM)
        elif f.kind == "stop":
            proc.signal(signal.SIGSTOP)
        elif f.kind == "partition":
            self.hosts.cut(node + 1)
        self._say(entry, f"fired ({len(self.helpers[node])} helper processes)" + (
            f"; {entry['note']}" if "note" in entry else ""))
        end = entry["fired"] + LENGTH[f.kind]
        self._at(end, lambda: self._end(entry, end))

    def _end(self, entry: dict, due: float) -> None:
        node, proc = entry["node"], self.procs[entry["node"]]
        if entry["kind"] == "stop":
            proc.signal(signal.SIGCONT)
        elif entry["kind"] == "partition":
            self.hosts.heal(node + 1)
        else:
            if proc.popen.poll() is None and entry["kind"] == "term" and self._now() < due + TERM_GRACE_S:
                self._at(self._now() + 0.5, lambda: self._end(entry, due))  # still stopping
                return
            self._restart(entry, proc)
        entry["ended"] = round(self._now(), 2)
        self._say(entry, "restarted" if entry["kind"] in ("kill", "term") else "resumed")

    def _restart(self, entry: dict, old: Node) -> None:
        node = entry["node"]
        entry["exit_code"] = old.popen.poll()  # None: still running (a SIGTERM past its grace)
        entry["helpers_left"] = [p for p in self.helpers[node] if reaping.alive(p)]
        old.kill()  # the process group and anything else carrying its marker
        entry["left_after_reap"] = reaping.marked(reaping.PROC_VAR, old.token)
        lives = len(self.swarm.nodes(f"n{node}"))
        old.log_path.rename(old.log_path.with_name(f"node.{lives}.log"))  # the restart writes node.log afresh
        self.procs[node] = self._start(node)


# -- main ------------------------------------------------------------------------------------


def _interval(text: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in text.split(","))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"--interval {text}: want LO,HI with 0 < LO <= HI")
    return lo, hi


def _kinds(text: str) -> list[str]:
    kinds = text.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"--faults {text}: choose from {','.join(KINDS)}")
    return kinds


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--minutes", type=float, default=8.0, help="wall time of each run from round 1 on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", type=_kinds, default=_kinds("kill,stop,term"))
    p.add_argument("--interval", type=_interval, default=(30.0, 60.0), help="LO,HI seconds between faults")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="a.b=v for every node")
    p.add_argument("--only", choices=("faults", "clean"))
    p.add_argument("--out", type=Path, help="the JSON (default benchmarks/swarm/results/churn_<nodes>n.json); "
                   "the table (.txt) and plot (.png) go beside it")
    p.add_argument("--work", type=Path, help="keep the run directories and node logs here (default: a temporary one)")
    p.add_argument("--report", type=Path, help="run nothing: the table and plot again from this JSON")
    args = p.parse_args()
    if args.report:
        report(args.report)
        return
    out = args.out or Path(__file__).resolve().parent / "results" / f"churn_{args.nodes}n.json"
    seconds = args.minutes * 60
    use_netns = "partition" in args.faults
    if use_netns and not netns.available():
        raise SystemExit("--faults partition needs root and iproute2 (network namespaces): run with sudo")
    used = [args.work / n for n in ("clean", "faults") if args.work and (args.work / n).exists()]
    if used:  # its nodes would resume from the old run's checkpoints, and dial its seed's old address
        raise SystemExit(f"--work {args.work} holds an earlier run ({', '.join(map(str, used))}): "
                         "give an empty or new directory, or remove those first")

    # this run's own marker (not one inherited from a test session): the final reap kills only ours
    os.environ[reaping.SESSION_VAR] = f"{os.getpid()}-{reaping.new_token()}"
    for sig in (signal.SIGINT, signal.SIGTERM):  # also where SIGINT was ignored at start (a background job)
        signal.signal(sig, _interrupt)
    faults = schedule(args.seed, args.nodes, seconds, args.faults, args.interval)
    print(f"{len(faults)} faults scheduled: " + ", ".join(f"{f.at:.0f}s n{f.node} {f.kind}" for f in faults),
          flush=True)
    result = {"command": "python benchmarks/swarm/churn.py " + shlex.join(sys.argv[1:]),
              "args": {"nodes": args.nodes, "minutes": args.minutes, "seed": args.seed, "faults": ",".join(args.faults),
                       "interval": ",".join(f"{x:g}" for x in args.interval), "set": args.overrides},
              "config": CONFIG, "scenario": SCENARIO, "runs": {}}
    hosts = None
    work = args.work or Path(tempfile.mkdtemp(prefix="churn-"))
    try:
        if use_netns:
            hosts = netns.Hosts(args.nodes + 1)
        for name in ("clean", "faults"):
            if args.only and args.only != name:
                continue
            print(f"{name}: {args.nodes} nodes for {args.minutes:g} min under {work / name}", flush=True)
            run = Churn(work / name, args.nodes, args.overrides, seconds, faults if name == "faults" else [], hosts)
            result["runs"][name] = run.run()
            print(f"{name}: {json.dumps(result['runs'][name]['summary'])}", flush=True)
    finally:
        if hosts is not None:
            hosts.close()
            listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            result["netns_left"] = [line.split()[0] for line in listing.splitlines() if line.startswith(hosts.tag)]
        result["left_after_close"] = reaping.reap_session()  # every run closed its swarm: expect none
        if result["left_after_close"] or result.get("netns_left"):
            print(f"left behind and now removed: processes {result['left_after_close']}, "
                  f"namespaces {result.get('netns_left')}", flush=True)
        if not args.work:
            subprocess.run(["rm", "-rf", str(work)])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    report(out)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: every process it started is gone, and its namespaces")
