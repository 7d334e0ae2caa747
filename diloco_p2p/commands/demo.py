"""`diloco-p2p demo`: a seed and N nodes on loopback training the tiny model, zero setup."""

from __future__ import annotations

import argparse
from pathlib import Path

from diloco_p2p.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="a seed and 3 nodes on loopback training the tiny model: zero setup")
    p.add_argument("--nodes", type=int, default=3, help="training nodes to start")
    p.add_argument("--rounds", type=int, default=5, help="outer rounds to train")
    p.add_argument("--dir", type=Path, help="where logs and run directories go (default: a temp dir)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="extra config override for every node")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from diloco_p2p.ops.demo import run_demo

    if args.nodes < 1 or args.rounds < 1:
        raise UserError("demo: --nodes and --rounds must be at least 1")
    return run_demo(nodes=args.nodes, rounds=args.rounds, root=args.dir, extra=args.overrides)
