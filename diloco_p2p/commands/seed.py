"""`diloco-p2p seed`: a DHT bootstrap node; prints the multiaddrs others join with."""

from __future__ import annotations

import argparse
from pathlib import Path

from diloco_p2p.logs import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("seed", help="run a DHT bootstrap node; prints the multiaddrs others join with")
    p.add_argument("--host-maddrs", nargs="+", help="listen addresses (default all interfaces, TCP 31337)")
    p.add_argument("--announce-maddrs", nargs="*", default=[], help="public addresses others should dial")
    p.add_argument("--initial-peers", nargs="+", default=[], help="other seeds to join")
    p.add_argument("--identity", type=Path, help="private key file; created if missing, reused after")
    p.add_argument("--maddrs-file", type=Path, help="write the multiaddrs here, one per line")
    p.add_argument("--witness", action="append", default=[], metavar="RUN_ID",
                   help="follow this run and publish the peers it trusts, for newcomers (repeatable; "
                        "docs/threat-model.md)")
    p.add_argument("--trust", action="append", default=[], metavar="PEER_ID",
                   help="a peer the witness trusts from the start: the operator's own nodes (repeatable)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus endpoint port (0 = off, -1 = any free port, logged)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="Prometheus endpoint address")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default="INFO")
    p.add_argument("--log-json", action="store_true", help="one JSON object per log line")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from diloco_p2p.ops.seed import DEFAULT_HOST_MADDRS, run_seed

    setup_logging(args.log_level, args.log_json)
    return run_seed(args.host_maddrs or list(DEFAULT_HOST_MADDRS), args.announce_maddrs, args.identity,
                    args.maddrs_file, args.metrics_host, args.metrics_port, initial_peers=args.initial_peers,
                    witness=args.witness, founders=args.trust)
