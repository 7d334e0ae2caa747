"""A join's state download from 1, 2 and 4 donors at once (striped, `diloco_p2p.swarm.state.stripes`).

No training: each donor is a process with its own DHT and p2pd serving the same state (θ and
outer momentum of `--params-m` million parameters in fp32: 8 bytes each), and a joiner process
times `fetch_state(max_donors=k)` from its call to the verified blob (DHT lookup included).
Two settings, in one run:

- ``shaped``: every host a network namespace (`tests/netns.py`, needs root), each donor's link
  shaped to `--mbit` each way with a token bucket, the joiner's unshaped: a joiner on a fast
  line fetching from volunteers' uplinks. The wire time of the blob over one donor's link
  (bytes · 8 / rate) is printed beside; goal: 4 donors in <= 0.35x the time of one.
- ``loopback``: all on 127.0.0.1, beside the transport's ceiling measured in the same run: the
  same bytes as raw reads of one p2pd stream (and of k streams from k donors at once), with no
  protocol, hashing or stripes. Goal: >= 80% of the one-stream ceiling. Beside it, ``kept``: the
  one-stream reads copied into a blob allocated within the timing, as a join must hold them.

Each cell is the median of `--repeats` downloads (after one warm-up that opens connections).

    sudo python benchmarks/swarm/join_stripes.py --params-m 12.5 --repeats 3 --json benchmarks/swarm/results/join_stripes.json

(`--settings loopback` runs without root.) The table is also written next to the json (.txt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.netns

from tests import netns  # noqa: E402

RAW = "bench.raw"  # a donor's raw handler: the requested bytes of the blob, nothing else
KS = (1, 2, 4)


def worker(role: str, ip: str, initial: list[str], blob_path: str, stripe_size: int) -> None:
    """A donor (serves the blob as state and raw) or the joiner (runs the jobs read from stdin)."""
    import hivemind
    import torch
    from hivemind.p2p import P2P

    from diloco_p2p.swarm.state.announcements import list_donors
    from diloco_p2p.swarm.state.client import fetch_state
    from diloco_p2p.swarm.state.server import StateServer
    from diloco_p2p.swarm.transport.runner import BackgroundLoop
    from diloco_p2p.swarm.trust.signing import signature_validator

    torch.set_num_threads(1)
    identity = Path(tempfile.mkdtemp(prefix="join-stripes-key-")) / "id.key"
    P2P.generate_identity(str(identity))  # donors sign their announcements (`swarm.trust.signing`)
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=initial,
                       identity_path=str(identity), record_validators=[signature_validator(identity)])
    loop = BackgroundLoop()
    p2p = loop.run(dht.replicate_p2p(), 60)
    hello = {"maddrs": [str(a) for a in dht.get_visible_maddrs()], "peer": p2p.peer_id.to_base58()}
    if role == "donor":
        blob = Path(blob_path).read_bytes()
        server = StateServer(dht, p2p, run_id="bench", stripe_size=stripe_size)
        loop.run(server.start(), 30)
        loop.run(server.set_state(1, blob), 60)
        loop.run(p2p.add_binary_stream_handler(RAW, _raw_handler(blob)), 30)
        print(json.dumps(hello), flush=True)
        sys.stdin.read()  # EOF: stop
        return
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job["do"] == "stop":
            break
        t0 = time.perf_counter()
        if job["do"] == "donors":  # wait until the joiner sees every announcement
            while len(loop.run(list_donors(dht, "bench"), 30)) < job["n"]:
                time.sleep(0.2)
            out = {}
        elif job["do"] == "fetch":
            f = loop.run(fetch_state(dht, p2p, run_id="bench", max_donors=job["k"], timeout=600), 620)
            out = {"bytes": f.bytes, "size": len(f.blob), "by_donor": list(f.by_donor.values()),
                   "failures": f.failures}
        else:  # raw: job["size"] bytes split over the given donors' raw handlers, read at once
            out = {"bytes": loop.run(_raw_read(p2p, job["peers"], job["size"], job.get("keep", False)), 600)}
        print(json.dumps({"seconds": time.perf_counter() - t0, **out}), flush=True)


def _raw_handler(blob: bytes):
    async def handle(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readexactly(16)
        start, end = int.from_bytes(head[:8], "big"), int.from_bytes(head[8:], "big")
        view = memoryview(blob)
        for at in range(start, end, 1 << 20):
            writer.write(view[at:min(end, at + (1 << 20))])
            await writer.drain()
        await reader.read(1)  # the reader closes once it has everything
        writer.close()

    return handle


async def _raw_read(p2p, peers: list[str], size: int, keep: bool = False) -> int:
    """Read `size` bytes split over `peers`' raw handlers; with `keep`, into one blob allocated here
    (what any join that holds the state must do: first-touching fresh memory is not free)."""
    from hivemind.p2p import PeerID

    share = -(-size // len(peers))
    blob = memoryview(bytearray(size)) if keep else None

    async def one(i: int, peer: str) -> int:
        start, end = i * share, min(size, (i + 1) * share)
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), RAW)
        writer.write(start.to_bytes(8, "big") + end.to_bytes(8, "big"))
        await writer.drain()
        got = 0
        while got < end - start and (data := await reader.read(1 << 20)):
            if blob is not None:
                blob[start + got : start + got + len(data)] = data
            got += len(data)
        writer.close()
        return got

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(peers))))


class Proc:
    def __init__(self, prefix: list[str], ip: str, role: str, initial: list[str], blob: Path, stripe: int):
        argv = [*prefix, sys.executable, __file__, "--worker", role, ip, json.dumps(initial), str(blob), str(stripe)]
        self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self.read()

    def read(self) -> dict:
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.popen.args[-5]} on {self.popen.args[-4]} exited with {self.popen.wait()}")
        return json.loads(line)

    def ask(self, job: dict) -> dict:
        self.popen.stdin.write(json.dumps(job) + "\n")
        self.popen.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.popen.stdin.close()
            self.popen.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            self.popen.kill()
            self.popen.wait()


def run_setting(setting: str, blob: Path, size: int, args) -> dict:
    """One swarm (joiner + max(KS) donors) in `setting`; the median seconds of each measurement."""
    hosts = netns.Hosts(max(KS) + 1, rate_mbit=[None] + [args.mbit] * max(KS)) if setting == "shaped" else None
    where = (lambda i: (hosts[i].prefix(), hosts[i].ip)) if hosts else (lambda i: ([], "127.0.0.1"))
    procs: list[Proc] = []
    try:
        joiner = Proc(*where(0), "joiner", [], blob, args.stripe_size)
        procs.append(joiner)
        for i in range(1, max(KS) + 1):
            procs.append(Proc(*where(i), "donor", joiner.hello["maddrs"], blob, args.stripe_size))
        donors = [p.hello["peer"] for p in procs[1:]]
        joiner.ask({"do": "donors", "n": len(donors)})
        jobs = {f"state k={k}": {"do": "fetch", "k": k} for k in KS}
        if setting == "loopback":
            jobs |= {f"raw k={k}": {"do": "raw", "peers": donors[:k], "size": size} for k in KS}
            jobs["kept k=1"] = {"do": "raw", "peers": donors[:1], "size": size, "keep": True}
        out = {}
        for name, job in jobs.items():
            joiner.ask(job)  # warm-up: connections open
            runs = [joiner.ask(job) for _ in range(args.repeats)]
            assert all(r["bytes"] >= size for r in runs), runs
            out[name] = {"seconds": statistics.median(r["seconds"] for r in runs), "runs": runs}
            print(f"  {setting} {name}: {out[name]['seconds']:.3f} s", file=sys.stderr, flush=True)
        return out
    finally:
        for p in procs:
            p.close()
        if hosts:
            hosts.close()


def table(results: dict, size: int, mbit: float) -> str:
    lines = [f"state {size / 1e6:.1f} MB; median seconds of each download; MB/s = state bytes / seconds"]
    if "shaped" in results:
        r, wire = results["shaped"], size * 8 / (mbit * 1e6)
        one = r["state k=1"]["seconds"]
        lines += ["", f"shaped: donors' links {mbit:g} Mbit/s each way, joiner unshaped; "
                  f"one link's wire time {wire:.2f} s",
                  f"{'donors':>6} {'seconds':>8} {'MB/s':>7} {'vs 1 donor':>10} {'vs k links':>10}"]
        for k in KS:
            s = r[f"state k={k}"]["seconds"]
            lines.append(f"{k:>6} {s:>8.2f} {size / 1e6 / s:>7.1f} {s / one:>9.2f}x {s / (wire / k):>9.2f}x")
    if "loopback" in results:
        r = results["loopback"]
        ceiling = r["raw k=1"]["seconds"]
        kept = r.get("kept k=1", {}).get("seconds")
        lines += ["", "loopback: beside raw reads of the same bytes from k p2pd streams (no protocol, no hashing)",
                  f"{'donors':>6} {'seconds':>8} {'MB/s':>7} {'raw k s':>8} {'raw MB/s':>8} "
                  f"{'of raw k=1':>10} {'of raw k':>8}" + (f" {'of kept':>8}" if kept else "")]
        for k in KS:
            s, raw = r[f"state k={k}"]["seconds"], r[f"raw k={k}"]["seconds"]
            lines.append(f"{k:>6} {s:>8.3f} {size / 1e6 / s:>7.1f} {raw:>8.3f} {size / 1e6 / raw:>8.1f} "
                         f"{ceiling / s:>9.0%} {raw / s:>8.0%}" + (f" {kept / s:>8.0%}" if kept else ""))
        if kept:
            lines.append(f"kept: raw reads from one donor into a blob allocated in the timing, {kept:.3f} s "
                         f"({size / 1e6 / kept:.1f} MB/s): the ceiling of a join that holds the state")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=12.5, help="million parameters (state = 8 bytes each)")
    parser.add_argument("--mbit", type=float, default=100.0, help="each donor's link in the shaped setting")
    parser.add_argument("--settings", default="shaped,loopback")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stripe-size", type=int, default=1 << 20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    settings = args.settings.split(",")
    if "shaped" in settings and not netns.available():
        raise SystemExit("the shaped setting needs root and iproute2 (ip, tc); try --settings loopback")
    import torch

    from diloco_p2p.swarm.state.codec import pack_state

    n = int(args.params_m * 1e6)
    g = torch.Generator().manual_seed(0)
    state = pack_state({"outer.theta": torch.randn(n, generator=g), "outer.momentum": torch.randn(n, generator=g)},
                       {"round": 1})
    with tempfile.TemporaryDirectory(prefix="join-stripes-") as tmp:
        blob = Path(tmp) / "state.safetensors"
        blob.write_bytes(state)
        results = {s: run_setting(s, blob, len(state), args) for s in settings}
    text = table(results, len(state), args.mbit)
    print(text)
    if args.json:
        meta = {"command": " ".join(["python", *sys.argv]), "state_bytes": len(state), "mbit": args.mbit,
                "stripe_size": args.stripe_size, "cpus": os.cpu_count(), "load": os.getloadavg()}
        args.json.write_text(json.dumps({**meta, "results": results}, indent=1))
        args.json.with_suffix(".txt").write_text(f"$ {meta['command']}\n{text}\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        role, ip, initial, blob_path, stripe = sys.argv[2:7]
        worker(role, ip, json.loads(initial), blob_path, int(stripe))
    else:
        main()
