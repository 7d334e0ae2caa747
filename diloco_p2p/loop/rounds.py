"""How a round ends, one object per ``sync.overlap`` mode, behind one call from the loop.

`Node.run` asks the mode where a round's inner steps start (`start_round`), lets it act after
each step (`after_step`: serve a record whose average came in, land under ``inner``) and hands
it the round's pseudo-gradient (`finish_round`), which returns the outcome applied to θ and its
round. ``none`` averages it now (`Blocking`); ``delayed`` and ``eager`` average it behind the next
round's steps and apply the previous round's (`Delayed`, `Eager`); ``inner`` lands that average
τ steps into the round (`Inner`). Each owns its state in flight, its landing, what it adds to the
served state and to a checkpoint, and what a stop puts back; the formulas are in
`diloco_p2p.loop.overlap`, the parts of sync.fragments in `diloco_p2p.loop.fragments`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from diloco_p2p.config import Config
from diloco_p2p.contract import InFlight, RoundOutcome, RoundRecord, SwarmState, Sync
from diloco_p2p.errors import UserError
from diloco_p2p.local.fsdp import ShardLayout
from diloco_p2p.local.ranks import Ranks
from diloco_p2p.loop.checkpoint import Checkpoint
from diloco_p2p.loop.error_feedback import ErrorFeedback
from diloco_p2p.loop.fragments import Fragments
from diloco_p2p.loop.moments import MomentAveraging
from diloco_p2p.loop.outer import OuterOptimizer
from diloco_p2p.loop.overlap import Pipeline


@dataclass
class LoopParts:
    """What a mode works on: the loop's tensors and seams (`Node` builds them). `serve` publishes a
    round's record and state; `timer` counts toward the round's outer seconds."""

    config: Config
    outer: OuterOptimizer
    layout: ShardLayout
    fragments: Fragments
    feedback: ErrorFeedback
    sync: Sync
    ranks: Ranks
    last_round: int
    stopping: Callable[[], bool]
    shard_sha256: Callable[[], str]
    timer: Callable[[], AbstractContextManager[None]]
    serve: Callable[[RoundRecord], None]
    moments: MomentAveraging | None = None  # sync.average_moments


class Landing(NamedTuple):
    """A round's average applied to θ before the round that uses it ends: the flight, θ and
    momentum from before it (`OuterOptimizer.snapshot` of its part under sync.fragments, restored
    if a stop drops the round; under sync.fragments also the part's trained weights from before
    the merge, "local"), and under ``inner`` the seconds waited for it and the step it landed at."""

    flight: InFlight
    saved: dict[str, torch.Tensor]
    waited: float = 0.0
    step: int = 0


class Blocking:
    """``sync.overlap: none``: the round's average now, applied at once."""

    mode = "none"
    overlapped = False

    def __init__(self, loop: LoopParts):
        self.loop = loop
        # the weights being trained carry on into the next round instead of restarting from θ
        # (sync.fragments: each part takes θ at its own round; ``inner``: the landing merges θ in)
        self.carry = False
        self.landed: Landing | None = None  # ``inner``: this round's landing so far

    # -- the round ---------------------------------------------------------------------------

    def start_offset(self) -> torch.Tensor | None:
        """Where the inner steps start, relative to θ: our unsent residual's share (error feedback)."""
        return self.loop.feedback.start_offset()

    def start_round(self) -> torch.Tensor | None:
        """θ (+ the offset) into the model, unless the trained weights carry on; the offset."""
        offset = self.start_offset()
        if not self.carry:
            with self.loop.timer():
                self.loop.outer.copy_into(self.loop.layout.local_views(), offset)
            self.carry = self.loop.fragments.on
        return offset

    def full_rounds(self) -> bool:
        """Whether every round runs its full H: a round that carries the last one's work does (no
        catch-up after a resync)."""
        return self.overlapped or self.loop.fragments.on

    def after_step(self, done: int) -> None:
        """After the `done`-th inner step of the round."""

    def abandon(self) -> None:
        """A stop inside the round: nothing of it reaches θ or the swarm."""

    def end_steps(self, round: int) -> None:
        """The round's inner steps are done (its Δ just taken)."""

    def finish_round(self, round: int, delta: torch.Tensor, weight: float,
                     phases: dict[str, float]) -> tuple[RoundOutcome | None, int | None]:
        """Round `round`'s outer step, given its Δ: the outcome applied to θ and the round it
        averaged (None: none yet); (None, None) when a stop came first (the round is dropped; a
        round whose average is under way is not). `phases` takes the average's wall-clock span."""
        return self._average_now(round, delta, weight)

    def _average_now(self, round: int, delta: torch.Tensor, weight: float) -> tuple[RoundOutcome | None, int | None]:
        """Average round `round`'s Δ blocking and apply it; (None, None) at a stop."""
        loop, part = self.loop, self.loop.fragments.part(round)
        delta = loop.feedback.offer(delta, part)  # + what earlier rounds' lossy wire did not send
        outcome = loop.sync.average(round, delta, weight, loop.shard_sha256())
        if loop.stopping():
            loop.feedback.withdraw(part)  # the round is dropped: its e is owed again (and checkpointed)
            return None, None
        loop.feedback.settle(delta, outcome, part)
        self._drained()
        self.apply(outcome, round)
        if loop.moments is not None:  # sync.average_moments (overlap none): the group's moments too
            loop.moments.after(round, weight, outcome)
        if part is not None:  # sync.fragments: the part's trained weights take its new θ
            loop.outer.copy_into(loop.layout.local_views(), part=part)
        return outcome, round

    def _drained(self) -> None:
        """A round averaged blocking (under overlap the last): nothing of the node's own stays in θ's start."""

    def apply(self, outcome: RoundOutcome, round: int) -> None:
        """Round `round`'s average to θ (to its part under sync.fragments)."""
        if outcome.average is not None:
            with self.loop.timer():  # outer Nesterov step, identical on every group member
                self.loop.outer.step(outcome.average, self.loop.fragments.part(round), round)

    # -- what the swarm sees -----------------------------------------------------------------

    def publish(self, record: RoundRecord) -> None:
        """The round's record and state to the swarm."""
        self.loop.serve(record)

    def served_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def in_flight_round(self) -> int | None:
        return None

    def record_fields(self, round: int, phases: dict[str, float], landed: Landing | None) -> dict[str, Any]:
        """What the round's record says of the mode (and of the part under sync.fragments)."""
        fields: dict[str, Any] = {"overlap": self.mode, "phases": phases} if self.overlapped else {}
        if self.loop.fragments.on:
            fields["fragment"] = self.loop.fragments.index(round)
        if landed is not None:
            fields["landed_step"] = landed.step
        return fields

    def adopt(self, resync: SwarmState) -> None:
        """The swarm's state replaces ours: the round starts from its θ."""
        self.carry = False

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint(self) -> tuple[dict[str, torch.Tensor | None], dict[str, Any]]:
        """The mode's checkpoint tensors (the 1-rank layout; a collective on N ranks) and meta."""
        loop, tensors = self.loop, {}
        if loop.fragments.on and self.carry:  # the parts are mid-way, so the weights being trained too
            tensors["fragments.local"] = loop.layout.to_full(loop.outer.gather(loop.layout.local_views()).clone())
        return tensors, {}

    def resume(self, ckpt: Checkpoint) -> None:
        """The model's weights from a checkpoint whose θ is loaded: sync.fragments' trained
        weights if it holds them, otherwise θ."""
        loop = self.loop
        local = ckpt.tensors.get("fragments.local") if loop.fragments.on else None
        if local is None:
            self.carry = self._resume_carry()
            return
        if local.numel() != sum(loop.layout.full_numels):
            raise UserError(f"checkpoint round {ckpt.round}: fragments.local has {local.numel()} values, the "
                            f"model {sum(loop.layout.full_numels)}; resume with the config that wrote it")
        loop.outer.write_into(loop.layout.local_views(), loop.layout.to_local(local.to(torch.float32).reshape(-1)))
        self.carry = True

    def _resume_carry(self) -> bool:
        """Without trained weights in the checkpoint: θ into the model; whether they carry on."""
        self.loop.outer.copy_into(self.loop.layout.local_views(), None)
        return False

    def begin_resumed(self) -> None:
        """At the start of a run: a checkpoint's round in flight averaged again, with the swarm."""

    def close(self) -> None:
        """The run is over (or stopped): wait out what is in flight."""


