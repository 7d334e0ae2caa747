"""A DiLoCo node: H inner steps, then an outer step with whatever the swarm averaged.

`Node.run` is the loop a reader opens first. Everything around it (model, data, checkpoint,
swarm) is built by `Node.__init__` from the config; the network layer is behind `Sync`, so
a solo node and a swarm node run the same loop.
"""

from __future__ import annotations

import json
import logging
import secrets
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from diloco_p2p import __version__
from diloco_p2p.checkpoint import Checkpoint, join_tensors, load_checkpoint, save_checkpoint, split_tensors
from diloco_p2p.config import Config, save_config
from diloco_p2p.data import DataPosition, build_dataset
from diloco_p2p.faults import wait_at_start_gate
from diloco_p2p.inner import InnerTrainer, resolve_device
from diloco_p2p.logs import set_log_context
from diloco_p2p.model import build_model, build_tokenizer, count_parameters
from diloco_p2p.outer import OuterOptimizer

log = logging.getLogger("diloco_p2p.node")


@dataclass
class SyncOutcome:
    """What the network layer hands the outer step after one round of averaging."""

    average: torch.Tensor | None  # None = apply nothing this round
    status: str  # committed | alone | failed | resynced | skipped
    group_size: int = 1
    allreduce_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Sync(Protocol):
    peer_id: str

    def average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> SyncOutcome: ...

    def announce(self, node: Node) -> None: ...

    def after_round(self, node: Node, record: dict[str, Any]) -> None: ...

    def before_round(self, node: Node) -> dict[str, Any] | None: ...

    def dht_peers(self) -> int: ...

    def close(self) -> None: ...


class SoloSync:
    """No swarm: the node's own pseudo-gradient is the average (M=1 DiLoCo)."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id

    def average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> SyncOutcome:
        return SyncOutcome(average=delta, status="alone", group_size=1)

    def announce(self, node: Node) -> None:
        pass

    def after_round(self, node: Node, record: dict[str, Any]) -> None:
        pass

    def before_round(self, node: Node) -> dict[str, Any] | None:
        return None

    def dht_peers(self) -> int:
        return 0

    def close(self) -> None:
        pass


class StopRequested:
    """SIGTERM/SIGINT: stop at the next safe point; a second signal exits at once."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            log.warning("second signal: exiting now")
            raise SystemExit(128 + signum)
        self.requested = True
        log.info("signal %s: stopping at the next safe point", signal.Signals(signum).name)


def node_key(run_dir: Path) -> str:
    """A random key created once per run directory; fixes a solo node's data order across resumes."""
    path = run_dir / "node_key"
    if not path.exists():
        path.write_text(secrets.token_hex(16))
    return path.read_text().strip()


