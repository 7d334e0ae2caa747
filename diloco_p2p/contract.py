"""The contract between a node and the swarm it trains in.

The training loop (`diloco_p2p.loop.node`) and the network layer (`diloco_p2p.swarm`) meet only
here: `Sync` (what the loop calls each round; `SoloSync` for a solo node, `SwarmSync` or the
multi-rank `ShardSync` in a swarm), `NodeState` (the read-only view of the node the swarm
needs), `RoundOutcome` (the averaged Δ, or nothing), `SwarmState` (a verified state to adopt),
`RoundRecord` (one shape for every round: a line of ``metrics.jsonl``, gauges and the DHT
record), `StopRequested` (the signal flag), and `InFlight` (one round's average under way in
the background). Network faults are data here: a round ends ``committed``, ``alone``,
``failed`` or ``resynced``, never with an exception out of the loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch

log = logging.getLogger("diloco_p2p.loop.node")

# Why a node refuses a peer (`diloco_p2p.swarm.trust.guard`): a record signed by another peer than
# the one it names, a peer a closed run has not admitted, a state claimed past train.max_rounds
# or backed by too few peers, a downloaded θ that is not the one the swarm vouched for, a
# contribution to the all-reduce refused for its weight or norm (`diloco_p2p.swarm.collective.aggregate`),
# a reducer the members caught (its part dropped), a contribution that is not a vector of this
# model (NaN or Inf, another length or wire format: "malformed"), one pointing against the
# others' ("opposed": a sign flip, `aggregate.opposed`). The label set of
# diloco_rejections_total, and the values of `RoundRecord.rejections`.
REJECTION_REASONS = ("forged-record", "not-admitted", "past-max-rounds", "unvouched-state", "bad-state",
                     "weight", "norm", "reducer", "malformed", "opposed")


def view_hash(view: Mapping[str, Any]) -> str:
    """sha256 over a config view (`Config.swarm_view()`): nodes with another hash are refused."""
    return hashlib.sha256(json.dumps(dict(view), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class NodeState:
    """What the swarm sees of a node at one moment: `params_sha256` of the global θ, `shard_sha256`
    of this process's part, and `state` (θ and momentum for joiners, never edited by the swarm). Under
    ``sync.overlap`` round `in_flight_round`'s average is not in θ yet."""

    round: int
    step: int
    tokens: int
    params_sha256: str
    shard_sha256: str
    joined_at_round: int | None
    resyncs: int
    state: Mapping[str, torch.Tensor] = field(repr=False, compare=False)
    in_flight_round: int | None = None


@dataclass
class RoundOutcome:
    """A round as the swarm saw it. `average` is what the outer step applies (None: nothing)."""

    status: str
    average: torch.Tensor | None = field(default=None, repr=False)
    group_size: int = 1
    allreduce_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    params_agree: bool | None = None  # do the nodes at our round hold our θ (before averaging)?
    config_agree: bool | None = None
    contributors: int | None = None  # group members whose Δ made it into the average
    rejected: dict[str, str] | None = None  # peer -> why its contribution was refused
    parts_committed: int | None = None
    parts: int | None = None
    dropped_peers: int | None = None
    shards: int | None = None  # a node of N local ranks averages N shards
    shards_committed: int | None = None
    state_bytes: int | None = None  # a resync: the download
    state_seconds: float | None = None
    donor: str | None = None
    rejections: dict[str, list[str]] | None = None  # peer -> why it was refused this round (`REJECTION_REASONS`)
    wire_ratio: float | None = None  # all-reduce seconds / wire time of bytes_sent at sync.link_mbit (1.0 = line rate)
    # Liveness (`diloco_p2p.swarm.membership.liveness`): how many peers the round waited for, the
    # peers that missed rounds as this node saw them (peer -> missed, away_s, away), the deadlines used.
    waited_for: int | None = None
    away: dict[str, dict[str, Any]] | None = None
    matchmaking_deadline: float | None = None
    allreduce_deadline: float | None = None
    # sync.average_moments (`diloco_p2p.loop.moments`): how the inner first moments' all-reduce
    # after a committed round ended, "ok" (applied), "partial" or "failed" (the node kept its own); None: not run.
    moments: str | None = None