class Delayed(Blocking):
    """``sync.overlap: delayed``: round t's average runs behind round t+1's inner steps and is
    applied at its end; the last round drains the pipeline (`diloco_p2p.loop.overlap`)."""

    mode = "delayed"
    overlapped = True

    def __init__(self, loop: LoopParts):
        super().__init__(loop)
        cfg = loop.config
        # (on N local ranks, one per rank on its shard, as the outer state)
        self.pipe = Pipeline(self.mode, loop.outer.numel, cfg.outer, cfg.sync.min_group_size,
                             cfg.sync.overlap_steps)
        self.deferred: RoundRecord | None = None  # a record served once its average is known
        self.resumed: tuple[int, torch.Tensor, float] | None = None  # a checkpoint's round in flight

    def start_offset(self) -> torch.Tensor | None:
        return None  # the global θ

    def after_step(self, done: int) -> None:
        self._serve_deferred()  # now with the average in flight, which joiners need

    def finish_round(self, round: int, delta: torch.Tensor, weight: float,
                     phases: dict[str, float]) -> tuple[RoundOutcome | None, int | None]:
        if round >= self.loop.last_round:  # blocking; the last round drains the pipeline
            return self._drain(round, delta, weight, phases)
        return self._overlap(round, delta, weight, phases)

    def _overlap(self, round: int, delta: torch.Tensor, weight: float,
                 phases: dict[str, float]) -> tuple[RoundOutcome | None, int | None]:
        """Apply round − 1's average (the exposed part: the wait for it) and start this round's."""
        loop, pipe = self.loop, self.pipe
        self._serve_deferred(wait=True)  # the last round's record waits for its average
        flight = pipe.take()
        if loop.stopping():
            pipe.inflight = flight  # not applied: the checkpoint keeps it to average again
            return None, None
        if flight is None:  # the first round: nothing to apply yet
            outcome = RoundOutcome(status="skipped")
        else:
            outcome = flight.result()
            phases.update(flight.span())
            self.apply(outcome, flight.round)
            pipe.learn(outcome)
            loop.feedback.settle(flight.delta, outcome, loop.fragments.part(flight.round))
        self._correct(delta)
        self._begin(round, delta, weight)
        return outcome, None if flight is None else flight.round

    def _correct(self, delta: torch.Tensor) -> None:
        """Our fresh Δ, as it goes into the average."""

    def _begin(self, round: int, delta: torch.Tensor, weight: float) -> None:
        loop = self.loop
        offer = loop.feedback.offer(delta, loop.fragments.part(round))
        self.pipe.begin(loop.sync, round, offer, weight, loop.shard_sha256())

    def _drain(self, round: int, delta: torch.Tensor, weight: float,
               phases: dict[str, float]) -> tuple[RoundOutcome | None, int | None]:
        """The last round: round − 1's average applied, then this round's blocking."""
        loop = self.loop
        self._serve_deferred(wait=True)
        flight = self.pipe.take()
        landed = self._take_landed(phases)
        if landed is None and flight is not None:
            if loop.stopping():
                self.pipe.inflight = flight  # kept for the checkpoint
                return None, None
            landed = Landing(flight, loop.outer.snapshot(loop.fragments.part(flight.round)))
            phases.update(flight.span())
            self.apply(flight.result(), flight.round)
            loop.feedback.settle(flight.delta, flight.result(), loop.fragments.part(flight.round))
        outcome, applied = self._average_now(round, delta, weight)
        if outcome is None and landed is not None:  # a stop: back to the round before
            self._put_back(landed)
        return outcome, applied

    def _take_landed(self, phases: dict[str, float]) -> Landing | None:
        """``inner``: the average that landed in this round, settled."""
        return None

    def _put_back(self, landed: Landing) -> None:
        """Back to the round before: its average in flight, not applied."""
        self._restore(landed.saved, landed.flight.round)
        self.pipe.inflight = landed.flight

    def _restore(self, saved: dict[str, torch.Tensor], round: int) -> None:
        """θ and momentum from before round `round`'s average landed (and, under sync.fragments,
        its part's trained weights from before the merge)."""
        local, part = saved.get("local"), self.loop.fragments.part(round)
        self.loop.outer.restore(saved)
        if local is not None and part is not None:
            self.loop.outer.write_into(self.loop.layout.local_views(), local, part[0])

    def _serve_deferred(self, wait: bool = False) -> None:
        """The record in wait, once the average in flight is known (`wait` for it)."""
        if self.deferred is not None and self.pipe.inflight_done(wait=wait):
            record, self.deferred = self.deferred, None
            self.loop.serve(record)

    # -- what the swarm sees -----------------------------------------------------------------

    def publish(self, record: RoundRecord) -> None:
        """Only once the round's average is known, so the state carries it: a joiner that adopts
        it applies it as the members do."""
        if self.pipe.inflight_done():
            self.loop.serve(record)
        else:
            self.deferred = record

    def served_tensors(self) -> dict[str, torch.Tensor]:
        return self.pipe.served_tensors()

    def in_flight_round(self) -> int | None:
        return self.pipe.inflight.round if self.pipe.inflight else None

    def adopt(self, resync: SwarmState) -> None:
        """Our round in flight and correction go; the state's average in flight comes."""
        super().adopt(resync)
        self.pipe.adopt(resync.tensors, resync.round, self.loop.fragments.numel(resync.round))

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint(self) -> tuple[dict[str, torch.Tensor | None], dict[str, Any]]:
        """Also the pending local Δ (the round in flight) and the eager correction."""
        tensors, _ = super().checkpoint()
        loop, flight, to_full = self.loop, self.pipe.inflight, self.loop.layout.to_full
        if loop.fragments.on and flight is not None:  # the Δ in flight is its round's part
            def to_full(t: torch.Tensor, round: int = flight.round) -> torch.Tensor | None:
                return loop.fragments.to_full(t, round)
        extra, meta = self.pipe.state_tensors(to_full)
        return {**extra, **tensors}, meta

    def resume(self, ckpt: Checkpoint) -> None:
        loop, meta = self.loop, ckpt.meta.get("overlap") or {}
        to_local = loop.layout.to_local
        if loop.fragments.on:  # the round in flight holds its part's values
            def to_local(t: torch.Tensor, round: int = int(meta.get("inflight_round", 1))) -> torch.Tensor:
                return loop.fragments.to_local(t, round, f"checkpoint round {ckpt.round}")
        self.resumed = self.pipe.load(ckpt.tensors, meta, to_local)
        super().resume(ckpt)

    def begin_resumed(self) -> None:
        if self.resumed is not None:
            round, delta, weight = self.resumed
            self.pipe.begin(self.loop.sync, round, delta, weight, self.loop.outer.params_sha256())
            self.resumed = None

    def close(self) -> None:
        self.pipe.drop()  # a stop: the checkpoint holds the round in flight; wait out its thread
        self.pipe.settle()