class Node:
    def __init__(self, config: Config, run_dir: Path, sync: Sync | None = None, *, stop: StopRequested | None = None,
                 metrics: Any = None, progress: bool | None = None):
        self.config, self.run_dir = config, run_dir
        self.stop = stop or StopRequested()
        self.metrics = metrics
        self.progress = sys.stderr.isatty() if progress is None else progress
        run_dir.mkdir(parents=True, exist_ok=True)
        if config.train.num_threads:
            torch.set_num_threads(config.train.num_threads)
        self.device = resolve_device(config.train.device)
        self.sync = sync or SoloSync(node_key(run_dir))
        set_log_context(peer=self.sync.peer_id)

        tokenizer = build_tokenizer(config.model)
        self.model = build_model(config.model, tokenizer.vocab_size, config.seed).to(self.device)
        self.params = [p for p in self.model.parameters()]
        self.data = build_dataset(config.data, tokenizer, config.inner.seq_len, order_key=self.sync.peer_id)
        self.eval_set = self.data.eval_batches(config.inner.batch_size, config.train.eval_batches)
        total_steps = config.inner.total_steps or config.train.max_rounds * config.outer.inner_steps
        self.trainer = InnerTrainer(self.model, config.inner, total_steps, self.device, config.train.precision)
        self.outer = OuterOptimizer(self.params, config.outer)
        self.round = self.step = self.tokens = 0
        self.swarm_view = config.swarm_view()
        self.joined_at_round: int | None = None
        self.resyncs = 0
        self._resume()
        save_config(config, run_dir / "config.yaml")
        log.info(
            "model: %s parameters on %s; data: %d train / %d eval windows; run dir %s",
            f"{count_parameters(self.model):,}", self.device, len(self.data.train_windows),
            len(self.data.eval_windows), run_dir,
        )

    # -- the DiLoCo loop ---------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        cfg = self.config
        records = []
        self.sync.announce(self)
        wait_at_start_gate()  # tests only: start several nodes' first rounds together
        if self.round == 0 and self.step == 0:
            records.append(self._initial_record())
        while self.round < cfg.train.max_rounds and not self.stop.requested:
            set_log_context(round=self.round + 1, step=self.step)
            resync = self.sync.before_round(self)  # may replace θ with the swarm's if we fell behind
            if resync:
                records.append(self._record(resync, time.perf_counter(), [], 0))
                continue
            start, losses, round_tokens = time.perf_counter(), [], 0
            self.outer.copy_into(self.params)  # every round starts from the global parameters θ

            for _ in range(cfg.outer.inner_steps):  # H inner steps on our own data
                if self.stop.requested:
                    break
                stats = self.trainer.step(lambda: self.data.next_batch(cfg.inner.batch_size))
                losses.append(stats.loss)
                round_tokens += stats.tokens
                self.step += 1
                if self.metrics:
                    self.metrics.observe_inner_step(stats.tokens, stats.loss)
                self._show_progress(len(losses), stats.loss)
            if self.stop.requested:
                break  # abandon the partial round: nothing of it reaches θ or the swarm

            delta = self.outer.pseudo_gradient(self.params)  # Δ = θ − θ_local
            outcome = self.sync.average(self.round + 1, delta, float(round_tokens), self.outer.params_sha256())
            if self.stop.requested:
                break  # the group carries on without us; our partial round is dropped
            if outcome.average is not None:
                self.outer.step(outcome.average)  # outer Nesterov step, identical on every group member
            self.round += 1
            self.tokens += round_tokens
            records.append(self._record(asdict(outcome), start, losses, round_tokens))

        self.outer.copy_into(self.params)
        if self.stop.requested:
            self._save()
        return records

    # -- bookkeeping ---------------------------------------------------------------------------

    def _record(self, outcome: dict[str, Any], start: float, losses: list[float], tokens: int) -> dict[str, Any]:
        cfg = self.config
        eval_loss = None
        last = self.round >= cfg.train.max_rounds
        if self.eval_set and (self.round % cfg.train.eval_every == 0 or last):
            self.outer.copy_into(self.params)
            eval_loss = self.trainer.evaluate(self.eval_set)
        seconds = time.perf_counter() - start
        extra = outcome.pop("extra", None) or {}
        outcome.pop("average", None)
        record = {
            "round": self.round, "step": self.step, "tokens": self.tokens,
            "train_loss": sum(losses) / len(losses) if losses else None, "eval_loss": eval_loss,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0, "seconds": seconds,
            "params_sha256": self.outer.params_sha256(), "compression": cfg.sync.compression,
            "lr": self.trainer.lr, **outcome, **extra,
        }
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.metrics:
            self.metrics.observe_round(record)
            self.metrics.set_dht_peers(self.sync.dht_peers())
        self.sync.after_round(self, record)
        if self.round % cfg.train.checkpoint_every == 0 or last:
            self._save()
        self._log_round(record)
        return record

    def _initial_record(self) -> dict[str, Any]:
        """Round 0: the untrained global parameters, so eval loss start -> end is in metrics.jsonl."""
        self.outer.copy_into(self.params)
        record = {
            "round": 0, "step": 0, "tokens": 0, "train_loss": None,
            "eval_loss": self.trainer.evaluate(self.eval_set) if self.eval_set else None,
            "tokens_per_s": 0.0, "seconds": 0.0, "params_sha256": self.outer.params_sha256(),
            "status": "init", "group_size": 1,
        }
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        log.info("round 0: eval loss %s of the initial parameters %s", record["eval_loss"], record["params_sha256"][:12])
        return record

    def _log_round(self, r: dict[str, Any]) -> None:
        if self.progress:
            sys.stderr.write("\r\033[K")
        ev = f"{r['eval_loss']:.4f}" if r["eval_loss"] is not None else "-"
        tl = f"{r['train_loss']:.4f}" if r["train_loss"] is not None else "-"
        log.info(
            "round %d/%d  step %d  loss %s  eval %s  %.0f tok/s  %s (group %d)  params %s",
            r["round"], self.config.train.max_rounds, r["step"], tl, ev, r["tokens_per_s"], r["status"],
            r["group_size"], r["params_sha256"][:12],
        )

    def _show_progress(self, done: int, loss: float) -> None:
        if self.progress:
            h = self.config.outer.inner_steps
            bar = "#" * (20 * done // h)
            sys.stderr.write(f"\rround {self.round + 1} [{bar:<20}] {done}/{h} loss {loss:.3f}")
            sys.stderr.flush()

    def state_checkpoint(self) -> Checkpoint:
        tensors = dict(self.outer.state_tensors())
        inner = split_tensors(self.trainer.state_dict(), tensors, "inner")
        meta = {
            "inner": inner, "data_position": asdict(self.data.position), "swarm_view": self.swarm_view,
            "config_hash": self.config.swarm_hash(), "params_sha256": self.outer.params_sha256(),
            "version": __version__, "joined_at_round": self.joined_at_round, "resyncs": self.resyncs,
        }
        return Checkpoint(round=self.round, step=self.step, tokens=self.tokens, tensors=tensors, meta=meta)

    def shared_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a joiner needs to enter the next round with us: θ, momentum, round."""
        meta = {"round": self.round, "params_sha256": self.outer.params_sha256(), "config_hash": self.config.swarm_hash()}
        return self.outer.state_tensors(), meta

    def adopt_state(self, tensors: dict[str, torch.Tensor], round_: int) -> None:
        """Take the swarm's θ and momentum (downloaded and verified) and its round."""
        self.outer.load_state_tensors(tensors)
        self.outer.copy_into(self.params)
        if self.step == 0 and self.joined_at_round is None:
            self.joined_at_round = round_
        else:
            self.resyncs += 1
        self.round = round_

    def _save(self) -> None:
        save_checkpoint(self.run_dir / "checkpoints", self.state_checkpoint())

    def _resume(self) -> None:
        ckpt = load_checkpoint(self.run_dir / "checkpoints", self.swarm_view)
        if ckpt is None:
            return
        self.outer.load_state_tensors(ckpt.tensors)
        if "inner" in ckpt.meta:  # absent in a state fetched from the swarm: a fresh AdamW then
            self.trainer.load_state_dict(join_tensors(ckpt.meta["inner"], ckpt.tensors))
        if "data_position" in ckpt.meta:
            self.data.position = DataPosition(**ckpt.meta["data_position"])
        self.round, self.step, self.tokens = ckpt.round, ckpt.step, ckpt.tokens
        self.joined_at_round = ckpt.meta.get("joined_at_round")
        self.resyncs = ckpt.meta.get("resyncs", 0)
        self.outer.copy_into(self.params)
        log.info("resumed from checkpoint at round %d (step %d)", self.round, self.step)
