"""`diloco-p2p train`: run one node (of 1..N local ranks), solo or in the swarm.

The config is parsed and logging set up once per process. With ``--nproc-per-node N`` this
process becomes the launcher (`diloco_p2p.local.launch`): it spawns N copies of the same command,
each of which runs `train` as one rank; under torchrun the ranks start here directly. Either
way every rank runs the same path: the swarm endpoint first (hivemind forks a process, which
must happen before any thread of ours), then the local ranks' process group, then the node.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
from pathlib import Path
from typing import Any

from diloco_p2p.config import Config, load_config
from diloco_p2p.config.schedule import rounds
from diloco_p2p.errors import UserError
from diloco_p2p.local.ranks import NPROC_FLAG, env_rank, launched_as_rank, local_world_size
from diloco_p2p.logs import log_context, setup_logging

log = logging.getLogger("diloco_p2p")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train as a node: H inner steps, then an outer step with the swarm")
    p.add_argument("--config", help="YAML or TOML config file (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override one config field; repeatable; beats the file")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="overrides log.level")
    p.add_argument("--log-json", action="store_true", help="one JSON object per log line")
    p.add_argument("--run-dir", type=Path, help="config, metrics.jsonl, checkpoints (default runs/<run_id>)")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="DHT peers to join (sets p2p.initial_peers)")
    p.add_argument("--initial-peers-file", type=Path, metavar="PATH",
                   help="read DHT peers from a file, one multiaddr per line (a seed's --maddrs-file); "
                        "waits up to p2p.connect_timeout for it to appear")
    p.add_argument(NPROC_FLAG, dest="nproc_per_node", type=int, default=1, metavar="N",
                   help="local ranks (GPUs) of this node; the model is sharded across them with FSDP")
    p.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (sets metrics.port; 0 = off, -1 = any free port)")
    p.add_argument("--metrics-host", help="Prometheus endpoint address (sets metrics.host)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # a bad config fails here, once, before any rank starts
    setup_logging(config.log.level, config.log.json_format)
    if args.nproc_per_node < 1:
        raise UserError(f"{NPROC_FLAG} must be at least 1, got {args.nproc_per_node}")
    if not launched_as_rank():
        if args.nproc_per_node > 1:
            from diloco_p2p.local.launch import launch_local_ranks

            return launch_local_ranks(args.argv, args.nproc_per_node)
    elif args.nproc_per_node > 1 and args.nproc_per_node != local_world_size():
        raise UserError(f"{NPROC_FLAG} {args.nproc_per_node} but the launcher started {local_world_size()} ranks; "
                        f"drop {NPROC_FLAG} under torchrun")
    from diloco_p2p.loop.rundir import prepare_run_dir

    return train(config, prepare_run_dir(args.run_dir or Path("runs") / config.run_id))


def train(config: Config, run_dir: Path) -> int:
    """Train as this process's rank of its node (rank 0 of 1 outside a launch)."""
    from diloco_p2p.local.ranks import peer_rank_failed

    world = local_world_size()
    try:
        records = _train(config, run_dir, env_rank(), world)
    except Exception as e:
        if world <= 1 or not peer_rank_failed(e):
            raise
        # The launcher (or torchrun) names the rank that failed; this rank only follows it.
        print(f"error: local rank {env_rank()}: another rank of this node failed, exiting "
              f"({' '.join(str(e).split())[:160]})", file=sys.stderr, flush=True)
        return 1
    if records and env_rank() == 0:
        last = records[-1]
        loss = "-" if last.eval_loss is None else f"{last.eval_loss:.4f}"
        with log_context(round=last.round, step=last.step):  # where the node ended, not where its last round began
            log.info("done: round %d, eval loss %s, params %s", last.round, loss, last.params_sha256[:12])
    return 0


def _train(config: Config, run_dir: Path, rank: int, world: int) -> list[Any]:
    from diloco_p2p.contract import StopRequested
    from diloco_p2p.faults import make_faults
    from diloco_p2p.local.ranks import Ranks, quiet_other_ranks
    from diloco_p2p.loop.node import Node

    quiet_other_ranks(rank)
    stop, faults = StopRequested(), make_faults()
    stop.install()
    sync = _swarm(config, run_dir, stop, faults, rank, world)  # before any thread of ours: hivemind forks
    try:
        ranks = Ranks.from_env(config.train.device)
        if world > 1 and sync is not None:
            sync.attach(ranks)  # the shard endpoints learn the node's identity (rank 0's)
        metrics = start_metrics(config, run_dir) if ranks.leader else None
        records = Node(config, run_dir, sync, ranks=ranks, stop=stop, metrics=metrics, faults=faults).run()
        ranks.barrier()  # rank 0 may still be writing the last checkpoint
    finally:
        if sync is not None:
            sync.close()
    if ranks.sharded:
        # The node (FSDP's modules and hooks hold it in cycles) goes while its process group is
        # alive. Left to the interpreter's exit, a rank aborted once after its last round ("terminate
        # called without an active exception"; once in this round's CI runs, never in 30 runs since).
        gc.collect()
    ranks.close()
    return records


def _swarm(config: Config, run_dir: Path, stop: Any, faults: Any, rank: int, world: int) -> Any:
    """The node's swarm endpoint: None solo, one `SwarmSync`, or this rank's `ShardSync`."""
    if not config.p2p.initial_peers:
        return None
    if world > 1:
        from diloco_p2p.swarm.multirank import ShardSync

        return ShardSync(config, run_dir, stop, rank, world, faults)
    from diloco_p2p.swarm.sync import SwarmSync

    return SwarmSync(config.sync, config.p2p, run_id=config.run_id, swarm_view=config.swarm_view(), run_dir=run_dir,
                     stop=stop, faults=faults, max_round=rounds(config.outer, config.train.max_rounds))


def start_metrics(config: Config, run_dir: Path) -> Any:
    """The node's Prometheus endpoint when metrics.port is set; its bound port goes to the run dir."""
    if not config.metrics.port:
        return None
    from diloco_p2p.loop.metrics import NodeMetrics, serve_metrics, write_port_file

    metrics = NodeMetrics()
    port = serve_metrics(metrics.registry, config.metrics.host, max(config.metrics.port, 0))  # -1: any port
    write_port_file(run_dir, port)
    log.info("metrics on http://%s:%d/metrics", config.metrics.host, port)
    return metrics


def config_from_args(args: argparse.Namespace) -> Config:
    """defaults < --config file < --set, with the command's own flags as --set entries."""
    overrides = list(args.overrides)
    peers = list(args.initial_peers or [])
    if args.initial_peers_file:
        timeout = load_config(args.config, overrides).p2p.connect_timeout
        peers += read_peers_file(args.initial_peers_file, timeout)
    if peers:
        overrides.append("p2p.initial_peers=[" + ",".join(f"'{a}'" for a in peers) + "]")
    for flag, field in (("metrics_port", "metrics.port"), ("metrics_host", "metrics.host"), ("log_level", "log.level")):
        if getattr(args, flag) is not None:
            overrides.append(f"{field}={getattr(args, flag)}")
    if args.log_json:
        overrides.append("log.json_format=true")
    return load_config(args.config, overrides)


def read_peers_file(path: Path, timeout: float) -> list[str]:
    """Multiaddrs from `path`, one per line (blank lines and # comments skipped), waiting up to
    `timeout` seconds for a seed started alongside this node to write it."""
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
