"""The `diloco-p2p` command line: parse, load config, build, run; user mistakes exit 2 in one line."""

from __future__ import annotations

import argparse
import logging
import sys
import time
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
    train.add_argument("--initial-peers-file", type=Path, metavar="PATH",
                       help="read DHT peers from a file, one multiaddr per line (a seed's --maddrs-file); "
                            "waits up to p2p.connect_timeout for it to appear")
    train.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                       help="local ranks (GPUs) of this node; the model is sharded across them with FSDP")
    train.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (sets metrics.port; 0 = off, -1 = any free port)")
    train.add_argument("--metrics-host", help="Prometheus endpoint address (sets metrics.host)")
    seed = sub.add_parser("seed", help="run a DHT bootstrap node; prints the multiaddrs others join with")
    seed.add_argument("--host-maddrs", nargs="+", help="listen addresses (default all interfaces, TCP 31337)")
    seed.add_argument("--announce-maddrs", nargs="*", default=[], help="public addresses others should dial")
    seed.add_argument("--initial-peers", nargs="+", default=[], help="other seeds to join")
    seed.add_argument("--identity", type=Path, help="private key file; created if missing, reused after")
    seed.add_argument("--maddrs-file", type=Path, help="write the multiaddrs here, one per line")
    seed.add_argument("--metrics-port", type=int, default=0,
                      help="Prometheus endpoint port (0 = off, -1 = any free port, logged)")
    seed.add_argument("--metrics-host", default="127.0.0.1", help="Prometheus endpoint address")
    seed.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default="INFO")
    seed.add_argument("--log-json", action="store_true", help="one JSON object per log line")

    status = sub.add_parser("status", help="show the swarm's nodes, read from the DHT")
    status.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any DHT peer (a seed)")
    status.add_argument("--run-id", required=True, help="the run to show")
    status.add_argument("--json", action="store_true", help="a JSON list instead of a table")
    status.add_argument("--timeout", type=float, default=20.0, help="seconds to join and read the DHT")

    fetch = sub.add_parser("fetch", help="download the swarm's latest model state into a run directory")
    fetch.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any DHT peer (a seed)")
    fetch.add_argument("--run-id", required=True, help="the run to fetch")
    fetch.add_argument("--out", type=Path, required=True, help="run directory to create (config + checkpoint)")
    fetch.add_argument("--timeout", type=float, default=60.0, help="seconds to join, find a donor and download")

    export = sub.add_parser("export", help="write a checkpoint as a transformers model (save_pretrained)")
    export.add_argument("--checkpoint", type=Path, required=True, help="a run directory (or its checkpoints/)")
    export.add_argument("--out", type=Path, required=True, help="directory for the model and tokenizer")

    demo = sub.add_parser("demo", help="a seed and 3 nodes on loopback training the tiny model: zero setup")
    demo.add_argument("--nodes", type=int, default=3, help="training nodes to start")
    demo.add_argument("--rounds", type=int, default=5, help="outer rounds to train")
    demo.add_argument("--dir", type=Path, help="where logs and run directories go (default: a temp dir)")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                      help="extra config override for every node")
    return parser


def _config_from_args(args: argparse.Namespace):
    from diloco_p2p.config import load_config

    overrides = list(args.overrides)
    peers = list(getattr(args, "initial_peers", None) or [])
    if getattr(args, "initial_peers_file", None):
        timeout = load_config(args.config, overrides).p2p.connect_timeout
        peers += read_peers_file(args.initial_peers_file, timeout)
    if peers:
        overrides.append("p2p.initial_peers=[" + ",".join(f"'{a}'" for a in peers) + "]")
    for flag, field in (("metrics_port", "metrics.port"), ("metrics_host", "metrics.host"), ("log_level", "log.level")):
        if getattr(args, flag, None) is not None:
            overrides.append(f"{field}={getattr(args, flag)}")
    if getattr(args, "log_json", False):
        overrides.append("log.json_format=true")
    return load_config(args.config, overrides)


