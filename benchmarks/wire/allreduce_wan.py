"""The all-reduce alone over shaped links: k peers on separate hosts, each link R Mbit/s each way.

Hosts are Linux network namespaces on a bridge (`tests/netns.py`, needs root and iproute2), every
host's link shaped with a token bucket in both directions. Each peer is a process on its host
running a hivemind DHT, its p2pd and an `AllreduceService`; no training, so one configuration takes
seconds. All peers start each all-reduce at the same wall-clock instant (one machine, one clock),
so the time measured is the protocol's, not matchmaking skew. Printed per (rate, k, compression),
medians over `--rounds` all-reduces (after one warm-up that opens the connections):

- MB sent per peer and the lower bound 2(k-1)/k · n · bytes/value;
- all-reduce seconds (the slowest peer of the round), the wire time of the bytes a peer sent at
  the link rate (bytes · 8 / R; the all-reduce cannot be faster), and their ratio (goal <= 1.15);
- the transport's ceiling: plain TCP (no libp2p, no protocol) moving the same bytes between the
  same hosts, every host sending its share to each of the k-1 others at once, as an all-reduce's
  members do (`tcp_ceiling`); its ratio to the wire time, and ours to it. With both directions of
  every link loaded, TCP itself falls short of the wire time, by how much depends on its
  congestion control (`--cc`; this machine's default is BBR, most volunteers' hosts run CUBIC).

    sudo python benchmarks/wire/allreduce_wan.py [--rates 20,100,200] [--ks 2,3,4]
                                            [--compressions fp16,int8] [--numel 3500000] [--rounds 3]
                                            [--grid B] [--json OUT] [--cc cubic] [--no-ceiling]
                                            [--pace 0.97] [--threads N] [-v]

With ``--grid B`` every k > B is also measured on the grid all-reduce (`swarm/collective/hierarchy.py`, rows
of about B members: the scheme a round of more than `sync.target_group_size` nodes runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.netns

from tests import netns  # noqa: E402

args_verbose = "-v" in sys.argv
THREADS_ENV = "ALLREDUCE_WAN_THREADS"  # --threads, read by each member process


def worker(ip: str, initial: list[str], chunk: int, pace_bytes: float | None = None) -> None:
    """One peer: print its maddrs and peer id, then run the all-reduces the coordinator sends on stdin."""

    import hivemind
    import torch
    from hivemind.p2p import PeerID

    from diloco_p2p.swarm.collective import hierarchy
    from diloco_p2p.swarm.collective.allreduce import AllreduceService
    from diloco_p2p.swarm.transport.runner import BackgroundLoop

    # One thread by default: several members share this machine's cores, and OpenMP spinning on busy
    # cores costs seconds; --threads gives each member more, as a volunteer's node has its host's cores.
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=initial)
    loop = BackgroundLoop()
    p2p = loop.run(dht.replicate_p2p(), 60)
    service = AllreduceService(p2p, prefix="bench", chunk_elements=chunk, pace_bytes=pace_bytes)
    loop.run(service.start(), 30)
    print(json.dumps({"maddrs": [str(a) for a in dht.get_visible_maddrs()], "peer": p2p.peer_id.to_base58()}),
          flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("stop"):
            break
        peers = [PeerID.from_base58(p) for p in job["peers"]]
        x = torch.randn(job["numel"], generator=torch.Generator().manual_seed(job["seed"]))
        time.sleep(max(job["at"] - time.time(), 0.0))
        bmax = job.get("butterfly_max") or len(peers)  # >= the group: one butterfly
        r = loop.run(hierarchy.average(service, job["group"], peers, x, 1.0, butterfly_max=bmax,
                                       compression=job["comp"], timeout=120), 180)
        print(json.dumps({"status": r.status, "seconds": r.seconds, "sent": r.bytes_sent,
                          "received": r.bytes_received, "phases": r.phases}), flush=True)
        await_check(r.average, len(peers), job["numel"])
    loop.run(service.stop(), 30)
    loop.run(p2p.shutdown(), 30)
    loop.close()
    dht.shutdown()


def await_check(average, k: int, numel: int) -> None:
    """Print the round's `relative_error` once the coordinator says every member has returned
    (`check_errors`): it takes seconds of CPU for large vectors, which it would otherwise take from
    the members still finishing their all-reduce on the same cores."""
    json.loads(sys.stdin.readline())
    print(json.dumps({"error": relative_error(average, k, numel)}), flush=True)


def check_errors(peers: list[Peer]) -> list[float]:
    """Each member's `error` for the round all of them have just reported (`await_check`)."""
    for p in peers:
        p.send({"check": True})
    return [p.read()["error"] for p in peers]


