"""`diloco-p2p fetch-data`: download a prepared corpus from the swarm's peers by its dataset id."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from diloco_p2p.errors import UserError
from diloco_p2p.logs import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch-data", help="download a prepared corpus (manifest and every shard) from the swarm")
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any DHT peer (a seed)")
    p.add_argument("--dataset", required=True, metavar="ID", help="the dataset id (the manifest's hash)")
    p.add_argument("--out", type=Path, required=True, help="directory for manifest.json and the shards")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to find a peer for each file and fetch it")
    p.add_argument("--parallel", type=int, default=4, help="shards fetched at once (from several peers)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from diloco_p2p.ops.transfer import fetch_dataset
    from diloco_p2p.swarm.transport.dht import validate_maddrs

    setup_logging("INFO", False)
    if not re.fullmatch(r"[0-9a-f]{64}", args.dataset):
        raise UserError(f"--dataset {args.dataset!r} is not a dataset id (64 hex digits, the `id` of a prepared "
                        "corpus's manifest.json)")
    if not args.timeout > 0 or args.parallel < 1:
        raise UserError("--timeout must be positive and --parallel at least 1")
    peers = validate_maddrs(args.initial_peers, "--initial-peers", require_peer_id=True)
    result = fetch_dataset(peers, args.dataset, args.out, args.timeout, args.parallel)
    print(f"dataset {args.dataset}: {result['shards']} shards, {result['bytes'] / 1e6:.1f} MB fetched in "
          f"{result['seconds']:.1f} s ({result['mb_per_s']:.1f} MB/s) into {args.out}")
    return 0
