"""The all-reduce over shaped links: three nodes on separate hosts, each link R Mbit/s each way.

Hosts are Linux network namespaces on a bridge (`tests/netns.py`, needs root and iproute2);
every host's link is shaped with a token bucket in both directions, as a home or office uplink
would be. For each rate and wire compression a seed and three nodes (real processes) train a
few rounds in one group of three. Printed per configuration, medians over the committed rounds:

- bytes this node sent in the round's all-reduce, and the lower bound 2(k-1)/k · n · bytes/value;
- all-reduce seconds as the node records them (scatter, reduce, gather, agreement);
- the wire time of those bytes at the link rate (bytes · 8 / R): the all-reduce cannot be faster,
  and the ratio shows what protocol latency and round trips add on top;
- the whole round's seconds (H inner steps, matchmaking, all-reduce, eval), for scale: DiLoCo
  communicates once per round.

    sudo python benchmarks/wan.py [--rates 10,50] [--compressions fp32,fp16,int8] [--size tiny]
                                  [--rounds 3] [--set a.b=v ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.netns, tests.swarm_procs

from join_time import parameters, size_overrides  # noqa: E402

from tests import netns  # noqa: E402
from tests.swarm_procs import Swarm, wait_until  # noqa: E402

BYTES_PER_VALUE = {"fp32": 4, "fp16": 2, "int8": 1}


def measure(hosts: netns.Hosts, compression: str, rounds: int, extra: list[str], root: Path) -> dict:
    overrides = [f"sync.compression={compression}", f"train.max_rounds={rounds}", "sync.target_group_size=3",
                 "sync.matchmaking_timeout=20", "sync.allreduce_timeout=120", *extra]
    swarm = Swarm(root, seed_host=hosts[0])
    try:
        nodes = [swarm.node(name, overrides, host=hosts[i + 1]) for i, name in enumerate("abc")]
        swarm.release(*nodes)
        for n in nodes:
            wait_until(lambda n=n: n.popen.poll() is not None, 900, f"{n.run_dir.name} to finish", n)
            assert n.popen.returncode == 0, n.tail()
        committed = [r for n in nodes for r in n.records() if r["status"] == "committed" and r["group_size"] == 3]
        assert committed, "no round averaged all three nodes"
        return {
            "rounds": len(committed) // 3,
            "bytes_sent": statistics.median(r["bytes_sent"] for r in committed),
            "allreduce_s": statistics.median(r["allreduce_seconds"] for r in committed),
            "round_s": statistics.median(r["seconds"] for r in committed),
        }
    finally:
        swarm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10,50", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--compressions", default="fp32,fp16,int8")
    parser.add_argument("--size", default="tiny", help="tiny or HIDDENxLAYERS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    if not netns.available():
        raise SystemExit("benchmarks/wan.py needs root and iproute2 (ip, tc) to make network namespaces")
    extra = [*size_overrides(args.size), *args.overrides]
    n = parameters(extra)
    print(f"model {args.size}: {n:,} parameters; 3 nodes, one group; medians over committed rounds")
    print(f"{'Mbit/s':>6} {'wire':>5} {'sent MB':>8} {'bound MB':>8} {'all-reduce s':>12} {'wire-time s':>11} "
          f"{'ratio':>6} {'round s':>8}")
    for rate in (float(r) for r in args.rates.split(",")):
        with netns.Hosts(4, rate_mbit=rate) as hosts:
            for compression in args.compressions.split(","):
                with tempfile.TemporaryDirectory(prefix="wan-") as tmp:
                    r = measure(hosts, compression, args.rounds, extra, Path(tmp))
                bound = 2 * 2 / 3 * n * BYTES_PER_VALUE[compression]
                wire_s = r["bytes_sent"] * 8 / (rate * 1e6)
                print(f"{rate:>6g} {compression:>5} {r['bytes_sent'] / 1e6:>8.3f} {bound / 1e6:>8.3f} "
                      f"{r['allreduce_s']:>12.3f} {wire_s:>11.3f} {r['allreduce_s'] / wire_s:>6.2f} "
                      f"{r['round_s']:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