def relative_error(average, k: int, numel: int) -> float:
    """||average - exact mean|| / ||exact mean|| of the k peers' vectors (peer i's is `randn` with seed i):
    what the codec costs, and a check that an all-reduce reporting success averaged everything."""
    import torch

    exact = sum(torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(k)) / k
    return float((average.reshape(-1) - exact).norm() / exact.norm())


def tcp_worker(ip: str) -> None:
    """The transport ceiling, one host: plain TCP, no libp2p. Listens and prints its port; for each
    job connects to every other host, and at the job's instant sends each of them `bytes` (all at
    once, as an all-reduce member sends its scatter and gather) while receiving theirs; prints when
    the last byte from them arrived, counted from the instant."""
    server = socket.create_server((ip, 0))
    print(json.dumps({"port": server.getsockname()[1]}), flush=True)
    received: dict[int, list[float]] = {}
    lock = threading.Lock()
    arrived = threading.Condition(lock)

    def drain(conn: socket.socket) -> None:
        with conn:
            head = conn.recv(16, socket.MSG_WAITALL)
            job, size = int.from_bytes(head[:8], "big"), int.from_bytes(head[8:], "big")
            got = 0
            while got < size:
                data = conn.recv(1 << 20)
                if not data:  # the sender is gone: stop waiting for it
                    break
                got += len(data)
            with arrived:
                received.setdefault(job, []).append(time.time())
                arrived.notify_all()

    def accept() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=drain, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    for n, line in enumerate(sys.stdin):
        job = json.loads(line)
        if job.get("stop"):
            break
        last = _tcp_job(n, job, lambda n=n: received.get(n, []), arrived)
        print(json.dumps({"seconds": last - job["at"]}), flush=True)


def _tcp_job(n: int, job: dict, arrivals: Callable[[], list[float]], arrived: threading.Condition) -> float:
    """Job `n` of `tcp_worker`: connect, wait for the instant, send to every destination at once;
    returns when the last of theirs arrived (`arrivals()`, under `arrived`)."""
    conns = [socket.create_connection((dest_ip, port)) for dest_ip, port in job["dests"]]
    head = n.to_bytes(8, "big") + int(job["bytes"]).to_bytes(8, "big")
    time.sleep(max(job["at"] - time.time(), 0.0))
    senders = [threading.Thread(target=_send_bytes, args=(c, head, int(job["bytes"]))) for c in conns]
    for t in senders:
        t.start()
    with arrived:
        arrived.wait_for(lambda: len(arrivals()) >= len(conns), timeout=300)
        last = max(arrivals(), default=job["at"])
    for t in senders:
        t.join()
    return last


def _send_bytes(conn: socket.socket, head: bytes, size: int) -> None:
    """`head`, then `size` zero bytes; then wait for the receiver to close (it has everything)."""
    piece = bytes(1 << 17)
    with conn:
        conn.sendall(head)
        for at in range(0, size, len(piece)):
            conn.sendall(piece[: min(len(piece), size - at)])
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)


def tcp_ceiling(hosts: netns.Hosts, k: int, sizes: dict[str, float], rounds: int) -> dict[str, float]:
    """Seconds (median over `rounds`, the slowest host of each) for every host to receive sizes[s]
    bytes from each of the other k-1 hosts over plain TCP, all sending at once: the time the links
    and the hosts' TCP allow for the bytes of an all-reduce, whatever its protocol."""
    procs = [subprocess.Popen([*hosts[i].prefix(), sys.executable, __file__, "--tcp-worker", hosts[i].ip],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(k)]
    try:
        ports = [json.loads(p.stdout.readline())["port"] for p in procs]
        out = {}
        for scheme, size in sizes.items():
            runs = []
            for _ in range(rounds):
                at = time.time() + 1.0
                for i, p in enumerate(procs):
                    dests = [[hosts[j].ip, ports[j]] for j in range(k) if j != i]
                    p.stdin.write(json.dumps({"dests": dests, "bytes": int(size), "at": at}) + "\n")
                    p.stdin.flush()
                runs.append(max(json.loads(p.stdout.readline())["seconds"] for p in procs))
            out[scheme] = statistics.median(runs)
        return out
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                p.stdin.write('{"stop": true}\n')
                p.stdin.flush()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class _Sampler:
    """Bytes each host sent per 100 ms during a round (-v): where the link idles."""

    def __init__(self, hosts: netns.Hosts, k: int):
        import threading

        self.hosts, self.k, self.samples, self.done = hosts, k, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def tx(self) -> list[int]:
        out = []
        for i in range(self.k):
            raw = subprocess.run(["ip", "-n", self.hosts[i].ns, "-s", "-j", "link", "show", "eth0"],
                                 capture_output=True, text=True).stdout
            out.append(json.loads(raw)[0]["stats64"]["tx"]["bytes"])
        return out

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.time(), self.tx()))
            time.sleep(0.1)

    def stop(self, at: float) -> None:
        self.done.set()
        self.thread.join()
        for (t0, b0), (t1, b1) in zip(self.samples, self.samples[1:], strict=False):
            if t1 < at:
                continue
            mbit = [(y - x) * 8 / (t1 - t0) / 1e6 for x, y in zip(b0, b1, strict=True)]
            print(f"{t1 - at:6.2f} " + " ".join(f"{m:5.1f}" for m in mbit), file=sys.stderr)


