"""The swarm seen from the training loop: one object that averages a pseudo-gradient per round.

`SwarmSync` composes hivemind's DHT with our own pieces on its P2P transport: matchmaking
(`matchmaking.py`), the all-reduce (`allreduce.py`), state sharing (`state_sharing.py`) and
progress records (`records.py`). The loop calls three methods:

- `before_round`: compare our (round, params hash) with the swarm's progress records. A node
  that is behind (it stalled, crashed, or just joined) or that holds a minority θ for its
  round (it ended a round alone while others averaged) downloads the swarm's state instead
  of averaging stale parameters. Its own progress since is dropped (`status: resynced`).
  The majority rule (ties to the smallest hash) is the same on every node, so a fork heals
  deterministically: the smaller side adopts the larger side's state.
- `average`: form a group of the nodes at the same round with the same θ, all-reduce Δ,
  and hand back the average; a round with no group follows `sync.alone_policy`.
- `after_round`: publish the progress record and serve the new state to joiners.

Network faults are data: each round ends committed / alone / failed / resynced, never with
an exception out of the loop.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from diloco_p2p import __version__
from diloco_p2p.config import Config
from diloco_p2p.faults import Faults
from diloco_p2p.node import Node, StopRequested, SyncOutcome
from diloco_p2p.swarm.allreduce import AllreduceService
from diloco_p2p.swarm.dht import dht_peer_count, start_dht
from diloco_p2p.swarm.matchmaking import Matchmaker
from diloco_p2p.swarm.records import (
    ProgressRecord,
    check_config,
    progress_validator,
    publish_progress_async,
    read_progress_async,
    reference_records,
    resync_target,
    withdraw_progress_async,
)
from diloco_p2p.swarm.runner import BackgroundLoop
from diloco_p2p.swarm.state_sharing import (
    StateServer,
    StateUnavailable,
    fetch_state,
    pack_state,
    state_validator,
    unpack_state,
)

log = logging.getLogger(__name__)

PROGRESS_TTL = 60.0
SAVE_DELTAS_ENV = "DILOCO_P2P_SAVE_DELTAS"


class Interrupted(Exception):
    """A swarm call was cut short by a stop request or its own deadline."""


class SwarmSync:
    def __init__(self, config: Config, run_dir: Path, stop: StopRequested, faults: Faults | None = None):
        self.config, self.cfg, self.stop = config, config.sync, stop
        self.run_id = config.run_id
        self.faults = faults or Faults()
        identity = Path(config.p2p.identity_path) if config.p2p.identity_path else run_dir / "identity.key"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        # Test mode: keep each round's Δ and average so a test can recompute the mean itself.
        self.save_deltas = os.environ.get(SAVE_DELTAS_ENV) == "1"
        self.swarm_view = config.swarm_view()
        self.config_hash = config.swarm_hash()
        self.last_record: dict[str, Any] = {}
        self.agreement: dict[str, bool] = {}
        # The last round our θ came out of a group, directly or via a resync (`reference_records`).
        self.averaged_round: int | None = None
        self._adopted_averaged_round: int | None = None
        self.resync_exclude: frozenset[str] = frozenset()  # peers whose state is not the swarm's
        # hivemind forks the DHT process: create it before any thread of ours.
        validators = [progress_validator(self.run_id), state_validator(self.run_id)]
        self.dht = start_dht(config.p2p, identity, record_validators=validators)
        self.loop = BackgroundLoop()
        self._heartbeat = None
        try:
            self.p2p = self.loop.run(self.dht.replicate_p2p())
            self.peer_id = self.p2p.peer_id.to_base58()
            self.matchmaker = Matchmaker(self.dht, self.p2p, run_id=self.run_id)
            self.allreduce = AllreduceService(self.p2p, prefix=self.run_id)
            self.state_server = StateServer(self.dht, self.p2p, run_id=self.run_id)
            self.loop.run(self._start())
            self.check_config()  # a refused node leaves before it ever published anything
            self._heartbeat = self.loop.submit(self._publish_forever())
        except BaseException:
            self.close()
            raise

    async def _start(self) -> None:
        await self.matchmaker.start()
        await self.allreduce.start()
        await self.state_server.start()

    # -- admission -----------------------------------------------------------------------------

    def records(self) -> dict[str, ProgressRecord]:
        found = self.loop.run(read_progress_async(self.dht, self.run_id), timeout=30)
        return {peer: r for peer, r in found.items() if peer != self.peer_id}

    def check_config(self) -> None:
        """Refuse to join a swarm whose config differs from ours (raises UserError listing fields)."""
        check_config(self.records(), self.swarm_view, self.config_hash, self.peer_id)

    # -- the three calls of the loop -----------------------------------------------------------

    def before_round(self, node: Node) -> dict[str, Any] | None:
        """Catch up with the swarm if we are behind, hold a minority θ or were cut off from the
        averaging nodes (`resync_target`); returns the round's outcome then."""
        others = self.records()
        ours = node.outer.params_sha256()
        reference = reference_records(others)  # the nodes that speak for the swarm's state
        self.resync_exclude = frozenset(others) - frozenset(reference)
        # For the round's record: do those at our round hold our θ, and every node our config?
        same_round = [r.params_sha256 for r in reference.values() if r.round == node.round]
        self.agreement = {"params_agree": all(h == ours for h in same_round),
                          "config_agree": all(r.config_hash == self.config_hash for r in others.values())}
        target = resync_target(others, node.round, ours, self.averaged_round)
        if target is None:
            return None
        log.warning("%s; downloading the swarm's state", target.reason)
        start = time.perf_counter()
        # What we serve is stale from now on: a joiner must not download it while we catch up.
        self.loop.run(self.state_server.withdraw(), timeout=15)
        try:
            fetched = self._interruptible(
                fetch_state(self.dht, self.p2p, run_id=self.run_id, min_round=target.min_round,
                            exclude=target.exclude, timeout=self.cfg.state_timeout),
                timeout=self.cfg.state_timeout + 10,
            )
        except (StateUnavailable, TimeoutError, Interrupted) as e:
            log.warning("could not download the swarm's state (%s); training on from our own", e)
            return None
        tensors, meta = unpack_state(fetched.blob)
        dropped = node.round
        node.adopt_state(tensors, int(meta["round"]))
        self.adopted(meta)
        return {
            "status": "resynced", "group_size": 0, "average": None,
            "extra": {"state_bytes": fetched.bytes, "state_seconds": time.perf_counter() - start,
                      "donor": fetched.donor, "dropped_round": dropped, "resyncs": node.resyncs,
                      "joined_at_round": node.joined_at_round, **self.agreement},
        }

    def adopted(self, meta: dict[str, Any]) -> None:
        """We took a downloaded state: our θ's averaging history is now the donor's."""
        value = meta.get("averaged_round")
        self._adopted_averaged_round = value if isinstance(value, int) and value >= 0 else None

    def average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> SyncOutcome:
        self.faults.fire("delta", round)
        delta = self.faults.poison("delta", round, delta)
        try:
            group = self._interruptible(
                self.matchmaker.form_group(round, params_hash, weight, min_group_size=self.cfg.min_group_size,
                                           target_group_size=self.cfg.target_group_size,
                                           timeout=self.cfg.matchmaking_timeout),
                timeout=self.cfg.matchmaking_timeout + 30,
            )
            if group is None:
                log.info("round %d: no group (%s); ending the round alone", round, self.matchmaker.last_outcome)
                return self._alone(delta, "alone", 1)
            self.faults.fire("group", round)
            result = self._interruptible(
                self.allreduce.allreduce(group.group_id, group.peers, delta, weight,
                                         compression=self.cfg.compression, timeout=self.cfg.allreduce_timeout,
                                         max_weight_ratio=self.cfg.max_weight_ratio,
                                         on_scattered=lambda: self.faults.fire("allreduce", round)),
                timeout=self.cfg.allreduce_timeout + 30,
            )
        except Interrupted as e:
            log.warning("round %d: averaging interrupted (%s)", round, e)
            return self._alone(delta, "failed", 1)
        extra = {**self.agreement, "contributors": len(result.contributors), "rejected": result.rejected,
                 "parts_committed": len(result.committed_parts), "parts": result.num_parts,
                 "dropped_peers": len(group.peers) - len(result.contributors)}
        if result.status == "failed":
            outcome = self._alone(delta, "failed", len(group.peers))
        else:
            outcome = SyncOutcome(average=result.average, status="committed", group_size=len(group.peers))
        if self.save_deltas:
            self._save_delta(round, delta, weight, result)
        outcome.allreduce_seconds = result.seconds
        outcome.bytes_sent, outcome.bytes_received = result.bytes_sent, result.bytes_received
        outcome.extra.update(extra)
        return outcome

    def _save_delta(self, round: int, delta: torch.Tensor, weight: float, result: Any) -> None:
        from safetensors.torch import save_file

        (self.run_dir / "deltas").mkdir(exist_ok=True)
        meta = {"weight": repr(weight), "contributors": json.dumps(result.contributors),
                "committed_parts": json.dumps(result.committed_parts), "num_parts": str(result.num_parts)}
        save_file({"delta": delta.contiguous(), "average": result.average.contiguous()},
                  str(self.run_dir / "deltas" / f"round-{round:06d}.safetensors"), metadata=meta)

    def _interruptible(self, coro, timeout: float):
        """Run `coro` on our loop; a stop request cancels it within a fraction of a second."""
        future = self.loop.submit(coro)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                if self.stop.requested or time.monotonic() > deadline:
                    future.cancel()
                    raise Interrupted("stop requested" if self.stop.requested else "timed out") from None

    def _alone(self, delta: torch.Tensor, status: str, group_size: int) -> SyncOutcome:
        average = delta if self.cfg.alone_policy == "apply" and torch.isfinite(delta).all() else None
        return SyncOutcome(average=average, status=status, group_size=group_size, extra=dict(self.agreement))

    def dht_peers(self) -> int:
        """DHT peers this node knows (its routing table), for the node's metrics."""
        return dht_peer_count(self.dht)

    def announce(self, node: Node) -> None:
        """Publish a `started` record as soon as the node is built: the swarm (and `status`)
        sees us before our first round ends, and a node with another config is refused at once."""
        self.last_record = self._progress(node, {"status": "started"})
        self.loop.run(publish_progress_async(self.dht, self.run_id, ProgressRecord.build(**self.last_record),
                                             ttl=PROGRESS_TTL), timeout=30)

    def after_round(self, node: Node, record: dict[str, Any]) -> None:
        if record.get("status") == "committed":
            self.averaged_round = node.round
        elif record.get("status") == "resynced":
            self.averaged_round = self._adopted_averaged_round
        self.last_record = self._progress(node, record)
        self.loop.run(publish_progress_async(self.dht, self.run_id, ProgressRecord.build(**self.last_record),
                                             ttl=PROGRESS_TTL), timeout=30)
        tensors, meta = node.shared_state()
        meta = dict(meta, averaged_round=self.averaged_round)
        self.loop.run(self.state_server.set_state(node.round, pack_state(tensors, meta), meta["params_sha256"]),
                      timeout=60)

    def _progress(self, node: Node, record: dict[str, Any]) -> dict[str, Any]:
        return dict(
            peer_id=self.peer_id, round=node.round, step=node.step, tokens=node.tokens,
            tokens_per_s=record.get("tokens_per_s") or 0.0, params_sha256=node.outer.params_sha256(),
            config_hash=self.config_hash, config_view=self.swarm_view,
            status=record.get("status", "started"), train_loss=record.get("train_loss"),
            eval_loss=record.get("eval_loss"), group_size=record.get("group_size", 0),
            joined_at_round=node.joined_at_round or 0, resyncs=node.resyncs, averaged_round=self.averaged_round,
            version=__version__,
        )

    async def _publish_forever(self) -> None:
        """Refresh our progress record while a long round runs, so we do not look gone."""
        import asyncio

        while True:
            await asyncio.sleep(PROGRESS_TTL / 4)
            if self.last_record:
                record = ProgressRecord.build(**dict(self.last_record, updated=None))
                await publish_progress_async(self.dht, self.run_id, record, ttl=PROGRESS_TTL)

    def close(self) -> None:
        """Withdraw our records and stop serving; bounded so a shutdown never hangs."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        try:
            self.loop.run(self._stop(), timeout=10)
        except Exception as e:  # shutting down: report, do not mask the exit
            log.warning("swarm shutdown was not clean: %s", e)
        self.loop.close()
        self.dht.shutdown()

    async def _stop(self) -> None:
        """Undo `__init__` as far as it got."""
        if hasattr(self, "peer_id"):
            await withdraw_progress_async(self.dht, self.run_id, self.peer_id)
        for service in ("state_server", "allreduce", "matchmaker"):
            if hasattr(self, service):
                await getattr(self, service).stop()
        if hasattr(self, "p2p"):
            await self.p2p.shutdown()  # our replica only: the DHT process owns the daemon
