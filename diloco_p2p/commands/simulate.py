"""`diloco-p2p simulate`: M DiLoCo replicas in one process with the swarm's arithmetic, no network."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from diloco_p2p.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="train M replicas in one process exactly as a swarm of M would (no network)")
    p.add_argument("--replicas", type=int, help="M, the number of replicas (default: 1, or one per --order-keys)")
    p.add_argument("--order-keys", nargs="+", metavar="KEY",
                   help="each replica's data order key (a swarm node's is its peer id); default replica-0..M-1")
    p.add_argument("--config", help="YAML or TOML config file (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override one config field; repeatable; beats the file")
    p.add_argument("--dir", type=Path, help="where the replicas' run directories go (default: a temp dir)")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default="WARNING")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from diloco_p2p.config import load_config
    from diloco_p2p.logs import setup_logging
    from diloco_p2p.planner.simulate import simulate

    keys = list(args.order_keys or [])
    if args.replicas is not None and args.replicas < 1:
        raise UserError(f"simulate: --replicas must be at least 1, got {args.replicas}")
    if keys and args.replicas is not None and args.replicas != len(keys):
        raise UserError(f"simulate: --replicas {args.replicas} but {len(keys)} --order-keys; give one of them")
    if len(set(keys)) != len(keys):
        raise UserError("simulate: --order-keys must be distinct (each replica has its own data order)")
    keys = keys or [f"replica-{i}" for i in range(args.replicas or 1)]
    # M replicas are the swarm: outer.recipe=auto plans for M nodes unless told otherwise
    planned = [] if any(o.startswith("outer.nodes=") for o in args.overrides) else [f"outer.nodes={len(keys)}"]
    config = load_config(args.config, [*planned, *args.overrides])
    setup_logging(args.log_level)
    with tempfile.TemporaryDirectory(prefix="diloco-simulate-") as tmp:
        root = args.dir or Path(tmp)
        records = simulate(config, root, keys)
    first = records[keys[0]]
    print(f"{len(keys)} replica(s); round, tokens (all replicas), mean train loss, eval loss, params_sha256")
    for i, r in enumerate(first):
        tokens = sum(records[k][i].tokens for k in keys)
        losses = [records[k][i].train_loss for k in keys if records[k][i].train_loss is not None]
        train = f"{sum(losses) / len(losses):.4f}" if losses else "-"
        ev = f"{r.eval_loss:.4f}" if r.eval_loss is not None else "-"
        print(f"{r.round:>5} {tokens:>10} {train:>8} {ev:>8} {r.params_sha256}")
    return 0