class Peer:
    def __init__(self, host: netns.Host, initial: list[str], chunk: int, pace_bytes: float | None = None):
        argv = [*host.prefix(), sys.executable, __file__, "--worker", host.ip, "--chunk", str(chunk),
                "--initial", json.dumps(initial), *(["--pace-bytes", str(pace_bytes)] if pace_bytes else [])]
        self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self.read()

    def read(self) -> dict:
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.popen.wait()}")
        return json.loads(line)

    def send(self, job: dict) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(job) + "\n")
        self.popen.stdin.flush()

    def close(self) -> None:
        if self.popen.poll() is None:
            try:
                self.send({"stop": True})
                self.popen.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.popen.kill()
                self.popen.wait()


def measure(hosts: netns.Hosts, k: int, comps: list[str], numel: int, rounds: int, chunk: int,
            grid: int | None = None, pace_bytes: float | None = None) -> dict:
    peers: list[Peer] = []
    try:
        for i in range(k):
            initial = peers[0].hello["maddrs"] if peers else []
            peers.append(Peer(hosts[i], initial, chunk, pace_bytes))
        ids = [p.hello["peer"] for p in peers]
        out = {}
        schemes = [(comp, None) for comp in comps] + [(comp, grid) for comp in comps if grid and k > grid]
        for comp, bmax in schemes:
            runs = []
            for r in range(rounds + 1):  # round 0 warms up the connections
                at = time.time() + 1.0
                for i, p in enumerate(peers):
                    p.send({"group": f"{comp}-{k}-{r}-{bmax}", "peers": ids, "numel": numel, "seed": i, "at": at,
                            "comp": comp, "butterfly_max": bmax})
                sampler = _Sampler(hosts, k) if args_verbose else None
                results = [p.read() for p in peers]
                if sampler is not None:
                    sampler.stop(at)
                check_errors(peers)
                assert all(x["status"] == "ok" for x in results), results
                if r:
                    runs.append(results)
                    if args_verbose:
                        print([{k: round(v, 3) for k, v in x["phases"].items()} for x in results], file=sys.stderr)
            out[comp if bmax is None else f"{comp}/grid"] = {
                "seconds": statistics.median(max(x["seconds"] for x in rs) for rs in runs),
                "sent": statistics.median(statistics.mean(x["sent"] for x in rs) for rs in runs),
            }
        return out
    finally:
        for p in peers:
            p.close()