@dataclass
class SwarmState:
    """A state downloaded from the swarm and verified, for the node to adopt in place of its own."""

    tensors: dict[str, torch.Tensor]
    round: int
    outcome: RoundOutcome
    # How long ago the swarm began round `round + 1` (its members published `round`), when known:
    # the node joins that round in flight with the steps the others have left (`schedule.catch_up_steps`).
    behind_seconds: float | None = None


@dataclass
class RoundRecord:
    """One round of one node. `as_dict()` is a line of metrics.jsonl."""

    round: int
    step: int
    tokens: int
    params_sha256: str
    status: str
    group_size: int = 1
    train_loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    compression: str | None = None
    lr: float | None = None
    allreduce_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    params_agree: bool | None = None
    config_agree: bool | None = None
    contributors: int | None = None
    rejected: dict[str, str] | None = None
    parts_committed: int | None = None
    parts: int | None = None
    dropped_peers: int | None = None
    shards: int | None = None
    shards_committed: int | None = None
    state_bytes: int | None = None
    state_seconds: float | None = None
    donor: str | None = None
    rejections: dict[str, list[str]] | None = None
    wire_ratio: float | None = None
    waited_for: int | None = None  # liveness (`RoundOutcome`)
    away: dict[str, dict[str, Any]] | None = None
    matchmaking_deadline: float | None = None
    allreduce_deadline: float | None = None
    moments: str | None = None  # sync.average_moments (`RoundOutcome`)
    first_commit_seconds: float | None = None  # the process's first committed round: seconds since it started
    compute_seconds: float | None = None  # inner steps of the round (the work a volunteer's GPU does)
    exposed_seconds: float | None = None  # the loop stood still for the swarm: matchmaking + all-reduce
    outer_seconds: float | None = None  # θ to the model, Δ back, the outer step and the hash of the new θ
    utilization: float | None = None  # compute_seconds / seconds
    dropped_round: int | None = None  # a resync: the round of our own θ that was given up
    resyncs: int | None = None
    joined_at_round: int | None = None
    # sync.overlap (`diloco_p2p.loop.overlap`): the mode, the round whose average this round's outer step
    # applied (round - 1 while the pipeline runs; None: none), and wall-clock times (time.time) of
    # this round's compute, of that average's background span and of the loop going on ("compute_start",
    # "compute_end", "average_start", "average_done", "resumed"): exposed_seconds then lies within
    # compute_end..resumed, never in the part of the average that ran behind the compute.
    overlap: str | None = None
    applied_round: int | None = None
    phases: dict[str, float] | None = None
    landed_step: int | None = None  # overlap=inner: the inner step after which that average landed (τ)
    fragment: int | None = None  # sync.fragments: the part of the parameters this round's Δ was (0-based)

    @classmethod
    def of(cls, outcome: RoundOutcome, **node: Any) -> RoundRecord:
        """The record of a round: the node's own numbers and what the swarm reported."""
        swarm = {f.name: getattr(outcome, f.name) for f in fields(outcome) if f.name != "average"}
        return cls(**swarm, **node)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Sync(Protocol):
    """The swarm, as the training loop sees it."""

    peer_id: str
    # Compute speed (tokens/s) of each member of our last group, for dynamic local updates;
    # None when unknown (solo, no group yet, or a multi-rank node whose shards may differ).
    speeds: dict[str, float] | None
    # "public" or "private" (behind NAT: `diloco_p2p.swarm.transport.reach`); None without a swarm.
    reachability: str | None

    def announce(self, node: NodeState) -> None:
        """The node is built: make it visible (and refuse it now if its config differs)."""

    def before_round(self, node: NodeState) -> SwarmState | None:
        """A verified swarm state to adopt if we fell behind or hold a minority θ; else None."""

    def average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> RoundOutcome:
        """Average Δ with the round's group; never raises for a network fault."""

    def average_moments(self, round: int, moments: torch.Tensor, weight: float) -> RoundOutcome:
        """sync.average_moments: average the inner first moments with the group that just committed
        `round` (``committed``: the outcome's `average` is theirs); never raises for a network fault."""

    def after_round(self, node: NodeState, record: RoundRecord) -> None:
        """Publish the round's record and serve the new state."""

    def dht_peers(self) -> int: ...

    def close(self) -> None: ...