class Eager(Delayed):
    """``sync.overlap: eager``: as ``delayed``, with the node's own fresh Δ standing in for its
    stale share of the average: the inner steps start from θ + c_m (`EagerCorrection`)."""

    mode = "eager"

    def start_offset(self) -> torch.Tensor | None:
        return self.pipe.local_offset()  # c_m

    def _correct(self, delta: torch.Tensor) -> None:
        self.pipe.correct(delta)  # a_t·Δ_m^(t) replaces a_{t-1}·Δ_m^(t-1) in the local correction

    def _drained(self) -> None:
        """The run ends on the global θ: no correction left."""
        if self.pipe.correction is not None:
            self.pipe.correction.reset()


class Inner(Delayed):
    """``sync.overlap: inner``: round t's average lands τ = sync.overlap_steps inner steps into
    round t+1, and the weights being trained carry on across rounds, taking the new θ in part at
    the landing (`diloco_p2p.loop.overlap`)."""

    mode = "inner"

    def __init__(self, loop: LoopParts):
        super().__init__(loop)
        # overlap_merge=rebase: a round's trained weights (its part) at its end
        self.ended: tuple[int, torch.Tensor] | None = None

    def after_step(self, done: int) -> None:
        super().after_step(done)
        if self._lands_now(done):
            self._land(done)

    def _lands_now(self, done: int) -> bool:
        """Whether round t's average lands after the `done`-th inner step of round t+1: at τ, or
        with τ = 0 once it is known on every local rank (at the latest after H−1 steps)."""
        pipe = self.pipe
        if pipe.inflight is None:
            return False
        if pipe.lands_after:
            return done == pipe.lands_after
        return done >= self.loop.config.outer.inner_steps - 1 or not self.loop.ranks.any(not pipe.inflight_done())

    def _land(self, done: int) -> None:
        """Wait for round t's average (the exposed part), apply it to θ, and merge θ into the
        weights being trained. Round t's record is served first, its state still without it."""
        loop, pipe, cfg = self.loop, self.pipe, self.loop.config.sync
        began = time.perf_counter()
        pipe.inflight_done(wait=True)
        self._serve_deferred()
        flight = pipe.take()
        assert flight is not None  # `_lands_now`
        waited = time.perf_counter() - began
        part = loop.fragments.part(flight.round)
        saved = loop.outer.snapshot(part)  # a copy of θ and momentum (of the part)
        if part is not None:  # sync.fragments: and of the part's trained weights, which the merge changes
            saved["local"] = loop.outer.gather(loop.layout.local_views())[part[0]:part[1]].clone()
        outcome = flight.result()
        self.apply(outcome, flight.round)
        pipe.learn(outcome)
        if cfg.overlap_merge == "rebase":  # θ_local ← θ + (θ_local − where round t ended)
            lo, hi = part or (0, loop.outer.numel)
            ended = self.ended[1] if self.ended and self.ended[0] == flight.round else saved["theta"]
            loop.outer.shift_into(loop.layout.local_views(), loop.outer.theta[lo:hi] - ended, part)
        else:  # θ_local ← α·θ_local + (1−α)·θ
            loop.outer.mix_into(loop.layout.local_views(), cfg.overlap_mix, part)
        self.ended = None
        self.landed = Landing(flight, saved, waited, done)

    def end_steps(self, round: int) -> None:
        """overlap_merge=rebase: keep round `round`'s trained weights (its part) as its steps left them."""
        loop = self.loop
        if loop.config.sync.overlap_merge == "rebase":
            lo, hi = loop.fragments.part(round) or (0, loop.outer.numel)
            self.ended = (round, loop.outer.gather(loop.layout.local_views())[lo:hi].clone())

    def abandon(self) -> None:
        """A stop after the landing: back to θ from before it, the average in flight again (the
        checkpoint keeps it to average again, as for a stop before it)."""
        if self.landed is not None:
            self._put_back(self.landed)
            self.landed = None

    def _overlap(self, round: int, delta: torch.Tensor, weight: float,
                 phases: dict[str, float]) -> tuple[RoundOutcome | None, int | None]:
        landed, self.landed = self.landed, None
        if landed is None:  # the first round (or a state adopted without an average in flight)
            outcome, applied = super()._overlap(round, delta, weight, phases)
            if outcome is not None and applied is None:  # nothing to land: from now on the weights carry on
                self.carry = True
            return outcome, applied
        self.carry = True
        flight, outcome = landed.flight, landed.flight.result()
        phases.update(flight.span())
        self.loop.feedback.settle(flight.delta, outcome, self.loop.fragments.part(flight.round))
        self._begin(round, delta, weight)
        return outcome, flight.round

    def _take_landed(self, phases: dict[str, float]) -> Landing | None:
        landed, self.landed = self.landed, None
        if landed is not None:
            phases.update(landed.flight.span())
            self.loop.feedback.settle(landed.flight.delta, landed.flight.result(),
                                   self.loop.fragments.part(landed.flight.round))
        return landed

    def adopt(self, resync: SwarmState) -> None:
        super().adopt(resync)
        self.ended = None

    def _resume_carry(self) -> bool:
        """Carry on from where the round in flight ended: θ − its Δ (with error feedback on, less
        the residual it carried: `diloco_p2p.loop.error_feedback`)."""
        if self.resumed is None:
            return super()._resume_carry()
        self.loop.outer.copy_into(self.loop.layout.local_views(), -self.resumed[1])
        return True

    def resume(self, ckpt: Checkpoint) -> None:
        super().resume(ckpt)
        if self.carry and self.resumed is not None:  # where the round in flight ended, as far as known
            self.end_steps(self.resumed[0])


MODES: dict[str, type[Blocking]] = {"none": Blocking, "delayed": Delayed, "eager": Eager, "inner": Inner}


def rounds_for(loop: LoopParts) -> Blocking:
    """The object that ends the rounds of ``sync.overlap``."""
    return MODES[loop.config.sync.overlap](loop)