def plot(sources: list[Path], out: Path) -> None:
    """Ratio to the wire time against the link rate: the all-reduce (solid) and plain TCP moving the
    same bytes (dashed), one panel per (run, wire), one colour per k; dotted: the 1.15x goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(p.read_text())["rows"] for p in sources]
    schemes = sorted({r["scheme"] for rows in runs for r in rows if "/" not in r["scheme"]})
    fig, axes = plt.subplots(len(runs), len(schemes), figsize=(4.5 * len(schemes), 3.6 * len(runs)),
                             sharey=True, squeeze=False)
    for rows, line in zip(runs, axes, strict=True):
        for scheme, ax in zip(schemes, line, strict=True):
            for k, colour in zip(sorted({r["k"] for r in rows}), ("C0", "C1", "C2", "C3", "C4"), strict=False):
                got = sorted((r["rate_mbit"], r["seconds"] / r["wire_seconds"], (r["tcp_seconds"] or 0) / r["wire_seconds"])
                             for r in rows if r["k"] == k and r["scheme"] == scheme)
                ax.plot([g[0] for g in got], [g[1] for g in got], "o-", color=colour, label=f"k={k} all-reduce")
                ax.plot([g[0] for g in got], [g[2] for g in got], "x--", color=colour, label=f"k={k} plain TCP")
            ax.axhline(1.15, color="grey", lw=0.8, ls=":")
            rates = sorted({r["rate_mbit"] for r in rows})
            ax.set_xscale("log")
            ax.minorticks_off()
            ax.set_xticks(rates, [f"{r:g}" for r in rates])
            ax.set_xlabel("link Mbit/s")
            ax.set_title(f"{scheme}, TCP {rows[0].get('congestion', '?')}")
        line[0].set_ylabel("time / wire time")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="20,100,200", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--ks", default="2,3,4", help="group sizes, comma-separated")
    parser.add_argument("--compressions", default="fp16,int8")
    parser.add_argument("--numel", type=int, default=3_500_000, help="values per peer (3.5M = the tiny model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=None, help="chunk elements (default: the service's)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("-v", action="store_true", help="print each peer's phase times")
    parser.add_argument("--grid", type=int, default=None, help="also the grid all-reduce, rows of about this many")
    parser.add_argument("--json", type=Path, default=None, help="write the table's rows here")
    parser.add_argument("--initial", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--pace", type=float, default=None,
                        help="the peers write at most this fraction of the link rate (sync.pace); default: no cap")
    parser.add_argument("--pace-bytes", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tcp-worker", help=argparse.SUPPRESS)
    parser.add_argument("--cc", default=None, choices=["bbr", "cubic", "reno"],
                        help="the hosts' TCP congestion control (default: the machine's)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each member (default 1; a volunteer's node uses its host's cores)")
    parser.add_argument("--no-ceiling", action="store_true", help="skip the plain-TCP ceiling")
    parser.add_argument("--plot", type=Path, default=None,
                        help="draw the runs in --from (files written by --json) into this PNG, and stop")
    parser.add_argument("--from", dest="sources", type=Path, nargs="+", default=[])
    args = parser.parse_args()
    if args.plot:
        return plot(args.sources, args.plot)
    from diloco_p2p.swarm.collective import wire

    chunk = args.chunk or wire.DEFAULT_CHUNK_ELEMENTS
    if args.worker:
        return worker(args.worker, json.loads(args.initial), chunk, args.pace_bytes)
    if args.tcp_worker:
        return tcp_worker(args.tcp_worker)
    if not netns.available():
        raise SystemExit("benchmarks/wire/allreduce_wan.py needs root and iproute2 (ip, tc) to make network namespaces")
    os.environ[THREADS_ENV] = str(args.threads)  # the members inherit it
    ks = [int(k) for k in args.ks.split(",")]
    comps = args.compressions.split(",")
    cc = args.cc or netns.congestion()
    print(f"{args.numel:,} values per peer; medians over {args.rounds} all-reduces; chunk {chunk} values; TCP {cc}; "
          f"{args.threads} torch thread(s) per member")
    print("ratio: all-reduce / wire time; tcp: plain TCP moving the same bytes between the same hosts, all at once")
    print(f"{'Mbit/s':>6} {'k':>2} {'wire':>10} {'sent MB':>8} {'bound MB':>8} {'all-reduce s':>12} "
          f"{'wire-time s':>11} {'ratio':>6} {'tcp s':>6} {'tcp ratio':>9} {'vs tcp':>6}")
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        with netns.Hosts(max(ks), rate_mbit=rate, congestion=args.cc) as hosts:
            for k in ks:
                pace = args.pace * rate * 1e6 / 8 if args.pace else None
                got = measure(hosts, k, comps, args.numel, args.rounds, chunk, args.grid, pace)
                sizes = {scheme: r["sent"] / (k - 1) for scheme, r in got.items() if "/" not in scheme}
                tcp = {} if args.no_ceiling else tcp_ceiling(hosts, k, sizes, args.rounds)
                for scheme, r in got.items():
                    bound = 2 * (k - 1) / k * args.numel * wire.bytes_per_element(scheme.split("/")[0])
                    wire_s = r["sent"] * 8 / (rate * 1e6)
                    rows.append({"rate_mbit": rate, "k": k, "scheme": scheme, "grid": args.grid, "numel": args.numel,
                                 "congestion": cc, "threads": args.threads, "bound": bound, "wire_seconds": wire_s,
                                 "tcp_seconds": tcp.get(scheme), **r})
                    ceiling = (f"{tcp[scheme]:>6.3f} {tcp[scheme] / wire_s:>9.2f} {r['seconds'] / tcp[scheme]:>6.2f}"
                               if scheme in tcp else f"{'-':>6} {'-':>9} {'-':>6}")
                    print(f"{rate:>6g} {k:>2} {scheme:>10} {r['sent'] / 1e6:>8.3f} {bound / 1e6:>8.3f} "
                          f"{r['seconds']:>12.3f} {wire_s:>11.3f} {r['seconds'] / wire_s:>6.2f} {ceiling}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
