"""A DiLoCo node: H inner steps, then an outer step with whatever the swarm averaged.

`Node.run` is the loop a reader opens first. Everything around it (model, data, checkpoint) is
built by `Node.__init__` from the config; the network layer is behind `Sync`
(`diloco_p2p.contract`), so a solo node and a swarm node run the same loop. So do nodes of one
and of N local ranks: `Ranks` makes every node-wide collective a no-op on one rank, and the
model, the outer state and the checkpoint go through `ShardLayout` (`diloco_p2p.local.fsdp`), an
identity on one rank; rank 0 owns the run directory, rank r > 0 writes its metrics under
``ranks/<r>/``. The module is long because the overlap modes' landing and resuming, and
sync.fragments' parts, touch the loop's own state; what stands alone is in `overlap`,
`fragments` and `outer`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import torch

from diloco_p2p import __version__
from diloco_p2p.config import Config, save_config, schedule
from diloco_p2p.contract import (
    InFlight,
    NodeState,
    RoundOutcome,
    RoundRecord,
    SoloSync,
    StopRequested,
    SwarmState,
    Sync,
)
from diloco_p2p.data import DataPosition, open_dataset
from diloco_p2p.errors import UserError
from diloco_p2p.faults import Faults
from diloco_p2p.local.fsdp import (
    ShardLayout,
    gather_optimizer_state,
    shard_model,
    shard_optimizer_state,
    uses_bf16_params,
)
from diloco_p2p.local.ranks import Ranks, resolve_device
from diloco_p2p.local.threads import ThreadBudget
from diloco_p2p.logs import log_context, set_log_context
from diloco_p2p.loop.checkpoint import (
    Checkpoint,
    join_tensors,
    load_checkpoint,
    save_checkpoint,
    split_tensors,
)
from diloco_p2p.loop.error_feedback import ErrorFeedback
from diloco_p2p.loop.fragments import Fragments
from diloco_p2p.loop.inner import InnerTrainer, StepStats
from diloco_p2p.loop.metrics import process_start_time
from diloco_p2p.loop.outer import OuterOptimizer
from diloco_p2p.loop.overlap import Pipeline
from diloco_p2p.loop.rundir import node_key, prepare_run_dir
from diloco_p2p.model.build import build_model, build_tokenizer, count_parameters

log = logging.getLogger("diloco_p2p.loop.node")


class Landing(NamedTuple):
    """sync.overlap=inner: round t's average, applied `step` inner steps into round t+1 after
    `waited` seconds; θ and momentum from before it (`OuterOptimizer.snapshot` of its part under
    sync.fragments, restored if a stop drops the round), and under sync.fragments the trained
    weights of its part from before the merge ("local")."""

    flight: InFlight
    saved: dict[str, torch.Tensor]
    waited: float
    step: int


class Node:
    def __init__(self, config: Config, run_dir: Path, sync: Sync | None = None, *, ranks: Ranks | None = None,
                 stop: StopRequested | None = None, metrics: Any = None, progress: bool | None = None,
                 faults: Faults | None = None):
        self.config, self.node_dir = config, run_dir
        self.ranks = ranks or Ranks(resolve_device(config.train.device))
        leader = self.ranks.leader
        self.run_dir = prepare_run_dir(run_dir if leader else run_dir / "ranks" / str(self.ranks.rank))
        self.stop = stop or StopRequested()
        self.metrics = metrics if leader else None
        self.progress = leader and (sys.stderr.isatty() if progress is None else progress)
        self.threads = ThreadBudget(config.train.num_threads)  # CPU threads, shared with the nodes on this box
        self.device = self.ranks.device
        # One data order per node, keyed by rank 0's identity (or run directory, alone).
        self.sync = sync or SoloSync(self.ranks.broadcast_str(node_key(run_dir) if leader else ""))
        set_log_context(peer=self.sync.peer_id)
        self._build(faults)
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
        self._resumed_flight: tuple[int, torch.Tensor, float] | None = None  # a checkpoint's round in flight
        self._deferred: RoundRecord | None = None  # sync.overlap: a record served once its average is known
        # sync.overlap=inner and sync.fragments: the model's weights carry on into the next round
        # (not reset to θ); under inner the previous round's average applied in this one (`Landing`).
        self._carry = False
        self._landed: Landing | None = None
        self._ended: tuple[int, torch.Tensor] | None = None  # overlap_merge=rebase: a round's trained weights at its end
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
        # sync.overlap: the average in flight behind the next round's compute (diloco_p2p.loop.overlap)
        # (on N local ranks, one per rank on its shard, as the outer state)
        self.pipeline = None if cfg.sync.overlap == "none" else Pipeline(
            cfg.sync.overlap, self.outer.numel, cfg.outer, cfg.sync.min_group_size, cfg.sync.overlap_steps)
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
        if self._resumed_flight is not None and self.pipeline is not None:  # average it again, with the swarm
            round, delta, weight = self._resumed_flight
            self.pipeline.begin(self.sync, round, delta, weight, self.outer.params_sha256())
            self._resumed_flight = None
        while self.round < self.last_round and not self._stopping():
            set_log_context(round=self.round + 1, step=self.step)
            self.threads.apply()  # nodes on this machine may have started or stopped
            resync = self.sync.before_round(self.state())  # the swarm's θ, if we fell behind
            if resync is not None:
                records.append(self._adopt(resync))
                continue
            start, steps, round_tokens = time.perf_counter(), [], 0
            compute_start = time.time()
            # where the inner steps start, relative to θ: an eager node's correction, or our unsent residual's share
            offset = self.pipeline.local_offset() if self.pipeline else self.feedback.start_offset()
            if not self._carry:  # every round starts from θ (+ eager c); under overlap=inner, where the last ended
                with self._outer_timer():
                    self.outer.copy_into(self.layout.local_views(), offset)
                self._carry = self.fragments.on  # fragments: each part takes θ at its own round

            h, behind, compute_s = self._inner_steps(), self._behind(), 0.0
            for _ in range(h):  # H inner steps on our own data
                if self._round_ends(len(steps), schedule.catch_up_steps(h, behind, compute_s / max(len(steps), 1))):
                    break
                steps.append(self.trainer.step(self._next_batch))
                compute_s = time.perf_counter() - start
                round_tokens += steps[-1].tokens
                self.step += 1
                if len(steps) > 1:  # the step before: its loss is read while the GPU runs this one
                    self._observe_step(steps[-2], len(steps) - 1)
                if self.pipeline and self._deferred and self.pipeline.inflight_done():
                    self._serve(self._deferred)  # now with the average in flight, which joiners need
                if self._lands_now(len(steps)):
                    self._land(len(steps))  # overlap=inner: the previous round's average, τ steps into this one
            if steps:
                self._observe_step(steps[-1], len(steps))
            losses = [s.loss for s in steps]
            if self._stopping():
                self._unland()
                break  # abandon the partial round: nothing of it reaches θ or the swarm

            landed = self._landed
            landed_wait = landed.waited if landed else 0.0
            compute = time.perf_counter() - start - landed_wait
            with self._outer_timer():
                # Δ = θ (+ c) − θ_local; under sync.fragments of this round's part only
                delta = self.outer.pseudo_gradient(self.layout.local_views(), offset, self.fragments.part(self.round + 1))
                self._keep_ended(self.round + 1)
            phases = {"compute_start": compute_start, "compute_end": time.time()}
            synced, outer_before = time.perf_counter(), self._outer_seconds
            outcome, applied = self._average(delta, float(round_tokens), phases)
            # communication not hidden behind compute (the outer step inside `_average` is outer work)
            exposed = time.perf_counter() - synced + landed_wait - (self._outer_seconds - outer_before)
            if outcome is None:
                break  # stopped: the group carries on without us; our partial round is dropped
            self.round += 1
            self.tokens += round_tokens
            overlap = {} if self.pipeline is None else {"overlap": self.pipeline.mode, "phases": phases}
            if self.fragments.on:
                overlap["fragment"] = self.fragments.index(self.round)
            if landed is not None:
                overlap["landed_step"] = landed.step
            self.params_sha256()  # hashed here, so its time counts in the outer step's
            outer_seconds, self._outer_seconds = self._outer_seconds, 0.0
            records.append(self._commit(self._record(outcome, start, losses, round_tokens, compute_seconds=compute,
                                                     exposed_seconds=exposed, outer_seconds=outer_seconds,
                                                     applied_round=applied, **overlap)))

        if self._stopping():
            self._save()  # under sync.fragments with the trained weights, before θ replaces them
        self.outer.copy_into(self.layout.local_views())
        if self.pipeline is not None:
            self.pipeline.drop()  # a stop: the checkpoint holds the round in flight; wait out its thread
            self.pipeline.settle()
        return records

    def _average(self, delta: torch.Tensor, weight: float,
                 phases: dict[str, float]) -> tuple[RoundOutcome | None, int | None]:
        """The round's outer step: the round's average now (blocking), or under sync.overlap the
        previous round's, which ran behind this round's inner steps, while this round's starts in
        the background (`diloco_p2p.loop.overlap`). Returns the outcome applied and its round; None
        when a stop came first (the round is dropped; a round whose average is under way is not)."""
        round, pipe, part = self.round + 1, self.pipeline, self.fragments.part(self.round + 1)
        if pipe is None or round >= self.last_round:  # blocking; the last round drains the pipeline
            if pipe is not None and self._deferred is not None:
                pipe.inflight_done(wait=True)
                self._serve(self._deferred)
            flight = pipe.take() if pipe is not None else None
            saved = None
            if self._landed is not None:  # overlap=inner: round − 1's average landed τ steps into this round
                flight, saved = self._landed.flight, self._landed.saved
                self._landed = None
                phases.update(flight.span())
                self.feedback.settle(flight.delta, flight.result(), self.fragments.part(flight.round))
            elif flight is not None:
                if self._stopping():
                    pipe.inflight = flight  # type: ignore[union-attr] - kept for the checkpoint
                    return None, None
                saved = self.outer.snapshot(self.fragments.part(flight.round))
                phases.update(flight.span())
                self._apply(flight.result(), flight.round)
                self.feedback.settle(flight.delta, flight.result(), self.fragments.part(flight.round))
            delta = self.feedback.offer(delta, part)  # + what earlier rounds' lossy wire did not send (`feedback`)
            outcome = self.sync.average(round, delta, weight, self._shard_sha256())
            if self._stopping():
                self.feedback.withdraw(part)  # the round is dropped: its e is owed again (and checkpointed)
                if saved is not None:  # back to the round before: its average in flight, not applied
                    self._restore(saved, flight.round)  # type: ignore[union-attr]
                    pipe.inflight = flight  # type: ignore[union-attr]
                return None, None
            self.feedback.settle(delta, outcome, part)
            if pipe is not None and pipe.correction is not None:
                pipe.correction.reset()
            self._apply(outcome, round)
            if part is not None:  # sync.fragments: the part's trained weights take its new θ
                self.outer.copy_into(self.layout.local_views(), part=part)
            return outcome, round
        if self._landed is not None:  # overlap=inner: round − 1's average landed τ steps into this round
            flight = self._landed.flight
            self._landed, self._carry = None, True
            outcome = flight.result()
            phases.update(flight.span())
            self.feedback.settle(flight.delta, outcome, self.fragments.part(flight.round))
            pipe.begin(self.sync, round, self.feedback.offer(delta, part), weight, self._shard_sha256())
            return outcome, flight.round
        if self._deferred is not None:  # the last round's record waits for its average (`_serve`)
            pipe.inflight_done(wait=True)
            self._serve(self._deferred)
        flight = pipe.take()  # the exposed part: the wait for round − 1's average
        if self._stopping():
            pipe.inflight = flight  # not applied: the checkpoint keeps it to average again
            return None, None
        if flight is None:  # the first round: nothing to apply yet
            outcome = RoundOutcome(status="skipped")
            self._carry = self._carry or pipe.lands_after is not None
        else:
            outcome = flight.result()
            phases.update(flight.span())
            self._apply(outcome, flight.round)
            pipe.learn(outcome)
            self.feedback.settle(flight.delta, outcome, self.fragments.part(flight.round))
        pipe.correct(delta)  # eager: a_t·Δ_m^(t) replaces a_{t-1}·Δ_m^(t-1) in the local correction
        pipe.begin(self.sync, round, self.feedback.offer(delta, part), weight, self._shard_sha256())
        return outcome, None if flight is None else flight.round

    def _lands_now(self, done: int) -> bool:
        """overlap=inner: whether round t's average lands after the `done`-th inner step of round
        t+1: at τ = sync.overlap_steps, or with τ = 0 once it is known on every local rank (at the
        latest after H−1 steps)."""
        pipe = self.pipeline
        if pipe is None or pipe.lands_after is None or pipe.inflight is None:
            return False
        if pipe.lands_after:
            return done == pipe.lands_after
        return done >= self.config.outer.inner_steps - 1 or not self.ranks.any(not pipe.inflight_done())

    def _land(self, done: int) -> None:
        """sync.overlap=inner: τ steps into round t+1, wait for round t's average (the exposed part),
        apply it to θ, and merge θ into the weights being trained: θ_local ← α·θ_local + (1−α)·θ
        (`diloco_p2p.loop.overlap`). Round t's record is served first, its state still without it."""
        pipe = self.pipeline
        assert pipe is not None and pipe.inflight is not None  # `_lands_now`
        began = time.perf_counter()
        pipe.inflight_done(wait=True)
        if self._deferred is not None:
            self._serve(self._deferred)
        flight = pipe.take()
        assert flight is not None
        waited = time.perf_counter() - began
        part = self.fragments.part(flight.round)
        saved = self.outer.snapshot(part)  # a copy of θ and momentum (of the part)
        if part is not None:  # sync.fragments: and of the part's trained weights, which the merge changes
            saved["local"] = self.outer.gather(self.layout.local_views())[part[0]:part[1]].clone()
        outcome = flight.result()
        self._apply(outcome, flight.round)
        pipe.learn(outcome)
        if self.config.sync.overlap_merge == "rebase":  # θ_local ← θ + (θ_local − where round t ended)
            lo, hi = part or (0, self.outer.numel)
            ended = self._ended[1] if self._ended and self._ended[0] == flight.round else saved["theta"]
            self.outer.shift_into(self.layout.local_views(), self.outer.theta[lo:hi] - ended, part)
        else:  # θ_local ← α·θ_local + (1−α)·θ
            self.outer.mix_into(self.layout.local_views(), self.config.sync.overlap_mix, part)
        self._ended = None
        self._landed = Landing(flight, saved, waited, done)

    def _keep_ended(self, round: int) -> None:
        """overlap_merge=rebase: keep round `round`'s trained weights (its part) as its steps left them."""
        if self.pipeline is not None and self.pipeline.lands_after is not None \
                and self.config.sync.overlap_merge == "rebase":
            lo, hi = self.fragments.part(round) or (0, self.outer.numel)
            self._ended = (round, self.outer.gather(self.layout.local_views())[lo:hi].clone())

    def _unland(self) -> None:
        """A stop after the landing: back to θ from before it, the average in flight again (the
        checkpoint keeps it to average again, as for a stop before it)."""
        if self._landed is not None and self.pipeline is not None:
            self._restore(self._landed.saved, self._landed.flight.round)
            self.pipeline.inflight, self._landed = self._landed.flight, None

    def _restore(self, saved: dict[str, torch.Tensor], round: int) -> None:
        """θ and momentum from before round `round`'s average landed (and, under sync.fragments,
        its part's trained weights from before the merge)."""
        local, part = saved.get("local"), self.fragments.part(round)
        self.outer.restore(saved)
        if local is not None and part is not None:
            self.outer.write_into(self.layout.local_views(), local, part[0])

    def _apply(self, outcome: RoundOutcome, round: int) -> None:
        """Round `round`'s average to θ (to its part under sync.fragments)."""
        if outcome.average is not None:
            with self._outer_timer():
                # outer Nesterov step, identical on every group member
                self.outer.step(outcome.average, self.fragments.part(round), round)

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
        if catch_up is None or catch_up[0] != self.round + 1 or self.pipeline is not None or self.fragments.on:
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
        state = self.outer.state_tensors()
        if self.pipeline is not None:
            state = {**state, **self.pipeline.served_tensors()}
        flight = self.pipeline.inflight if self.pipeline is not None else None
        return NodeState(round=self.round, step=self.step, tokens=self.tokens, params_sha256=self.params_sha256(),
                         shard_sha256=self.outer.params_sha256(), joined_at_round=self.joined_at_round,
                         resyncs=self.resyncs, state=state, in_flight_round=flight.round if flight else None)

    def _adopt(self, resync: SwarmState) -> RoundRecord:
        """Take the swarm's θ and momentum (downloaded and verified) and its round."""
        start, dropped = time.perf_counter(), self.round
        self.outer.load_state_tensors(resync.tensors)
        self._carry, self._ended = False, None
        if self.pipeline is not None:  # our round in flight and correction go; the state's average in flight comes
            self.pipeline.adopt(resync.tensors, resync.round, self.fragments.numel(resync.round))
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
            carried = [p.detach().clone() for p in self.layout.local_views()] if self._carry else None
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
        self._append(record)
        if self.metrics:
            self.metrics.observe_round(record.as_dict())
            self.metrics.set_dht_peers(self.sync.dht_peers())
            self.metrics.set_reachability(self.sync.reachability)
        if self.pipeline is not None and not self.pipeline.inflight_done():
            self._deferred = record  # served once the round's average is known (`_serve`)
        else:
            self._serve(record)
        self._log_round(record)
        return record

    def _serve(self, record: RoundRecord) -> None:
        """Publish the round and serve the state. Under sync.overlap only once the round's average
        is known, so the state carries it: a joiner that adopts it applies it as the members do."""
        self._deferred = None
        node = self.state()
        self.sync.after_round(node, record)

    def _append(self, record: RoundRecord) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record.as_dict()) + "\n")

    def _initial_record(self) -> RoundRecord:
        """Round 0: the untrained global parameters, so eval loss start -> end is in metrics.jsonl."""
        self.outer.copy_into(self.layout.local_views())
        record = RoundRecord(round=0, step=0, tokens=0, params_sha256=self.params_sha256(), status="init",
                             eval_loss=self.trainer.evaluate(self.eval_set) if self.eval_set else None)
        self._append(record)
        with log_context(round=0, step=0):
            log.info("round 0: eval loss %s of the initial parameters %s", _loss(record.eval_loss),
                     record.params_sha256[:12])
        return record

    def _observe_step(self, stats: StepStats, done: int) -> None:
        if self.metrics:
            self.metrics.observe_inner_step(stats.tokens, stats.loss)
        if self.progress:
            h = schedule.inner_steps(self.config.outer, self.config.train.max_rounds, self.round + 1)
            bar = "#" * (20 * done // h)
            sys.stderr.write(f"\rround {self.round + 1} [{bar:<20}] {done}/{h} loss {stats.loss:.3f}")
            sys.stderr.flush()

    def _log_round(self, r: RoundRecord) -> None:
        if self.progress:
            sys.stderr.write("\r\033[K")
        with log_context(round=r.round, step=r.step):  # the prefix names the round and step this line is about
            log.info("round %d/%d  step %d  loss %s  eval %s  %.0f tok/s  %s (group %d)  params %s", r.round,
                     self.last_round, r.step, _loss(r.train_loss), _loss(r.eval_loss), r.tokens_per_s,
                     r.status, r.group_size, r.params_sha256[:12])
            if r.first_commit_seconds is not None:
                log.info("first committed round with the swarm, %.1f s after this process started",
                         r.first_commit_seconds)

    # -- checkpoints -----------------------------------------------------------------------------

    def state_checkpoint(self) -> Checkpoint | None:
        """The node's checkpoint in the 1-rank layout (collective on N ranks; None off rank 0)."""
        leader = self.ranks.leader
        theta, momentum = self.layout.to_full(self.outer.theta), self.layout.to_full(self.outer.momentum)
        error = self.layout.to_full(self.feedback.error) if self.feedback.enabled else None
        trainer_state = self.trainer.state_dict()
        for key in self.trainer.optimizers:  # AdamW, and Muon under inner.optimizer=muon
            trainer_state[key] = gather_optimizer_state(trainer_state[key], keep=leader)
        params_sha256 = self.params_sha256()
        overlap: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        # sync.fragments: the parts are mid-way, so the weights being trained too
        trained = self.layout.to_full(self.outer.gather(self.layout.local_views()).clone()) \
            if self.fragments.on and self._carry else None
        if self.pipeline is not None:  # the pending local Δ (the round in flight) and the eager correction
            flight, to_full = self.pipeline.inflight, self.layout.to_full
            if self.fragments.on and flight is not None:  # the Δ in flight is its round's part
                def to_full(t: torch.Tensor, round: int = flight.round) -> torch.Tensor | None:
                    return self.fragments.to_full(t, round)
            extra, overlap = self.pipeline.state_tensors(to_full)
        if not leader:
            return None
        tensors = {"outer.theta": theta, "outer.momentum": momentum, **extra}
        if trained is not None:
            tensors["fragments.local"] = trained
        if error is not None:
            tensors["feedback.error"] = error
        inner = split_tensors(trainer_state, tensors, "inner")
        meta = {
            "inner": inner, "data_position": asdict(self.data.position), "swarm_view": self.swarm_view,
            "config_hash": self.config.swarm_hash(), "params_sha256": params_sha256, "version": __version__,
            "joined_at_round": self.joined_at_round, "resyncs": self.resyncs,
            "local_world_size": self.ranks.world_size, "overlap": overlap,
        }
        return Checkpoint(round=self.round, step=self.step, tokens=self.tokens, tensors=tensors, meta=meta)

    def _save(self) -> None:
        ckpt = self.state_checkpoint()
        if ckpt is not None:
            save_checkpoint(self.node_dir / "checkpoints", ckpt)

    def _resume(self) -> None:
        """Every rank reads the full checkpoint (any world size wrote it) and keeps its part."""
        ckpt = load_checkpoint(self.node_dir / "checkpoints", self.swarm_view, self.config.train.resume_round)
        if ckpt is None:
            return
        self.outer.load_state_tensors({k: self.layout.to_local(ckpt.tensors[k]) for k in ("outer.theta",
                                                                                          "outer.momentum")})
        if "feedback.error" in ckpt.tensors and self.feedback.enabled:  # absent: written with feedback off
            self.feedback.load(self.layout.to_local(ckpt.tensors["feedback.error"]))
        if "inner" in ckpt.meta:  # absent in a state fetched from the swarm: a fresh AdamW then
            state = join_tensors(ckpt.meta["inner"], ckpt.tensors)
            self.trainer.check_state(state, f"checkpoint round {ckpt.round}")
            for key, optimizer in self.trainer.optimizers.items():
                state[key] = shard_optimizer_state(optimizer, state[key])
            self.trainer.load_state_dict(state)
        if "data_position" in ckpt.meta:
            self.data.position = DataPosition(**ckpt.meta["data_position"])
        self.round, self.step, self.tokens = ckpt.round, ckpt.step, ckpt.tokens
        self.joined_at_round = ckpt.meta.get("joined_at_round")
        self.resyncs = ckpt.meta.get("resyncs", 0)
        if self.pipeline is not None:
            meta = ckpt.meta.get("overlap") or {}
            to_local = self.layout.to_local
            if self.fragments.on:  # the round in flight holds its part's values
                def to_local(t: torch.Tensor, round: int = int(meta.get("inflight_round", 1))) -> torch.Tensor:
                    return self.fragments.to_local(t, round, f"checkpoint round {ckpt.round}")
            self._resumed_flight = self.pipeline.load(ckpt.tensors, meta, to_local)
        # overlap=inner carries on from where the round in flight ended: θ − its Δ (with error
        # feedback on, less the residual it carried: `diloco_p2p.loop.error_feedback`); sync.fragments from the
        # weights the checkpoint holds; otherwise from θ
        local = ckpt.tensors.get("fragments.local") if self.fragments.on else None
        if local is not None:
            if local.numel() != sum(self.layout.full_numels):
                raise UserError(f"checkpoint round {ckpt.round}: fragments.local has {local.numel()} values, the "
                                f"model {sum(self.layout.full_numels)}; resume with the config that wrote it")
            self.outer.write_into(self.layout.local_views(), self.layout.to_local(local.to(torch.float32).reshape(-1)))
            self._carry = True
        else:
            self._carry = self._resumed_flight is not None and self.pipeline is not None \
                and self.pipeline.lands_after is not None
            self.outer.copy_into(self.layout.local_views(), -self._resumed_flight[1] if self._carry else None)
        if self._carry and self._resumed_flight is not None:  # where the round in flight ended, as far as known
            self._keep_ended(self._resumed_flight[0])
        log.info("resumed from checkpoint at round %d (step %d; written by %s local rank(s))",
                 self.round, self.step, ckpt.meta.get("local_world_size", 1))


def _loss(value: float | None) -> str:
    """A loss as every log line shows it: 4 decimals, or "-" when there is none."""
    return "-" if value is None else f"{value:.4f}"
