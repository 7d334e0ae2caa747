"""Issue 17's numbers: the butterfly against the grid all-reduce, and matchmaking's DHT traffic.

1. All-reduce, in this process on loopback p2pd daemons (`tests.harness.loopback`): N = 4 and 6
   members, one butterfly of N (`butterfly_max` = N) against the grid (2 x 2, 2 x 3, 3 x 2), a
   vector of `--numel` values. Per member and all-reduce: bytes sent, streams opened (messages),
   the lower bound 2(N-1)/N * n * b, and seconds (the slowest member; medians over `--repeats`).
   Loopback on a shared 2-core machine: seconds are CPU, not links (`benchmarks/wire/allreduce_wan.py`
   shapes links).
2. Membership: N matchmakers on in-memory stand-ins for the DHT and p2pd (`tests.harness.inmemory`)
   form one round, arriving over 0.5 s: DHT gets and stores per node (max), entries a read returns
   (max), groups formed, seconds to the last return (one process does every node's work: CPU grows
   as N^2 here, as N on each real node).

    python benchmarks/wire/scale.py [--numel 1000000] [--repeats 3] [--compressions fp16,int8]
                               [--members 4,16,64,256] [--out benchmarks/wire/results/scale.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.harness

import torch  # noqa: E402

from diloco_p2p.swarm.collective import hierarchy, wire  # noqa: E402
from diloco_p2p.swarm.collective.allreduce import AllreduceService  # noqa: E402
from tests.harness.inmemory import one_round  # noqa: E402
from tests.harness.loopback import AllreducePeers  # noqa: E402

# (members, butterfly_max, scheme): butterfly_max >= members is one butterfly
LAYOUTS = [(4, 4, "butterfly"), (4, 2, "grid 2x2"), (6, 6, "butterfly"), (6, 3, "grid 2x3"), (6, 2, "grid 3x2")]


def count_streams(services: list[AllreduceService]) -> dict[int, int]:
    """Wrap each service's stream opener: messages (streams) opened, per service."""
    counts = {id(s): 0 for s in services}
    for s in services:
        opener = s._send_stream

        async def counted(session, j, header, frames, _opener=opener, _key=id(s)):
            if header["kind"] != "ping":
                counts[_key] += 1
            return await _opener(session, j, header, frames)

        s._send_stream = counted
    return counts


def allreduce_rows(numel: int, repeats: int, compressions: list[str]) -> list[dict]:
    rows = []
    with AllreducePeers(6, prefix="scale", chunk_elements=wire.DEFAULT_CHUNK_ELEMENTS) as peers:
        counts = count_streams(peers.services)
        for compression in compressions:
            for k, butterfly_max, scheme in LAYOUTS:
                services, ids = peers.services[:k], peers.peers[:k]
                runs = []
                for rep in range(repeats + 1):  # the first opens connections: not measured
                    xs = [torch.randn(numel) for _ in range(k)]
                    for s in services:
                        counts[id(s)] = 0
                    group_id = f"scale-{uuid.uuid4().hex}"

                    async def members(xs=xs, group_id=group_id, services=services, ids=ids,
                                      butterfly_max=butterfly_max, compression=compression):
                        return await asyncio.gather(*(
                            hierarchy.average(s, group_id, ids, x, 1000.0 + i, butterfly_max=butterfly_max,
                                              compression=compression, timeout=120.0)
                            for i, (s, x) in enumerate(zip(services, xs, strict=True))
                        ))

                    results = peers.loop.run(members(), 300)
                    assert all(r.status == "ok" for r in results), [r.status for r in results]
                    assert all(torch.equal(r.average, results[0].average) for r in results)
                    if rep:
                        runs.append((max(r.seconds for r in results), statistics.mean(r.bytes_sent for r in results),
                                     statistics.mean(counts[id(s)] for s in services)))
                bound = 2 * (k - 1) / k * numel * wire.bytes_per_element(compression)
                row = {"members": k, "scheme": scheme, "butterfly_max": butterfly_max, "compression": compression,
                       "numel": numel, "seconds": statistics.median(r[0] for r in runs),
                       "bytes_sent": statistics.median(r[1] for r in runs), "lower_bound": bound,
                       "messages": statistics.median(r[2] for r in runs)}
                row["bytes_over_bound"] = row["bytes_sent"] / bound
                rows.append(row)
                print(f"{compression:5} N={k} {scheme:10} {row['bytes_sent'] / 1e6:8.3f} MB sent "
                      f"({row['bytes_over_bound']:.4f} x bound)  {row['messages']:5.1f} msgs  "
                      f"{row['seconds']:.3f} s", flush=True)
    return rows


def membership_rows(sizes: list[int]) -> list[dict]:
    rows = []
    for n in sizes:
        r = asyncio.run(one_round(n))
        row = {"members": n, "groups": len(r["groups"]), "gets_max": max(r["gets"]), "stores_max": max(r["stores"]),
               "gets_mean": statistics.mean(r["gets"]), "entries_read_max": max(r["entries_read"]),
               "seconds_in_one_process": r["seconds"]}
        rows.append(row)
        print(f"N={n:4}: {row['groups']} group, DHT gets/node max {row['gets_max']}, stores/node max "
              f"{row['stores_max']}, entries per read max {row['entries_read_max']}, "
              f"{row['seconds_in_one_process']:.2f} s (all nodes in one process)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compressions", default="fp16,int8")
    parser.add_argument("--members", default="4,16,64,256")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "scale.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {
        "allreduce": allreduce_rows(args.numel, args.repeats, args.compressions.split(",")),
        "membership": membership_rows([int(x) for x in args.members.split(",")]),
        "command": "python " + " ".join(sys.argv),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
