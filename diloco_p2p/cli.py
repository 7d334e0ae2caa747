"""The `diloco-p2p` command line: parse, load config, build, run; user mistakes exit 2 in one line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from diloco_p2p.errors import UserError

log = logging.getLogger("diloco_p2p")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML or TOML config file (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override one config field; repeatable; beats the file")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="overrides log.level")
    p.add_argument("--log-json", action="store_true", help="one JSON object per log line")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco-p2p", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train as a node: H inner steps, then an outer step with the swarm")
    _add_config_args(train)
    train.add_argument("--run-dir", type=Path, help="config, metrics.jsonl, checkpoints (default runs/<run_id>)")
    train.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="DHT peers to join (sets p2p.initial_peers)")
    train.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (sets metrics.port; 0 = off)")
    train.add_argument("--metrics-host", help="Prometheus endpoint address (sets metrics.host)")
    return parser


def _config_from_args(args: argparse.Namespace):
    from diloco_p2p.config import load_config

    overrides = list(args.overrides)
    if getattr(args, "initial_peers", None):
        overrides.append("p2p.initial_peers=[" + ",".join(f"'{a}'" for a in args.initial_peers) + "]")
    for flag, field in (("metrics_port", "metrics.port"), ("metrics_host", "metrics.host"), ("log_level", "log.level")):
        if getattr(args, flag, None) is not None:
            overrides.append(f"{field}={getattr(args, flag)}")
    if getattr(args, "log_json", False):
        overrides.append("log.json_format=true")
    return load_config(args.config, overrides)


def _setup_logging(level: str, json_format: bool) -> None:
    try:
        from diloco_p2p.logs import setup_logging
    except ImportError:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        return
    setup_logging(level, json_format)


def cmd_train(args: argparse.Namespace) -> int:
    from diloco_p2p.node import Node

    config = _config_from_args(args)
    _setup_logging(config.log.level, config.log.json_format)
    run_dir = args.run_dir or Path("runs") / config.run_id
    node = Node(config, run_dir)
    node.stop.install()
    records = node.run()
    if records:
        last = records[-1]
        log.info("done: round %d, eval loss %s, params %s", last["round"], last["eval_loss"], last["params_sha256"][:12])
    return 0


COMMANDS = {"train": cmd_train}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
