"""M DiLoCo replicas in one process, no network: the swarm's arithmetic, for research sweeps.

Each replica is a full `Node` (the loop, inner trainer, data order, eval and records of
``diloco-p2p train``) with its own order key. They meet at `Rendezvous`, where the average is
computed exactly as the all-reduce computes it (parts, chunks, the wire codec, `aggregate`'s
rules, member order), so replicas whose keys are a real swarm's peer ids end every round with
that swarm's ``params_sha256``. ``topk2`` is averaged as its all-gather does; ``sync.overlap``
lands as on a node (`ReplicaSync.begin_average`). Replicas take turns (one baton), so results
do not depend on scheduling. What it reproduces: docs/architecture.md, "Simulating a swarm".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from diloco_p2p.config import Config, SyncConfig
from diloco_p2p.contract import InFlight, RoundOutcome, RoundRecord, SoloSync
from diloco_p2p.logs import log_context
from diloco_p2p.swarm.collective import aggregate, codecs, wire

log = logging.getLogger(__name__)


def wire_average(deltas: Sequence[torch.Tensor], weights: Sequence[float], compression: str,
                 max_weight_ratio: float, chunk: int = wire.DEFAULT_CHUNK_ELEMENTS,
                 robust: aggregate.Robust = aggregate.MEAN, density: float = 0.01) -> torch.Tensor:
    """The all-reduce's result for members in this order, every contribution complete and on time:
    part j is reduced by member j from every member's encoded chunks; a part whose result is not
    finite is zero (not committed), as on the swarm. ``topk2``: the all-gather's mean."""
    n, k = deltas[0].numel(), len(deltas)
    if compression in wire.SPARSE:
        accepted, _ = wire.accept_weights({i: float(w) for i, w in enumerate(weights)}, max_weight_ratio)
        contribs = [(float(weights[i]), codecs.encode_chunks(deltas[i], chunk, density)) for i in accepted]
        return codecs.sparse_mean(contribs, n, chunk, density)
    out = torch.zeros(n, dtype=torch.float32)
    for lo, hi in wire.partition(n, k):
        ranges = wire.chunk_ranges(hi - lo, chunk)
        contribs = {i: (float(w), [wire.encode(d[lo + a:lo + b], compression) for a, b in ranges])
                    for i, (d, w) in enumerate(zip(deltas, weights, strict=True))}
        norms = {i: aggregate.encoded_norm(d[lo:hi], chunk, compression) for i, d in enumerate(deltas)}
        _, _, _, values = aggregate.reduce_part(robust, contribs, norms, max_weight_ratio, hi - lo, chunk, compression)
        if values is not None:
            out[lo:hi] = values
    return out


class Rendezvous:
    """Where the replicas' Δ meet each round, and the baton they take turns with."""

    def __init__(self, keys: Sequence[str], cfg: SyncConfig, baton: threading.Lock | None = None):
        self.keys, self.cfg = sorted(keys), cfg
        self.baton = baton or threading.Lock()
        # sync.average_moments: the moments' own meeting, on the same baton
        self.moments = Rendezvous(keys, cfg.model_copy(update={"average_moments": False}), self.baton) \
            if cfg.average_moments else None
        self._cond = threading.Condition()
        self._pending: dict[str, tuple[torch.Tensor, float]] = {}
        self._results: dict[int, torch.Tensor] = {}
        self._failed = False

    def average(self, key: str, round: int, delta: torch.Tensor, weight: float) -> torch.Tensor | None:
        """Hand in our Δ; returns the round's average once all replicas have (None: one failed)."""
        self.hand_in(key, round, delta, weight)
        return self.wait(round)

    def hand_in(self, key: str, round: int, delta: torch.Tensor, weight: float) -> None:
        """Our Δ for `round`; the last replica to hand in computes the average."""
        with self._cond:
            self._pending[key] = (delta.clone(), weight)
            if len(self._pending) == len(self.keys):
                members = [self._pending.pop(k) for k in self.keys]
                self._results[round] = members[0][0] if len(members) == 1 else wire_average(
                    [d for d, _ in members], [w for _, w in members], self.cfg.compression, self.cfg.max_weight_ratio,
                    robust=aggregate.robust_of(self.cfg), density=self.cfg.topk_density)
                self._results.pop(round - 2, None)
                self._cond.notify_all()

    def wait(self, round: int) -> torch.Tensor | None:
        """The average of `round` once every replica has handed in (None: one failed)."""
        self.baton.release()  # let the others train while we wait (never hold the baton in _cond)
        try:
            with self._cond:
                self._cond.wait_for(lambda: round in self._results or self._failed)
                result = None if self._failed else self._results[round]
        finally:
            self.baton.acquire()
        return result

    def known(self, round: int) -> bool:
        """Whether the average of `round` is computed (or a replica failed): waiting would not block."""
        with self._cond:
            return round in self._results or self._failed

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()
        if self.moments is not None:
            self.moments.fail()