class SoloSync:
    """No swarm: the node's own pseudo-gradient is the average (M=1 DiLoCo)."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.speeds: dict[str, float] | None = None
        self.reachability: str | None = None

    def announce(self, node: NodeState) -> None:
        pass

    def before_round(self, node: NodeState) -> SwarmState | None:
        return None

    def average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> RoundOutcome:
        return RoundOutcome(status="alone", average=delta, group_size=1)

    def average_moments(self, round: int, moments: torch.Tensor, weight: float) -> RoundOutcome:
        return RoundOutcome(status="alone", group_size=1)

    def after_round(self, node: NodeState, record: RoundRecord) -> None:
        pass

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


class InFlight:
    """One round's averaging, under way in the background. `result()` waits for it (the
    exposed part); `started`/`done_at` are wall-clock (time.time) for the round's record."""

    def __init__(self, round: int, delta: torch.Tensor, weight: float, params_hash: str,
                 node_wide: Callable[[RoundOutcome], RoundOutcome] | None = None):
        self.round, self.delta, self.weight, self.params_hash = round, delta, weight, params_hash
        self._node_wide = node_wide  # run once on the loop's thread (`node_result`)
        self.started = time.time()
        self.done_at: float | None = None
        self._outcome: RoundOutcome | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()

    def _finish(self, outcome: RoundOutcome | None, error: BaseException | None = None) -> None:
        self._outcome, self._error, self.done_at = outcome, error, time.time()
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def span(self) -> dict[str, float]:
        """Its wall-clock span for the round record's `phases` (done: now, if not yet known)."""
        return {"average_start": self.started, "average_done": self.done_at or time.time()}

    def result(self) -> RoundOutcome:
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._outcome is not None
        return self._outcome

    def node_result(self) -> RoundOutcome:
        """`result()`, made node-wide the first time (on N local ranks a collective: every rank
        calls it at the same point of the loop, on the loop's thread); `result()` then returns it."""
        outcome = self.result()
        if self._node_wide is not None:
            node_wide, self._node_wide = self._node_wide, None
            self._outcome = outcome = node_wide(outcome)
        return outcome


class Background(InFlight):
    """`average` in a daemon thread (a swarm's call never raises for a network fault); the
    optional `node_wide` step runs later, on the loop's thread (`InFlight.node_result`)."""

    def __init__(self, average: Callable[..., RoundOutcome], round: int, delta: torch.Tensor, weight: float,
                 params_hash: str, node_wide: Callable[[RoundOutcome], RoundOutcome] | None = None):
        super().__init__(round, delta, weight, params_hash, node_wide)
        threading.Thread(target=self._run, args=(average,), name=f"average-round-{round}", daemon=True).start()

    def _run(self, average: Callable[..., RoundOutcome]) -> None:
        try:
            outcome = average(self.round, self.delta, self.weight, self.params_hash)
        except BaseException as e:  # handed to the loop by result()
            self._finish(None, e)
            return
        self._finish(outcome)


@runtime_checkable
class BeginsAverage(Protocol):
    """A `Sync` that starts an average itself (the simulator's replicas take turns on one baton)."""

    def begin_average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> InFlight: ...


def begin_average(sync, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> InFlight:
    """Start averaging `delta` for `round` in the background; `sync.average` in a thread unless
    the sync starts it itself."""
    if isinstance(sync, BeginsAverage):
        return sync.begin_average(round, delta, weight, params_hash)
    return Background(sync.average, round, delta.clone(), weight, params_hash)


def resolved(round: int, delta: torch.Tensor, weight: float, params_hash: str, outcome: RoundOutcome) -> InFlight:
    """An average already done (a sync with nothing to wait for)."""
    flight = InFlight(round, delta, weight, params_hash)
    flight._finish(outcome)
    return flight
