"""Volunteers behind NAT: what private members cost the public ones, over shaped links.

k training nodes and a seed on hosts in network namespaces (`tests/netns.py`, needs root, iproute2
and iptables), every link shaped to R Mbit/s each way. Two layouts of the same k nodes:

- all public: every node can be dialled, every member reduces 1/k of the vector;
- P public, k-P private: the private nodes sit each behind its own NAT router (iptables
  MASQUERADE, inbound dropped; they learn it themselves with the dial-back probe) and reduce no
  part, so each public node reduces 1/P (`swarm/collective/allreduce.py`, "Private members").

Printed per layout and per kind of member, medians over the committed rounds of the group of k:
bytes sent and received in the round's all-reduce against the bound for that partition (public:
(k+P-2)/P · n · bytes/value each way; private: n · bytes/value; all public: 2(k-1)/k · n ·
bytes/value), and all-reduce seconds. Results go to `benchmarks/swarm/results/nat.json`.

    sudo python benchmarks/swarm/nat.py [--rate 50] [--k 4] [--private 2] [--size tiny] [--rounds 4]
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
from tests import netns  # noqa: E402
from tests.harness.procs import wait_until  # noqa: E402
from tests.harness.swarm import ProcessSwarm  # noqa: E402

BYTES_PER_VALUE = {"fp32": 4, "fp16": 2, "int8": 1}
RESULTS = Path(__file__).resolve().parent / "results" / "nat.json"


def measure(k: int, private: int, rate: float, rounds: int, extra: list[str], root: Path) -> dict[str, dict]:
    """Run k nodes (the last `private` of them behind NAT) for `rounds` rounds; medians per kind."""
    behind = tuple(range(k + 1 - private, k + 1))  # host 0 is the seed
    overrides = [f"train.max_rounds={rounds}", f"sync.target_group_size={k}", "sync.matchmaking_timeout=30",
                 "sync.allreduce_timeout=120", f"sync.link_mbit={rate}", "p2p.reachability=auto", *extra]
    with netns.Hosts(k + 1, rate_mbit=rate, private=behind, tag="nt") as hosts, ProcessSwarm(
            root, seed_host=hosts[0]) as swarm:
        nodes = [swarm.node(f"n{i}", overrides, host=hosts[i + 1]) for i in range(k)]
        swarm.release(*nodes, timeout=300)
        for n in nodes:
            wait_until(lambda n=n: n.popen.poll() is not None, 900, f"{n.run_dir.name} to finish", n)
            assert n.popen.returncode == 0, n.tail()
        out: dict[str, dict] = {}
        for kind, members in (("public", nodes[: k - private]), ("private", nodes[k - private:])):
            if not members:
                continue
            seen = "reachability: " + kind
            assert all(seen in n.output() for n in members), f"a {kind} node did not detect itself as {kind}"
            committed = [r for n in members for r in n.records() if r["status"] == "committed"
                         and r["group_size"] == k and r["round"] > 1]  # round 1 includes connection set-up
            assert committed, f"no round averaged all {k} nodes"
            out[kind] = {"rounds": len(committed) // len(members), **{
                key: statistics.median(r[key] for r in committed)
                for key in ("bytes_sent", "bytes_received", "allreduce_seconds", "seconds")}}
        return out


def bound(kind: str, k: int, public: int, n: int, bytes_per_value: int) -> float:
    """The bytes each way of one member in the partition with `public` reducers."""
    share = 1.0 if kind == "private" else (k + public - 2) / public
    return share * n * bytes_per_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=50.0, help="link rate in Mbit/s")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--private", type=int, default=2, help="how many of the k nodes sit behind NAT")
    parser.add_argument("--size", default="tiny", help="tiny or HIDDENxLAYERS")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    if not netns.nat_available():
        raise SystemExit("benchmarks/swarm/nat.py needs root, iproute2 (ip, tc) and iptables for NAT namespaces")
    extra = [*size_overrides(args.size), *args.overrides]
    n = parameters(extra)
    bpv = BYTES_PER_VALUE["fp16"]
    print(f"model {args.size}: {n:,} parameters, fp16; {args.k} nodes at {args.rate:g} Mbit/s; "
          "medians over committed rounds 2..")
    print(f"{'layout':>14} {'member':>8} {'sent MB':>8} {'recv MB':>8} {'bound MB':>8} {'all-reduce s':>12} "
          f"{'round s':>8}")
    results = {"parameters": n, "size": args.size, "rate_mbit": args.rate, "k": args.k, "compression": "fp16",
               "layouts": {}}
    for private in (0, args.private):
        layout = "all public" if not private else f"{private} of {args.k} NAT"
        with tempfile.TemporaryDirectory(prefix="nat-bench-") as tmp:
            measured = measure(args.k, private, args.rate, args.rounds, extra, Path(tmp))
        for kind, r in measured.items():
            r["bound_bytes"] = bound(kind, args.k, args.k - private, n, bpv)
            print(f"{layout:>14} {kind:>8} {r['bytes_sent'] / 1e6:>8.3f} {r['bytes_received'] / 1e6:>8.3f} "
                  f"{r['bound_bytes'] / 1e6:>8.3f} {r['allreduce_seconds']:>12.3f} {r['seconds']:>8.2f}", flush=True)
        results["layouts"][layout] = measured
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
