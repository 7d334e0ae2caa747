"""A state donor in its own process, for the fault tests: it joins the test's DHT, serves the
blob read from a file (raw bytes, throttled) and prints ``READY <peer id> <sha256>`` once the
announcement is stored. Then it serves until it is killed (or its stdin closes).

    python -m tests.faults.state_donor --initial-peer MADDR --run-id ID --blob PATH --round N \
        [--throttle BYTES_PER_S] [--chunk-size BYTES] [--stripe-size BYTES] [--corrupt]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from diloco_p2p.swarm.state.server import StateServer
from tests.faults.injection import flip_first_byte
from tests.harness.loopback import LoopbackPeers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--initial-peer", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--blob", type=Path, required=True)
    ap.add_argument("--round", type=int, required=True)
    ap.add_argument("--throttle", type=float, default=None)
    ap.add_argument("--chunk-size", type=int, default=1 << 16)
    ap.add_argument("--stripe-size", type=int, default=1 << 20)
    ap.add_argument("--corrupt", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    blob = args.blob.read_bytes()

    peers = LoopbackPeers(1, initial_peers=[args.initial_peer])
    loop = peers.loop
    server = StateServer(
        peers.dhts[0], peers.p2ps[0], run_id=args.run_id, chunk_size=args.chunk_size, throttle_bytes_per_s=args.throttle,
        stripe_size=args.stripe_size,
    )
    if args.corrupt:
        server._outgoing = flip_first_byte  # every chunk served has its first byte flipped

    async def serve() -> None:
        await server.start()
        await server.set_state(args.round, blob)

    loop.run(serve(), timeout=30)
    print(f"READY {server.peer_id} {server.announcement.sha256}", flush=True)
    sys.stdin.read()  # the test holds our stdin open; EOF means "stop"
    loop.run(server.stop(), timeout=10)
    peers.close()


if __name__ == "__main__":
    main()