def read_peers_file(path: Path, timeout: float) -> list[str]:
    """Multiaddrs from `path`, one per line (blank lines and # comments skipped).

    A seed started alongside this node writes the file once it listens, so wait for it: up to
    `timeout` seconds for a non-empty file.
    """
    deadline = time.monotonic() + timeout
    while True:
        if path.is_file():
            lines = [line.strip() for line in path.read_text().splitlines()]
            peers = [line for line in lines if line and not line.startswith("#")]
            if peers:
                return peers
        if time.monotonic() > deadline:
            raise UserError(f"--initial-peers-file {path}: no multiaddr in it after {timeout:.0f} s; "
                            "start the seed with --maddrs-file pointing there, or pass --initial-peers")
        time.sleep(0.2)


def _setup_logging(level: str, json_format: bool) -> None:
    from diloco_p2p.logs import setup_logging

    setup_logging(level, json_format)


def cmd_train(args: argparse.Namespace) -> int:
    from diloco_p2p.launch import local_world_size

    if args.nproc_per_node > 1 or local_world_size() > 1:  # FSDP across this node's GPUs
        from diloco_p2p.launch import train

        return train(args, args.argv, args.nproc_per_node)
    from diloco_p2p.node import Node, StopRequested

    config = _config_from_args(args)
    _setup_logging(config.log.level, config.log.json_format)
    run_dir = args.run_dir or Path("runs") / config.run_id
    stop = StopRequested()
    stop.install()
    sync = None
    try:
        if config.p2p.initial_peers:
            from diloco_p2p.swarm.sync import SwarmSync

            sync = SwarmSync(config, run_dir, stop)  # before any thread of ours: hivemind forks
        metrics = _start_metrics(config, run_dir)
        node = Node(config, run_dir, sync, stop=stop, metrics=metrics)
        records = node.run()
    finally:
        if sync is not None:
            sync.close()
    if records:
        last = records[-1]
        log.info("done: round %d, eval loss %s, params %s", last["round"], last["eval_loss"], last["params_sha256"][:12])
    return 0


def _start_metrics(config, run_dir: Path):
    """The node's Prometheus endpoint when metrics.port is set; its bound port goes to the run dir."""
    if not config.metrics.port:
        return None
    from diloco_p2p.metrics import NodeMetrics, serve_metrics, write_port_file

    metrics = NodeMetrics()
    port = serve_metrics(metrics.registry, config.metrics.host, max(config.metrics.port, 0))  # -1: any port
    write_port_file(run_dir, port)
    log.info("metrics on http://%s:%d/metrics", config.metrics.host, port)
    return metrics


def cmd_seed(args: argparse.Namespace) -> int:
    from diloco_p2p.seed import DEFAULT_HOST_MADDRS, run_seed

    _setup_logging(args.log_level, args.log_json)
    return run_seed(args.host_maddrs or list(DEFAULT_HOST_MADDRS), args.announce_maddrs, args.identity,
                    args.maddrs_file, args.metrics_host, args.metrics_port, initial_peers=args.initial_peers)


def cmd_status(args: argparse.Namespace) -> int:
    from diloco_p2p.status import run_status

    logging.basicConfig(level=logging.WARNING)
    return run_status(args.initial_peers, args.run_id, as_json=args.json, timeout=args.timeout)


def cmd_fetch(args: argparse.Namespace) -> int:
    from diloco_p2p.swarm.dht import validate_maddrs
    from diloco_p2p.transfer import fetch

    _setup_logging("INFO", False)
    if not args.timeout > 0:
        raise UserError(f"--timeout must be a positive number of seconds, not {args.timeout!r}")
    peers = validate_maddrs(args.initial_peers, "--initial-peers", require_peer_id=True)
    ckpt = fetch(peers, args.run_id, args.out, args.timeout)
    print(f"round {ckpt.round}, params {ckpt.meta['params_sha256']}, in {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from diloco_p2p.transfer import export

    _setup_logging("INFO", False)
    export(args.checkpoint, args.out)
    print(f"wrote {args.out}: load it with AutoModelForCausalLM.from_pretrained({str(args.out)!r})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from diloco_p2p.demo import run_demo

    if args.nodes < 1 or args.rounds < 1:
        raise UserError("demo: --nodes and --rounds must be at least 1")
    return run_demo(nodes=args.nodes, rounds=args.rounds, root=args.dir, extra=args.overrides)


COMMANDS = {"train": cmd_train, "seed": cmd_seed, "status": cmd_status, "demo": cmd_demo, "fetch": cmd_fetch,
            "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw)
    args.argv = raw[1:]  # the train command's own arguments, for local-rank launches
    try:
        return COMMANDS[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
