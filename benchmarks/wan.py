"""Training rounds over shaped links: k nodes on separate hosts, each link R Mbit/s each way.

Hosts are Linux network namespaces on a bridge (`tests/netns.py`, needs root and iproute2);
every host's link is shaped with a token bucket in both directions, as a home or office uplink
would be. For each rate, group size k and wire compression a seed and k nodes (real processes)
train a few rounds in one group of k. Printed per configuration, medians over the committed rounds:

- bytes this node sent in the round's all-reduce, and the lower bound 2(k-1)/k · n · bytes/value;
- all-reduce seconds as the node records them (scatter, reduce, gather, agreement);
- the wire time of those bytes at the link rate (bytes · 8 / R): the all-reduce cannot be faster,
  and the ratio shows what protocol latency and round trips add on top;
- the whole round's seconds (H inner steps, matchmaking, all-reduce, eval), the seconds the
  loop stood still for the swarm (`exposed_seconds`: matchmaking + all-reduce) and compute
  utilization (inner-step seconds / round seconds), as the round records carry them.

The all-reduce alone (no training, all members starting together) is `benchmarks/allreduce_wan.py`.

    sudo python benchmarks/wan.py [--rates 20,100] [--ks 3] [--compressions fp16,int8] [--size tiny]
                                  [--rounds 3] [--set a.b=v ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.netns, tests.harness

from model_sizes import parameters, size_overrides  # noqa: E402

from tests import netns  # noqa: E402
from tests.harness.procs import wait_until  # noqa: E402
from tests.harness.swarm import ProcessSwarm  # noqa: E402

BYTES_PER_VALUE = {"fp32": 4, "fp16": 2, "int8": 1}


def measure(hosts: netns.Hosts, k: int, compression: str, rounds: int, extra: list[str], root: Path,
            rate: float) -> dict:
    overrides = [f"sync.compression={compression}", f"train.max_rounds={rounds}", f"sync.target_group_size={k}",
                 "sync.matchmaking_timeout=20", "sync.allreduce_timeout=120", f"sync.link_mbit={rate}", *extra]
    swarm = ProcessSwarm(root, seed_host=hosts[0])
    try:
        nodes = [swarm.node(f"n{i}", overrides, host=hosts[i + 1]) for i in range(k)]
        swarm.release(*nodes)
        for n in nodes:
            wait_until(lambda n=n: n.popen.poll() is not None, 900, f"{n.run_dir.name} to finish", n)
            assert n.popen.returncode == 0, n.tail()
        committed = [r for n in nodes for r in n.records() if r["status"] == "committed" and r["group_size"] == k]
        assert committed, f"no round averaged all {k} nodes"
        med = {key: statistics.median(r[key] for r in committed)
               for key in ("bytes_sent", "allreduce_seconds", "seconds", "exposed_seconds", "utilization")}
        return {"rounds": len(committed) // k, **med}
    finally:
        swarm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="20,100", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--ks", default="3", help="group sizes, comma-separated")
    parser.add_argument("--compressions", default="fp16,int8")
    parser.add_argument("--size", default="tiny", help="tiny or HIDDENxLAYERS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    if not netns.available():
        raise SystemExit("benchmarks/wan.py needs root and iproute2 (ip, tc) to make network namespaces")
    extra = [*size_overrides(args.size), *args.overrides]
    n = parameters(extra)
    print(f"model {args.size}: {n:,} parameters; k nodes, one group; medians over committed rounds")
    print(f"{'Mbit/s':>6} {'k':>2} {'wire':>5} {'sent MB':>8} {'bound MB':>8} {'all-reduce s':>12} "
          f"{'wire-time s':>11} {'ratio':>6} {'round s':>8} {'exposed s':>9} {'util':>5}")
    ks = [int(k) for k in args.ks.split(",")]
    for rate in (float(r) for r in args.rates.split(",")):
        with netns.Hosts(max(ks) + 1, rate_mbit=rate) as hosts:
            for k in ks:
                for compression in args.compressions.split(","):
                    with tempfile.TemporaryDirectory(prefix="wan-") as tmp:
                        r = measure(hosts, k, compression, args.rounds, extra, Path(tmp), rate)
                    bound = 2 * (k - 1) / k * n * BYTES_PER_VALUE[compression]
                    wire_s = r["bytes_sent"] * 8 / (rate * 1e6)
                    print(f"{rate:>6g} {k:>2} {compression:>5} {r['bytes_sent'] / 1e6:>8.3f} {bound / 1e6:>8.3f} "
                          f"{r['allreduce_seconds']:>12.3f} {wire_s:>11.3f} {r['allreduce_seconds'] / wire_s:>6.2f} "
                          f"{r['seconds']:>8.2f} {r['exposed_seconds']:>9.2f} {r['utilization']:>5.2f}", flush=True)


if __name__ == "__main__":
    main()
