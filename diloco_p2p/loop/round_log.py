"""Where a node's rounds and inner steps are reported.

A line of ``metrics.jsonl`` per round, the Prometheus metrics (`diloco_p2p.loop.metrics`, rank 0 only), the progress bar on a terminal and
one log line per round whose prefix names its round and step."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from diloco_p2p.config import Config, schedule
from diloco_p2p.contract import RoundRecord, Sync
from diloco_p2p.logs import log_context
from diloco_p2p.loop.inner import StepStats

log = logging.getLogger("diloco_p2p.loop.node")  # the node's lines, under the name they always had


class RoundLog:
    """One node's reports; `metrics` None and `progress` False off rank 0."""

    def __init__(self, config: Config, run_dir: Path, last_round: int, metrics: Any, progress: bool):
        self.config, self.run_dir, self.last_round = config, run_dir, last_round
        self.metrics, self.progress = metrics, progress

    def write(self, record: RoundRecord) -> None:
        """The round's line of metrics.jsonl."""
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record.as_dict()) + "\n")

    def observe(self, record: RoundRecord, sync: Sync) -> None:
        """The round, and what the swarm looks like from here, to the metrics."""
        if self.metrics:
            self.metrics.observe_round(record.as_dict())
            self.metrics.set_dht_peers(sync.dht_peers())
            self.metrics.set_reachability(sync.reachability)

    def step(self, stats: StepStats, done: int, round: int) -> None:
        """The `done`-th inner step of round `round`."""
        if self.metrics:
            self.metrics.observe_inner_step(stats.tokens, stats.loss)
        if self.progress:
            h = schedule.inner_steps(self.config.outer, self.config.train.max_rounds, round)
            bar = "#" * (20 * done // h)
            sys.stderr.write(f"\rround {round} [{bar:<20}] {done}/{h} loss {stats.loss:.3f}")
            sys.stderr.flush()

    def initial(self, record: RoundRecord) -> None:
        """Round 0: the untrained parameters' line."""
        self.write(record)
        with log_context(round=0, step=0):
            log.info("round 0: eval loss %s of the initial parameters %s", _loss(record.eval_loss),
                     record.params_sha256[:12])

    def show(self, r: RoundRecord) -> None:
        """The round's log line."""
        if self.progress:
            sys.stderr.write("\r\033[K")
        with log_context(round=r.round, step=r.step):  # the prefix names the round and step this line is about
            log.info("round %d/%d  step %d  loss %s  eval %s  %.0f tok/s  %s (group %d)  params %s", r.round,
                     self.last_round, r.step, _loss(r.train_loss), _loss(r.eval_loss), r.tokens_per_s,
                     r.status, r.group_size, r.params_sha256[:12])
            if r.first_commit_seconds is not None:
                log.info("first committed round with the swarm, %.1f s after this process started",
                         r.first_commit_seconds)


def _loss(value: float | None) -> str:
    """A loss as every log line shows it: 4 decimals, or "-" when there is none."""
    return "-" if value is None else f"{value:.4f}"
