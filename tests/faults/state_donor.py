"""A state donor in its own process, for the fault tests: it joins the test's DHT, serves the
blob read from a file (raw bytes, throttled) and prints ``READY <peer id> <sha256>`` once the
announcement is stored. Then it serves until it is killed (or its stdin closes).

    python -m tests.faults.state_donor --initial-peer MADDR --run-id ID --blob PATH --round N \
        [--throttle BYTES_PER_S] [--chunk-size BYTES] [--corrupt]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import hivemind
import torch

from diloco_p2p.swarm.runner import BackgroundLoop
from diloco_p2p.swarm.state.server import StateServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--initial-peer", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--blob", type=Path, required=True)
    ap.add_argument("--round", type=int, required=True)
    ap.add_argument("--throttle", type=float, default=None)
    ap.add_argument("--chunk-size", type=int, default=1 << 16)
    ap.add_argument("--corrupt", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    blob = args.blob.read_bytes()

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[args.initial_peer])
    loop = BackgroundLoop()
    p2p = loop.run(dht.replicate_p2p(), timeout=30)
    server = StateServer(
        dht, p2p, run_id=args.run_id, chunk_size=args.chunk_size, throttle_bytes_per_s=args.throttle,
        corrupt=args.corrupt,
    )

    async def serve() -> None:
        await server.start()
        await server.set_state(args.round, blob)

    loop.run(serve(), timeout=30)
    print(f"READY {server.peer_id} {server.announcement.sha256}", flush=True)
    sys.stdin.read()  # the test holds our stdin open; EOF means "stop"
    loop.run(server.stop(), timeout=10)
    dht.shutdown()


if __name__ == "__main__":
    main()
