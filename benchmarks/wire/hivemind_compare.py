"""Our all-reduce beside hivemind 1.1.12's `DecentralizedAverager`, on the same shaped links and tensors.

Hosts are network namespaces with tbf-shaped links (`tests/netns.py`, needs root), as in
`benchmarks/wire/allreduce_wan.py`, whose peers (a DHT, its p2pd and our `AllreduceService`) run our
side. hivemind's side: on the same hosts, a DHT and a `DecentralizedAverager` over one flat
tensor, `target_group_size = min_group_size = k`, with `Float16Compression` (fp16) or
`Uniform8BitQuantization` (int8). Its matchmaking runs first (`step(require_trigger=True)`); once
every peer holds its group, all are triggered at the same wall-clock instant, so every column times
the all-reduce alone, from the common start to the slowest peer's end. Bytes per node are what each
host's interface sent during the all-reduce (`ip -s link`, protocol and TCP/IP headers included,
identical accounting for both), the mean over peers. Medians over `--rounds` all-reduces after one
warm-up. Beside them, plain TCP moving the fp16 bytes between the same hosts, all at once
(`allreduce_wan.tcp_ceiling`): the time no fp16 all-reduce over TCP can beat on these links.

`--pace F` runs our side as a node that declared its uplink (`sync.link_mbit` = the link rate,
`sync.pace` = F); `--ours fp16,int8` and `--hivemind fp16,int8` choose the codecs on each side.
Every time is also given as a ratio to hivemind's fp16 all-reduce, the issue's reference. Each
peer also reports how far its average is from the exact mean of the k inputs ("error"): hivemind's
8-bit all-reduce reports success here (hivemind 1.1.12, torch 2.13) while its reducers log
"received 33.3% of input tensors" and the averages are off by about 100% (error ~1), so its int8
times are not of a working all-reduce.

    sudo python benchmarks/wire/hivemind_compare.py [--rates 20,100] [--k 3] [--numel 3500000] [--rounds 3]
                                               [--cc cubic] [--pace 0.97] [--ours fp16,int8]
                                               [--hivemind fp16,int8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.*, tests.netns

from benchmarks.wire import allreduce_wan  # noqa: E402
from tests import netns  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def hivemind_worker(ip: str, initial: list[str], k: int, numel: int, comp: str) -> None:
    """One hivemind peer: matchmake on request, run the all-reduce when told, print its seconds."""
    import hivemind
    import torch
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import Float16Compression, Uniform8BitQuantization

    torch.set_num_threads(1)
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=initial)
    averager = hivemind.DecentralizedAverager(
        [torch.zeros(numel)], dht, start=True, prefix="compare", target_group_size=k, min_group_size=k,
        min_matchmaking_time=3.0, request_timeout=2.0, allreduce_timeout=120,
        compression={"fp16": Float16Compression, "int8": Uniform8BitQuantization}[comp]())
    print(json.dumps({"maddrs": [str(a) for a in dht.get_visible_maddrs()]}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("stop"):
            break
        with averager.get_tensors() as tensors:
            tensors[0][:] = torch.randn(numel, generator=torch.Generator().manual_seed(job["seed"]))
        control = averager.step(wait=False, require_trigger=True, timeout=120)
        while control.stage not in (AveragingStage.AWAITING_TRIGGER, AveragingStage.FINISHED):
            time.sleep(0.05)
        print(json.dumps({"ready": control.stage == AveragingStage.AWAITING_TRIGGER}), flush=True)
        at = json.loads(sys.stdin.readline())["at"]
        time.sleep(max(at - time.time(), 0.0))
        control.allow_allreduce()
        try:
            ok = control.result(180) is not None
        except Exception:  # noqa: BLE001 - a failed round is data here
            ok = False
        seconds = time.time() - at
        print(json.dumps({"status": "ok" if ok else "failed", "seconds": seconds}), flush=True)
        with averager.get_tensors() as tensors:
            average = tensors[0].clone()
        allreduce_wan.await_check(average, k, numel)
    averager.shutdown()
    dht.shutdown()


class HivemindPeer(allreduce_wan.Peer):
    def __init__(self, host: netns.Host, initial: list[str], k: int, numel: int, comp: str):
        argv = [*host.prefix(), sys.executable, __file__, "--worker", host.ip, "--k", str(k), "--numel", str(numel),
                "--initial", json.dumps(initial), "--worker-comp", comp]
        self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self.read()


def tx_bytes(hosts: netns.Hosts, k: int) -> list[int]:
    out = []
    for i in range(k):
        raw = subprocess.run(["ip", "-n", hosts[i].ns, "-s", "-j", "link", "show", "eth0"],
                             capture_output=True, text=True, check=True).stdout
        out.append(json.loads(raw)[0]["stats64"]["tx"]["bytes"])
    return out


def _round(hosts: netns.Hosts, peers: list, k: int, jobs: list[dict], two_step: bool) -> dict:
    for p, job in zip(peers, jobs, strict=True):
        p.send(job)
    if two_step:  # hivemind: wait until every peer holds its group, then trigger all at once
        ready = [p.read() for p in peers]
        if not all(r["ready"] for r in ready):
            raise RuntimeError(f"hivemind matchmaking did not form the group: {ready}")
        at = time.time() + 1.0
        for p in peers:
            p.send({"at": at})
    before = tx_bytes(hosts, k)
    results = [p.read() for p in peers]
    after = tx_bytes(hosts, k)
    errors = allreduce_wan.check_errors(peers)  # once every member has returned: it takes CPU
    assert all(r["status"] == "ok" for r in results), results
    return {"seconds": max(r["seconds"] for r in results), "error": max(errors),
            "sent": statistics.mean(b - a for a, b in zip(before, after, strict=True))}


def measure(hosts: netns.Hosts, k: int, numel: int, rounds: int, ours: bool, comp: str,
            pace_bytes: float | None = None) -> dict:
    from diloco_p2p.swarm.collective import wire

    peers: list = []
    try:
        for i in range(k):
            initial = peers[0].hello["maddrs"] if peers else []
            peers.append(allreduce_wan.Peer(hosts[i], initial, wire.DEFAULT_CHUNK_ELEMENTS, pace_bytes) if ours
                         else HivemindPeer(hosts[i], initial, k, numel, comp))
        ids = [p.hello.get("peer") for p in peers]
        runs = []
        for r in range(rounds + 1):  # round 0 warms up the connections
            at = time.time() + 1.0
            jobs = [{"group": f"cmp-{k}-{r}", "peers": ids, "numel": numel, "seed": i, "at": at, "comp": comp}
                    for i in range(k)]
            got = _round(hosts, peers, k, jobs, two_step=not ours)
            print(f"    {'ours' if ours else 'hivemind'} {comp} round {r}: {got['seconds']:.3f} s, "
                  f"{got['sent'] / 1e6:.3f} MB, error {got['error']:.2g}", file=sys.stderr, flush=True)
            if r:
                runs.append(got)
        return {**{key: statistics.median(x[key] for x in runs) for key in ("seconds", "sent")},
                "error": max(x["error"] for x in runs)}
    finally:
        for p in peers:
            p.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="20,100", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--k", type=int, default=3, help="group size")
    parser.add_argument("--numel", type=int, default=3_500_000, help="values per peer (3.5M = the tiny model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-comp", default="fp16", help=argparse.SUPPRESS)
    parser.add_argument("--initial", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--cc", default=None, choices=["bbr", "cubic", "reno"],
                        help="the hosts' TCP congestion control (default: the machine's)")
    parser.add_argument("--pace", type=float, default=None,
                        help="our peers write at most this fraction of the link rate (sync.pace); default: no cap")
    parser.add_argument("--ours", default="fp16", help="our codecs, comma-separated (fp16, int8)")
    parser.add_argument("--hivemind", default="fp16", help="hivemind's codecs, comma-separated (fp16, int8)")
    args = parser.parse_args()
    if args.worker:
        return hivemind_worker(args.worker, json.loads(args.initial), args.k, args.numel, args.worker_comp)
    if not netns.available():
        raise SystemExit("benchmarks/wire/hivemind_compare.py needs root and iproute2 (ip, tc) to make network namespaces")
    ours, theirs = args.ours.split(","), args.hivemind.split(",")
    if "fp16" not in theirs:
        raise SystemExit("--hivemind must include fp16: every time is given as a ratio to hivemind's fp16")
    print(f"{args.numel:,} values per peer, group of {args.k}; medians over {args.rounds} all-reduces; "
          f"bytes: interface tx per peer; ours paced at {args.pace or 'no cap'}")
    print("plain TCP: the fp16 bytes between the same hosts, all at once, no protocol (no fp16 all-reduce can beat it)")
    print("error: the largest ||average - exact mean|| / ||exact mean|| of any peer and round (the codec's cost; "
          "an all-reduce that lost contributions shows here)")
    print(f"{'Mbit/s':>6} {'side':>14} {'s':>7} {'MB':>7} {'x hivemind fp16':>15} {'error':>8} {'fp16 wire s':>11} "
          f"{'plain TCP s':>11}")
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        pace = args.pace * rate * 1e6 / 8 if args.pace else None
        with netns.Hosts(args.k, rate_mbit=rate, congestion=args.cc) as hosts:
            got = {f"ours {c}": measure(hosts, args.k, args.numel, args.rounds, True, c, pace) for c in ours}
            got |= {f"hivemind {c}": measure(hosts, args.k, args.numel, args.rounds, False, c) for c in theirs}
            bound = 2 * (args.k - 1) / args.k * args.numel * 2  # fp16 bytes each peer sends
            tcp = allreduce_wan.tcp_ceiling(hosts, args.k, {"fp16": bound / (args.k - 1)}, args.rounds)["fp16"]
        wire_s = bound * 8 / (rate * 1e6)
        reference = got["hivemind fp16"]["seconds"]
        for side, m in got.items():
            print(f"{rate:>6g} {side:>14} {m['seconds']:>7.3f} {m['sent'] / 1e6:>7.3f} "
                  f"{m['seconds'] / reference:>15.2f} {m['error']:>8.2g} {wire_s:>11.3f} {tcp:>11.3f}", flush=True)
        row = {"rate": rate, "k": args.k, "numel": args.numel, "pace": args.pace, "sides": got,
               "wire_seconds": wire_s, "tcp_seconds": tcp, "congestion": args.cc or netns.congestion(),
               "load": os.getloadavg()[0]}
        if "ours fp16" in got:  # the columns of the earlier runs
            row |= {"ours": got["ours fp16"], "hivemind": got["hivemind fp16"],
                    "ratio": got["ours fp16"]["seconds"] / reference}
        rows.append(row)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "hivemind_compare.json"  # runs accumulate: the machine is shared, one run is noisy
    old = json.loads(path.read_text()) if path.exists() else []
    run = (f"{time.strftime('%H:%M', time.gmtime())} UTC, --rates {args.rates} --rounds {args.rounds} --cc {args.cc} "
           f"--pace {args.pace} --ours {args.ours} --hivemind {args.hivemind}")
    path.write_text(json.dumps(old + [{**r, "run": run} for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