class ReplicaSync(SoloSync):
    """The `Sync` of one replica: every round commits with all M (see the module docstring)."""

    def __init__(self, key: str, rendezvous: Rendezvous):
        super().__init__(key)  # no swarm to announce to or resync from; speeds None: H steps each
        self.rendezvous = rendezvous

    def average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> RoundOutcome:
        average = self.rendezvous.average(self.peer_id, round, delta, weight)
        if average is None:
            return RoundOutcome(status="failed", group_size=len(self.rendezvous.keys))
        size = len(self.rendezvous.keys)
        return RoundOutcome(status="committed" if size > 1 else "alone", average=average, group_size=size)

    def average_moments(self, round: int, moments: torch.Tensor, weight: float) -> RoundOutcome:
        """sync.average_moments: the moments averaged as Δ is, at their own meeting."""
        average = self.rendezvous.moments.average(self.peer_id, round, moments, weight)
        size = len(self.rendezvous.keys)
        return RoundOutcome(status="failed" if average is None else "committed", average=average, group_size=size)

    def begin_average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> InFlight:
        """sync.overlap: hand in Δ now; the wait (baton released) comes when the loop asks for it."""
        return _ReplicaFlight(self, round, delta, weight, params_hash)


class _ReplicaFlight(InFlight):
    """A replica's average in flight: handed in, collected at `result()`."""

    def __init__(self, sync: ReplicaSync, round: int, delta: torch.Tensor, weight: float, params_hash: str):
        super().__init__(round, delta.clone(), weight, params_hash)
        self.sync = sync
        sync.rendezvous.hand_in(sync.peer_id, round, delta, weight)

    def done(self) -> bool:
        return super().done() or self.sync.rendezvous.known(self.round)

    def result(self) -> RoundOutcome:
        if not super().done():
            average, size = self.sync.rendezvous.wait(self.round), len(self.sync.rendezvous.keys)
            self._finish(RoundOutcome(status="failed", group_size=size) if average is None else RoundOutcome(
                status="committed" if size > 1 else "alone", average=average, group_size=size, contributors=size))
        return super().result()


def simulate(config: Config, root: Path, keys: Sequence[str],
             make_sync: Callable[[str, Rendezvous], ReplicaSync] = ReplicaSync,
             on_nodes: Callable[[dict], None] | None = None) -> dict[str, list[RoundRecord]]:
    """Train len(keys) replicas of `config` under `root/<key>`; each replica's round records.
    `make_sync` builds each replica's `Sync` (a benchmark's attacker replica alters its Δ there);
    `on_nodes` sees the built nodes by key before they train (a benchmark's prototype reaches in)."""
    from diloco_p2p.loop.node import Node

    if len(set(keys)) != len(keys) or not keys:
        raise ValueError("replica keys must be distinct and at least one")
    rendezvous = Rendezvous(keys, config.sync)
    nodes = {key: Node(config, root / key, make_sync(key, rendezvous), progress=False) for key in keys}
    if on_nodes is not None:
        on_nodes(nodes)
    records: dict[str, list[RoundRecord]] = {}
    errors: list[BaseException] = []

    def run(key: str) -> None:
        with rendezvous.baton, log_context(peer=key):
            try:
                records[key] = nodes[key].run()
            except BaseException as e:
                errors.append(e)
                rendezvous.fail()

    threads = [threading.Thread(target=run, args=(key,), name=f"replica-{key}") for key in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return records
