"""Training rounds over shaped links: k nodes on separate hosts, each link R Mbit/s each way.

Hosts are Linux network namespaces on a bridge (`tests/netns.py`, needs root and iproute2);
every host's link is shaped with a token bucket in both directions, as a home or office uplink
would be. For each rate, group size k and wire compression a seed and k nodes (real processes)
train a few rounds in one group of k. Printed per configuration, medians over the committed rounds:

- bytes this node sent in the round's all-reduce, the lower bound of its collective (butterfly:
  2(k-1)/k of the encoded vector; the sparse ``topk2`` all-gather: its own encoded contribution to
  each of the k-1 others) and how many times fewer bytes than the fp16 bound that is;
- all-reduce seconds as the node records them (scatter, reduce, gather, agreement);
- the wire time of those bytes at the link rate (bytes · 8 / R): the all-reduce cannot be faster,
  and the ratio shows what protocol latency and round trips add on top;
- the whole round's seconds (H inner steps, matchmaking, all-reduce, eval), the seconds the
  loop stood still for the swarm (`exposed_seconds`: matchmaking + all-reduce) and compute
  utilization (inner-step seconds / round seconds), as the round records carry them;
- with ``--overlaps none,eager,inner`` (``sync.overlap``) the same with the all-reduce in the background
  of the next round's inner steps (inner: its first τ): exposed seconds then hold only what compute
  could not hide.

The all-reduce alone (no training, all members starting together) is `benchmarks/wire/allreduce_wan.py`.

    sudo python benchmarks/wire/wan.py [--rates 20,100] [--ks 3] [--compressions fp16,int8,int4,topk2]
                                  [--overlaps none,eager] [--size tiny] [--rounds 3] [--set a.b=v ...]
                                  [--json FILE] [--cc cubic]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.*, tests.netns, tests.harness

from benchmarks.model_sizes import parameters, size_overrides  # noqa: E402
from diloco_p2p.config import SyncConfig  # noqa: E402
from diloco_p2p.planner import plan  # noqa: E402
from tests import netns  # noqa: E402
from tests.harness.procs import wait_until  # noqa: E402
from tests.harness.swarm import ProcessSwarm  # noqa: E402

DENSITY = SyncConfig().topk_density


def lower_bound(n: int, k: int, compression: str) -> float:
    """Bytes a member must send: 2(k-1)/k of the encoded vector (butterfly), or its own sparse
    contribution to each other member (the ``topk2`` all-gather)."""
    if compression == "topk2":
        return (k - 1) * plan.payload_size(n, compression, DENSITY)
    return 2 * (k - 1) / k * plan.payload_size(n, compression)


def measure(hosts: netns.Hosts, k: int, compression: str, overlap: str, rounds: int, extra: list[str],
            root: Path, rate: float) -> dict:
    overrides = [f"sync.compression={compression}", f"train.max_rounds={rounds}", f"sync.target_group_size={k}",
                 f"sync.overlap={overlap}", "sync.matchmaking_timeout=20", "sync.allreduce_timeout=120",
                 f"sync.link_mbit={rate}", *extra]
    committed = [r for records in run_nodes(hosts, k, overrides, root) for r in records
                 if r["status"] == "committed" and r["group_size"] == k]
    assert committed, f"no round averaged all {k} nodes"
    med = {key: statistics.median(r[key] for r in committed)
           for key in ("bytes_sent", "allreduce_seconds", "seconds", "exposed_seconds", "utilization")}
    return {"rounds": len(committed) // k, **med}


def run_nodes(hosts: netns.Hosts, k: int, overrides: list[str], root: Path) -> list[list[dict]]:
    """A seed on hosts[0] and k nodes on hosts[1..k], released together and run to their end:
    each node's round records."""
    swarm = ProcessSwarm(root, seed_host=hosts[0])
    try:
        nodes = [swarm.node(f"n{i}", overrides, host=hosts[i + 1]) for i in range(k)]
        swarm.release(*nodes)
        for n in nodes:
            wait_until(lambda n=n: n.popen.poll() is not None, 900, f"{n.run_dir.name} to finish", n)
            assert n.popen.returncode == 0, n.tail()
        return [n.records() for n in nodes]
    finally:
        swarm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="20,100", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--ks", default="3", help="group sizes, comma-separated")
    parser.add_argument("--compressions", default="fp16,int8", help="of fp32, fp16, int8, int4, topk2")
    parser.add_argument("--overlaps", default="none", help="sync.overlap values: none, delayed, eager, inner")
    parser.add_argument("--size", default="tiny", help="tiny or HIDDENxLAYERS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--cc", default=None, choices=["bbr", "cubic", "reno"],
                        help="the hosts' TCP congestion control (default: the machine's)")
    args = parser.parse_args()
    if not netns.available():
        raise SystemExit("benchmarks/wire/wan.py needs root and iproute2 (ip, tc) to make network namespaces")
    extra = [*size_overrides(args.size), *args.overrides]
    n = parameters(extra)
    print(f"model {args.size}: {n:,} parameters; k nodes, one group; medians over committed rounds")
    print(f"{'Mbit/s':>6} {'k':>2} {'wire':>5} {'overlap':>7} {'sent MB':>8} {'bound MB':>8} {'vs fp16':>7} "
          f"{'all-reduce s':>12} {'wire-time s':>11} {'ratio':>6} {'round s':>8} {'exposed s':>9} {'util':>5}")
    ks, rows = [int(k) for k in args.ks.split(",")], []
    for rate in (float(r) for r in args.rates.split(",")):
        with netns.Hosts(max(ks) + 1, rate_mbit=rate, congestion=args.cc) as hosts:
            for k in ks:
                for compression in args.compressions.split(","):
                    for overlap in args.overlaps.split(","):
                        with tempfile.TemporaryDirectory(prefix="wan-") as tmp:
                            r = measure(hosts, k, compression, overlap, args.rounds, extra, Path(tmp), rate)
                        rows.append(row(rate, k, compression, overlap, n, r))
                        print_row(rows[-1])
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "parameters": n, "rows": rows}, indent=1))


def row(rate: float, k: int, compression: str, overlap: str, n: int, r: dict) -> dict:
    wire_s = r["bytes_sent"] * 8 / (rate * 1e6)
    return {"mbit": rate, "k": k, "wire": compression, "overlap": overlap, **r,
            "bound_bytes": lower_bound(n, k, compression), "fewer_than_fp16": lower_bound(n, k, "fp16") / r["bytes_sent"],
            "wire_seconds": wire_s, "ratio": r["allreduce_seconds"] / wire_s}


def print_row(r: dict) -> None:
    print(f"{r['mbit']:>6g} {r['k']:>2} {r['wire']:>5} {r['overlap']:>7} {r['bytes_sent'] / 1e6:>8.3f} "
          f"{r['bound_bytes'] / 1e6:>8.3f} {r['fewer_than_fp16']:>6.1f}x {r['allreduce_seconds']:>12.3f} "
          f"{r['wire_seconds']:>11.3f} {r['ratio']:>6.2f} {r['seconds']:>8.2f} {r['exposed_seconds']:>9.2f} "
          f"{r['utilization']:>5.2f}", flush=True)

if __name__ == "__main__":
    main()
