"""`diloco-p2p status`: the swarm's nodes, read from the DHT."""

from __future__ import annotations

import argparse
import logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show the swarm's nodes, read from the DHT")
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any DHT peer (a seed)")
    p.add_argument("--run-id", required=True, help="the run to show")
    p.add_argument("--json", action="store_true", help="a JSON list instead of a table")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds to join and read the DHT")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from diloco_p2p.ops.status import run_status

    logging.basicConfig(level=logging.WARNING)
    return run_status(args.initial_peers, args.run_id, as_json=args.json, timeout=args.timeout)
