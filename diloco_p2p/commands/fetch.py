"""`diloco-p2p fetch`: download the swarm's latest model state into a run directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from diloco_p2p.errors import UserError
from diloco_p2p.logs import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch", help="download the swarm's latest model state into a run directory")
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any DHT peer (a seed)")
    p.add_argument("--run-id", required=True, help="the run to fetch")
    p.add_argument("--out", type=Path, required=True, help="run directory to create (config + checkpoint)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to join, find a donor and download")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from diloco_p2p.ops.transfer import fetch
    from diloco_p2p.swarm.transport.dht import validate_maddrs

    setup_logging("INFO", False)
    if not args.timeout > 0:
        raise UserError(f"--timeout must be a positive number of seconds, not {args.timeout!r}")
    peers = validate_maddrs(args.initial_peers, "--initial-peers", require_peer_id=True)
    ckpt = fetch(peers, args.run_id, args.out, args.timeout)
    print(f"round {ckpt.round}, params {ckpt.meta['params_sha256']}, in {args.out}")
    return 0
