"""The swarm seen from an N-rank node: one `SwarmSync` per local rank, decisions made node-wide.

Shard r of a node (rank r's 1/N of θ) only ever averages with shard r of the other nodes, so each
rank runs a complete `SwarmSync` in the namespace ``f"{run_id}.shard{r}of{N}"``, and no rank
holds more than its 1/N. Small collectives among the ranks make node-wide the resync (all ranks
adopt the same round or none does), the round's outcome (the worst over the shards), the stop,
and under `sync.overlap` the outcome taken on the loop's thread. Rank 0 keeps a node-level record
under the plain run id, so a node of another local world size is refused at start.
How a node of N ranks trains: docs/architecture.md, "FSDP inside a node".
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from diloco_p2p.config import Config, P2PConfig
from diloco_p2p.config.schedule import rounds
from diloco_p2p.contract import (
    Background,
    InFlight,
    NodeState,
    RoundOutcome,
    RoundRecord,
    StopRequested,
    SwarmState,
    view_hash,
)
from diloco_p2p.errors import UserError
from diloco_p2p.faults import Faults
from diloco_p2p.local.ranks import Ranks
from diloco_p2p.swarm.membership.records import (
    ProgressPublisher,
    progress_fields,
    read_progress_async,
    withdraw_progress_async,
)
from diloco_p2p.swarm.membership.resync import check_config, majority
from diloco_p2p.swarm.sync import SwarmSync

log = logging.getLogger(__name__)

# Worst last: the node's status for a round is the worst over its shards.
_SEVERITY = ("committed", "alone", "skipped", "resynced", "failed")


def shard_run_id(run_id: str, rank: int, world_size: int) -> str:
    return f"{run_id}.shard{rank}of{world_size}"


def node_swarm_view(config: Config, world_size: int) -> dict[str, Any]:
    """The fields every node of the run must share, plus the node's local world size."""
    return dict(config.swarm_view(), local_world_size=world_size)


def _offset_port(maddr: str, rank: int) -> str:
    """Rank r of a node listens on the configured TCP port + r (port 0 stays 0: any port)."""
    def bump(m: re.Match) -> str:
        port = int(m.group(1))
        return f"/tcp/{port + rank}" if port else m.group(0)

    return re.sub(r"/tcp/(\d+)", bump, maddr)


def rank_p2p(p2p: P2PConfig, rank: int) -> P2PConfig:
    """Rank `rank`'s own p2p endpoint: its identity file and its listen/announce ports."""
    identity = f"{p2p.identity_path}.rank{rank}" if p2p.identity_path and rank else p2p.identity_path
    return p2p.model_copy(update={
        "identity_path": identity,
        "host_maddrs": [_offset_port(a, rank) for a in p2p.host_maddrs],
        "announce_maddrs": [_offset_port(a, rank) for a in p2p.announce_maddrs],
    })


