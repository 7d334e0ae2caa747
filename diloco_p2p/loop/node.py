"""A DiLoCo node: H inner steps, then an outer step with whatever the swarm averaged.

`Node.run` is the loop a reader opens first. Everything around it (model, data, checkpoint) is
built by `Node.__init__` from the config; the network layer is behind `Sync`
(`diloco_p2p.contract`), so a solo node and a swarm node run the same loop. So do nodes of one
and of N local ranks: `Ranks` makes every node-wide collective a no-op on one rank, and the
model, the outer state and the checkpoint go through `ShardLayout` (`diloco_p2p.local.fsdp`), an
identity on one rank; rank 0 owns the run directory, rank r > 0 writes its metrics under
``ranks/<r>/``. How a round ends under each ``sync.overlap`` mode is one object behind one call
(`diloco_p2p.loop.rounds`); the checkpoint and the round's reports have modules of their own.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from diloco_p2p.config import Config, save_config, schedule
from diloco_p2p.contract import (
    NodeState,
    RoundOutcome,
    RoundRecord,
    SoloSync,
    StopRequested,
    SwarmState,
    Sync,
)
from diloco_p2p.data import open_dataset
from diloco_p2p.faults import Faults
from diloco_p2p.local.fsdp import ShardLayout, shard_model, uses_bf16_params
from diloco_p2p.local.ranks import Ranks, resolve_device
from diloco_p2p.local.threads import ThreadBudget
from diloco_p2p.logs import set_log_context
from diloco_p2p.loop.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from diloco_p2p.loop.error_feedback import ErrorFeedback
from diloco_p2p.loop.fragments import Fragments
from diloco_p2p.loop.inner import InnerTrainer, StepStats
from diloco_p2p.loop.metrics import process_start_time
from diloco_p2p.loop.moments import MomentAveraging
from diloco_p2p.loop.node_checkpoint import checkpoint_of, resume
from diloco_p2p.loop.outer import OuterOptimizer
from diloco_p2p.loop.round_log import RoundLog
from diloco_p2p.loop.rounds import LoopParts, rounds_for
from diloco_p2p.loop.rundir import node_key, prepare_run_dir
from diloco_p2p.model.build import build_model, build_tokenizer, count_parameters

log = logging.getLogger("diloco_p2p.loop.node")


class Node:
    def __init__(self, config: Config, run_dir: Path, sync: Sync | None = None, *, ranks: Ranks | None = None,
                 stop: StopRequested | None = None, metrics: Any = None, progress: bool | None = None,
                 faults: Faults | None = None):
        self.config, self.node_dir = config, run_dir
        self.ranks = ranks or Ranks(resolve_device(config.train.device))
        leader = self.ranks.leader
        self.run_dir = prepare_run_dir(run_dir if leader else run_dir / "ranks" / str(self.ranks.rank))
        self.stop = stop or StopRequested()
        self.threads = ThreadBudget(config.train.num_threads)  # CPU threads, shared with the nodes on this box
        self.device = self.ranks.device
        # One data order per node, keyed by rank 0's identity (or run directory, alone).
        self.sync = sync or SoloSync(self.ranks.broadcast_str(node_key(run_dir) if leader else ""))
        set_log_context(peer=self.sync.peer_id)
        self._build(faults)
        self.round_log = RoundLog(config, self.run_dir, self.last_round, metrics if leader else None,
                                  leader and (sys.stderr.isatty() if progress is None else progress))
        self.round = self.step = self.tokens = 0
        self.swarm_view = config.swarm_view()
        self.joined_at_round: int | None = None
        self._first_commit = False  # whether this process has committed a round with the swarm yet
        # After a resync: (the round the swarm is computing, how far behind it we were, perf_counter then);
        # that round runs only the steps the others have left (`schedule.catch_up_steps`).
        self._catch_up: tuple[int, float, float] | None = None
        self.resyncs = 0
        self._node_hash: tuple[int, str] | None = None
        self._outer_seconds = 0.0  # this round's outer work so far (`_outer_timer`)
        self._resume()
        if leader:
            save_config(config, run_dir / "config.yaml")

    def _build(self, faults: Faults | None) -> None:
        cfg, ranks = self.config, self.ranks
        tokenizer = build_tokenizer(cfg.model)
        model = build_model(cfg.model, tokenizer.vocab_size, cfg.seed)  # whole on the host: same θ at any N
        precision = cfg.train.precision
        if ranks.sharded:
            self.model = shard_model(model, ranks, precision)
            # With bf16 params from the FSDP policy, autocast on top would only add casts.
            precision = "fp32" if uses_bf16_params(ranks.device, precision) else precision
        else:
            self.model = model.to(self.device)
        if cfg.train.compile:
            self.model.compile()  # in place: the parameters stay the module's own
        self.params = list(self.model.parameters())
        self.layout = ShardLayout(self.params, ranks)
        self.data = open_dataset(cfg.data, cfg.model, tokenizer, cfg.inner.seq_len, self.sync.peer_id,
                                 self.node_dir / "data", leader=ranks.leader, barrier=ranks.barrier,
                                 remote=getattr(self.sync, "datashare", None))  # shards from the swarm
        self.eval_set = self.data.eval_batches(cfg.train.eval_batches)
        total_steps = cfg.inner.total_steps or schedule.total_steps(cfg.outer, cfg.train.max_rounds)
        self.last_round = schedule.rounds(cfg.outer, cfg.train.max_rounds)  # more than max_rounds under a ramp
        self.trainer = InnerTrainer(self.model, cfg.inner, total_steps, self.device, precision, ranks, faults)
        self.outer = OuterOptimizer(self.layout.local_views(), cfg.outer)
        self.feedback = ErrorFeedback(self.outer.numel, cfg.sync)  # what the lossy wire has not sent yet
        self.fragments = Fragments(cfg.sync.fragments, self.layout, self.outer.numel)  # what each round averages
        # how a round ends under sync.overlap: its average now, or behind the next round's steps
        self.rounds = rounds_for(LoopParts(cfg, self.outer, self.layout, self.fragments, self.feedback, self.sync,
                                           ranks, self.last_round, self._stopping, self._shard_sha256,
                                           self._outer_timer, self._serve,
                                           MomentAveraging(self.trainer, self.sync) if cfg.sync.average_moments
                                           else None))
        sharding = (f" sharded over {ranks.world_size} local ranks ({self.outer.numel:,} outer-state values on "
                    "this rank)" if ranks.sharded else "")
        log.info("model: %s parameters%s on %s; data: %s; run dir %s",
                 f"{count_parameters(self.model):,}", sharding, self.device, self.data.describe(), self.node_dir)

    # -- the DiLoCo loop ---------------------------------------------------------------------

    def run(self) -> list[RoundRecord]:
        records = []
        self.sync.announce(self.state())
        if self.round == 0 and self.step == 0:
            records.append(self._initial_record())
        self.rounds.begin_resumed()  # a checkpoint's round in flight: averaged again, with the swarm
        while self.round < self.last_round and not self._stopping():
            set_log_context(round=self.round + 1, step=self.step)
            self.threads.apply()  # nodes on this machine may have started or stopped
            resync = self.sync.before_round(self.state())  # the swarm's θ, if we fell behind
            if resync is not None:
                records.append(self._adopt(resync))
                continue
            start, compute_start = time.perf_counter(), time.time()
            # θ into the model (+ an eager node's correction, or our unsent residual's share),
            # unless the trained weights carry on (overlap=inner, sync.fragments)
            offset = self.rounds.start_round()
            steps = self._inner_round(start)  # H inner steps on our own data
            if self._stopping():
                self.rounds.abandon()
                break  # abandon the partial round: nothing of it reaches θ or the swarm

            landed = self.rounds.landed  # overlap=inner: the last round's average, τ steps in
            waited = landed.waited if landed else 0.0
            compute = time.perf_counter() - start - waited
            with self._outer_timer():
                # Δ = θ (+ c) − θ_local; under sync.fragments of this round's part only
                delta = self.outer.pseudo_gradient(self.layout.local_views(), offset, self.fragments.part(self.round + 1))
                self.rounds.end_steps(self.round + 1)
            phases = {"compute_start": compute_start, "compute_end": time.time()}
            synced, outer_before, tokens = time.perf_counter(), self._outer_seconds, sum(s.tokens for s in steps)
            # the outer step: this round's average, or under sync.overlap the last round's
            outcome, applied = self.rounds.finish_round(self.round + 1, delta, float(tokens), phases)
            # communication not hidden behind compute (the outer step inside it is outer work)
            exposed = time.perf_counter() - synced + waited - (self._outer_seconds - outer_before)
            phases["resumed"] = time.time()  # the loop goes on: the end of the exposed part
            if outcome is None:
                break  # stopped: the group carries on without us; our partial round is dropped
            self.round += 1
            self.tokens += tokens
            self.params_sha256()  # hashed here, so its time counts in the outer step's
            outer_seconds, self._outer_seconds = self._outer_seconds, 0.0
            records.append(self._commit(self._record(
                outcome, start, [s.loss for s in steps], tokens, compute_seconds=compute, exposed_seconds=exposed,
                outer_seconds=outer_seconds, applied_round=applied,
                **self.rounds.record_fields(self.round, phases, landed))))

        if self._stopping():
            self._save()  # under sync.fragments with the trained weights, before θ replaces them
        self.outer.copy_into(self.layout.local_views())
        self.rounds.close()
        return records

    def _inner_round(self, start: float) -> list[StepStats]:
        """The round's inner steps: H, fewer after a resync (catching up) or at a stop."""
        steps: list[StepStats] = []
        h, behind, compute_s = self._inner_steps(), self._behind(), 0.0
        for _ in range(h):
            if self._round_ends(len(steps), schedule.catch_up_steps(h, behind, compute_s / max(len(steps), 1))):
                break
            steps.append(self.trainer.step(self._next_batch))
            compute_s = time.perf_counter() - start
            self.step += 1
            if len(steps) > 1:  # the step before: its loss is read while the GPU runs this one
                self.round_log.step(steps[-2], len(steps) - 1, self.round + 1)
            self.rounds.after_step(len(steps))  # a record whose average came in; overlap=inner's landing
        if steps:
            self.round_log.step(steps[-1], len(steps), self.round + 1)
        return steps

    @contextmanager
    def _outer_timer(self) -> Iterator[None]:
        """Counts toward the round's `outer_seconds`: θ to the model, Δ back, the step, the hash."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self._outer_seconds += time.perf_counter() - began

    def _inner_steps(self) -> int:
        """H of this round (`diloco_p2p.config.schedule`), or fewer on a node slower than its last group
        under outer.dynamic_local_updates."""
        if not self.config.outer.dynamic_local_updates:
            return schedule.inner_steps(self.config.outer, self.config.train.max_rounds, self.round + 1)
        speeds = self.sync.speeds  # the swarm's measure of our last group; None alone
        if not speeds:
            return self.config.outer.inner_steps
        return schedule.dylu_steps(speeds, self.sync.peer_id, self.config.outer.inner_steps)

    def _behind(self) -> float | None:
        """Seconds between the swarm's start of this round and ours, right after a resync (None:
        not catching up). Only where every round starts from θ: under overlap or fragments a
        round carries the last one's work, and it runs its full H."""
        catch_up, self._catch_up = self._catch_up, None
        if catch_up is None or catch_up[0] != self.round + 1 or self.rounds.full_rounds():
            return None
        return catch_up[1] + time.perf_counter() - catch_up[2]

    def _round_ends(self, done: int, catch_up: int) -> bool:
        """Whether the inner steps stop here: a stop request, or a round in flight caught up with
        (`catch_up` steps, after at least one). Node-wide, like a stop: each rank times its own
        steps, and a rank that stopped a step before the others would leave their next FSDP
        collective waiting for it."""
        return self.ranks.any(self.stop.requested or (done > 0 and done >= catch_up))

    def _stopping(self) -> bool:
        """A stop request on any local rank, seen by every rank at the same point of the loop."""
        return self.ranks.any(self.stop.requested)

    def _next_batch(self):
        """Rank r's rows r, r+N, ... of the node's next N·b windows: one data order per node,
        so an N-rank node sees exactly the windows of a 1-rank node with batch N·b."""
        n = self.ranks.world_size
        return self.data.next_batch(self.config.inner.batch_size * n)[self.ranks.rank :: n]

    # -- what the swarm sees ---------------------------------------------------------------------

    def params_sha256(self) -> str:
        """The node's hash of θ: computed once per distinct θ (one small collective on N ranks)."""
        version = self.outer.version
        if self._node_hash is None or self._node_hash[0] != version:
            with self._outer_timer():
                self._node_hash = (version, self.ranks.node_sha256(self.outer.params_sha256()))
        return self._node_hash[1]

    def _shard_sha256(self) -> str:
        """This rank's hash of θ, which the swarm checks its group on: hashing a new θ is outer work
        (`outer_seconds`), not communication the round exposes."""
        with self._outer_timer():
            return self.outer.params_sha256()

    def state(self) -> NodeState:
        state = {**self.outer.state_tensors(), **self.rounds.served_tensors()}
        return NodeState(round=self.round, step=self.step, tokens=self.tokens, params_sha256=self.params_sha256(),
                         shard_sha256=self.outer.params_sha256(), joined_at_round=self.joined_at_round,
                         resyncs=self.resyncs, state=state, in_flight_round=self.rounds.in_flight_round())

    def _adopt(self, resync: SwarmState) -> RoundRecord:
        """Take the swarm's θ and momentum (downloaded and verified) and its round."""
        start, dropped = time.perf_counter(), self.round
        self.outer.load_state_tensors(resync.tensors)
        self.rounds.adopt(resync)  # our round in flight goes; the state's average in flight comes
        self.outer.copy_into(self.layout.local_views())
        self.feedback.reset()  # our residual belongs to the trajectory we just left (`diloco_p2p.loop.error_feedback`)
        if self.step == 0 and self.joined_at_round is None:
            self.joined_at_round = resync.round
        else:
            self.resyncs += 1
        self.round = resync.round
        if resync.behind_seconds is not None:
            self._catch_up = (resync.round + 1, resync.behind_seconds, time.perf_counter())
        return self._commit(self._record(resync.outcome, start, [], 0, dropped_round=dropped, resyncs=self.resyncs,
                                         joined_at_round=self.joined_at_round))

    # -- bookkeeping ---------------------------------------------------------------------------

    def _record(self, outcome: RoundOutcome, start: float, losses: list[float], tokens: int,
                **node: Any) -> RoundRecord:
        cfg = self.config
        eval_loss = None
        if self.eval_set and (self.round % cfg.train.eval_every == 0 or self.round >= self.last_round):
            carried = [p.detach().clone() for p in self.layout.local_views()] if self.rounds.carry else None
            self.outer.copy_into(self.layout.local_views())
            eval_loss = self.trainer.evaluate(self.eval_set)
            if carried is not None:  # overlap=inner: training goes on from the weights, not θ
                with torch.no_grad():
                    for p, c in zip(self.layout.local_views(), carried, strict=True):
                        p.copy_(c)
        seconds = time.perf_counter() - start
        return RoundRecord.of(
            outcome, round=self.round, step=self.step, tokens=self.tokens, params_sha256=self.params_sha256(),
            train_loss=sum(losses) / len(losses) if losses else None, eval_loss=eval_loss,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0, seconds=seconds,
            compression=cfg.sync.compression, lr=self.trainer.lr,
            utilization=node["compute_seconds"] / seconds if "compute_seconds" in node and seconds > 0 else None,
            **node,
        )

    def _commit(self, record: RoundRecord) -> RoundRecord:
        """Checkpoint (when due), then write the record: a record never claims a round that no
        checkpoint holds. Then tell the metrics and the swarm."""
        cfg = self.config
        if self.round % cfg.train.checkpoint_every == 0 or self.round >= self.last_round:
            self._save()
        if record.status == "committed" and not self._first_commit:  # a (re)start is back in the swarm
            self._first_commit = True
            record.first_commit_seconds = time.time() - process_start_time()
        self.round_log.write(record)
        self.round_log.observe(record, self.sync)
        self.rounds.publish(record)  # under sync.overlap once the round's average is known (`_serve`)
        self.round_log.show(record)
        return record

    def _serve(self, record: RoundRecord) -> None:
        """Publish the round and serve the state. Under sync.overlap only once the round's average
        is known, so the state carries it: a joiner that adopts it applies it as the members do."""
        self.sync.after_round(self.state(), record)

    def _initial_record(self) -> RoundRecord:
        """Round 0: the untrained global parameters, so eval loss start -> end is in metrics.jsonl."""
        self.outer.copy_into(self.layout.local_views())
        record = RoundRecord(round=0, step=0, tokens=0, params_sha256=self.params_sha256(), status="init",
                             eval_loss=self.trainer.evaluate(self.eval_set) if self.eval_set else None)
        self.round_log.initial(record)
        return record

    # -- checkpoints -----------------------------------------------------------------------------

    def state_checkpoint(self) -> Checkpoint | None:
        """The node's checkpoint in the 1-rank layout (collective on N ranks; None off rank 0)."""
        return checkpoint_of(self)

    def _save(self) -> None:
        ckpt = self.state_checkpoint()
        if ckpt is not None:
            save_checkpoint(self.node_dir / "checkpoints", ckpt)

    def _resume(self) -> None:
        ckpt = load_checkpoint(self.node_dir / "checkpoints", self.swarm_view, self.config.train.resume_round)
        if ckpt is not None:
            resume(self, ckpt)