class ShardSync:
    """The `Sync` of one local rank. Create it before `Ranks.from_env` (hivemind forks), then
    `attach` the ranks."""

    def __init__(self, config: Config, run_dir: Path, stop: StopRequested, rank: int, world_size: int,
                 faults: Faults | None = None):
        self.rank, self.world_size, self.run_id = rank, world_size, config.run_id
        self.node_view = node_swarm_view(config, world_size)
        self.node_hash = view_hash(self.node_view)
        namespace = shard_run_id(config.run_id, rank, world_size)
        self.inner = SwarmSync(config.sync, rank_p2p(config.p2p, rank), run_id=namespace,
                               swarm_view=dict(config.swarm_view(), run_id=namespace),
                               run_dir=run_dir if rank == 0 else run_dir / "ranks" / str(rank), stop=stop,
                               faults=faults, max_round=rounds(config.outer, config.train.max_rounds))
        self.peer_id = self.inner.peer_id  # until `attach`: then rank 0's, the node's identity
        self.speeds: dict[str, float] | None = None  # shards may measure differently: no DyLU on N ranks
        self.reachability = self.inner.reachability
        self.ranks: Ranks | None = None
        self.node_progress: ProgressPublisher | None = None
        if rank == 0:
            try:
                self.check_node_config()
            except BaseException:
                self.inner.close()
                raise
            self.node_progress = ProgressPublisher(self.inner.dht, self.inner.loop, self.run_id)

    def attach(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.peer_id = ranks.broadcast_str(self.inner.peer_id)

    # -- admission: the plain run id holds one record per node -----------------------------------

    def check_node_config(self) -> None:
        """Refuse a run whose nodes have another local world size (or another config)."""
        found = self.inner.loop.run(read_progress_async(self.inner.dht, self.run_id), timeout=30)
        others = {peer: r for peer, r in found.items() if peer != self.inner.peer_id}
        if not others:
            return
        swarm_hash = majority(r.config_hash for r in others.values())
        view = next(r.view() for r in others.values() if r.config_hash == swarm_hash)
        theirs = view.get("local_world_size", 1)
        if theirs != self.world_size:
            raise UserError(
                f"the nodes of run {self.run_id!r} have {theirs} local rank(s) each and this node has "
                f"{self.world_size}; shards only average with the same shard of nodes of the same size, so "
                f"start this node with --nproc-per-node {theirs}"
            )
        check_config(others, self.node_view, self.node_hash, self.inner.peer_id)

    # -- the calls of the loop ----------------------------------------------------------------------

    def announce(self, node: NodeState) -> None:
        self.inner.announce(node)

    def before_round(self, node: NodeState) -> SwarmState | None:
        assert self.ranks is not None, "attach() the local ranks first"
        mine = self.inner.before_round(node)  # looks at our shard's namespace; may download our shard
        target = int(self.ranks.all_reduce([mine.round if mine else -1], "max")[0])
        if target < 0:
            return None  # no shard is behind: the usual case
        if mine is None or mine.round != target:  # another shard of ours is behind: follow it to its round
            mine = self.inner.fetch(target)
        got = mine.round if mine else -1
        low, neg_high = self.ranks.all_reduce([got, -got], "min")
        if mine is None or low < 0 or low != -neg_high:
            log.warning("resync to round %d abandoned: not every shard of this node could download it", target)
            return None
        mine.outcome.shards = self.world_size
        return mine  # every rank its own shard, of the same round

    def average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> RoundOutcome:
        """Average our Δ shard with the same shard of the other nodes; report the node's outcome.
        `params_hash` is our shard's hash of θ (the node passes `NodeState.shard_sha256`)."""
        return self._node_outcome(self.inner.average(round, delta, weight, params_hash))

    def average_moments(self, round: int, moments: torch.Tensor, weight: float) -> RoundOutcome:
        """sync.average_moments: our shards' moments with the same shard of the round's group (each
        rank keeps its own if its exchange does not complete: θ does not depend on them)."""
        return self.inner.average_moments(round, moments, weight)

    def begin_average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> InFlight:
        """sync.overlap: `average` with the shard's part in a background thread and the node-wide
        part on the loop's thread, when it takes the result (`InFlight.node_result`)."""
        return Background(self.inner.average, round, delta.clone(), weight, params_hash, self._node_outcome)

    def _node_outcome(self, out: RoundOutcome) -> RoundOutcome:
        """The node's outcome from our shard's: worst status, smallest group, all shards' bytes
        (collectives: every rank calls it at the same point of the loop, on the loop's thread)."""
        assert self.ranks is not None
        severity = _SEVERITY.index(out.status) if out.status in _SEVERITY else len(_SEVERITY) - 1
        worst, neg_group, seconds = self.ranks.all_reduce([severity, -out.group_size, out.allreduce_seconds], "max")
        sent, received, committed = self.ranks.all_reduce(
            [out.bytes_sent, out.bytes_received, float(out.status == "committed")], "sum")
        out.status, out.group_size, out.allreduce_seconds = _SEVERITY[int(worst)], int(-neg_group), seconds
        out.bytes_sent, out.bytes_received = int(sent), int(received)
        out.shards, out.shards_committed = self.world_size, int(committed)
        return out

    def after_round(self, node: NodeState, record: RoundRecord) -> None:
        self.inner.after_round(node, record)
        if self.node_progress is not None:
            self.node_progress.publish(progress_fields(node, record, peer_id=self.peer_id,
                                                       params_sha256=node.params_sha256, config_hash=self.node_hash,
                                                       config_view=self.node_view))

    def dht_peers(self) -> int:
        return self.inner.dht_peers()

    def close(self) -> None:
        if self.node_progress is not None:
            self.node_progress.stop_refreshing()
            try:
                self.inner.loop.run(withdraw_progress_async(self.inner.dht, self.run_id, self.peer_id), timeout=10)
            except Exception as e:  # shutting down: report, do not mask the exit
                log.warning("could not withdraw the node's progress record: %s", e)
        self.inner.close()
