"""The swarm seen from an N-rank node: one `SwarmSync` per local rank, decisions made node-wide.

Shard r of a node (rank r's 1/N of θ, see `diloco_p2p.fsdp`) only ever averages with shard r
of the other nodes. Each rank therefore runs a complete, unmodified `SwarmSync` (its own DHT
peer and p2pd, its own identity) in the namespace ``f"{run_id}.shard{r}of{N}"``: matchmaking,
the all-reduce of its Δ shard, progress records with its shard's hash, and the state server
that hands its shard to joiners all happen per shard, so a joiner downloads shard by shard and
no rank ever holds more than its 1/N. The node's weight in every shard's average is the node's
total tokens (summed over ranks before the call), so every shard averages with the same weights.

What must be node-wide is agreed on with small collectives among the local ranks:

- **Resync.** Each rank asks its `SwarmSync` whether its shard is behind or in a minority; if
  any rank downloaded a shard, every rank downloads its own shard of the highest round any of
  them got, and the node adopts them only when every rank got that same round. Otherwise none
  adopts and the node trains on, to try again next round: θ is never a mix of two rounds.
- **The round's outcome.** Each shard commits, fails or ends alone on its own; the node
  records the worst status over its shards, the smallest group, and the bytes of all shards.
  A shard that failed while others committed leaves the node's θ in a minority for that shard;
  the resync rule above heals it at the next round, as it would for a 1-rank node.
- **Stop.** Each `SwarmSync` polls its own rank's signal flag to cut a network wait short; the
  training loop's stop check is the node-wide `NodeStop`.

Nodes with another local world size train in other namespaces and would never meet ours, so
rank 0 also keeps one node-level progress record under the plain ``run_id`` (the node's hash of
θ, its total tokens, and a config view that includes ``local_world_size``). It checks that
namespace at start and refuses to join a run whose nodes have another local world size; a
1-rank node (which reads only the plain namespace) is refused by the same record, and
``diloco-p2p status --run-id <run_id>`` lists N-rank nodes like any other.

Hooks used from `SwarmSync` (kept to its public surface except where noted): its constructor,
`before_round`/`average`/`after_round`/`close`, and, to download a shard at a given round when
another rank asked for it, its `dht`, `p2p`, `loop`, `run_id`, `resync_exclude`, `adopted` and
`_interruptible`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from diloco_p2p.config import Config
from diloco_p2p.errors import UserError
from diloco_p2p.faults import Faults
from diloco_p2p.launch import LocalRanks
from diloco_p2p.node import StopRequested, SyncOutcome

log = logging.getLogger(__name__)

# Worst last: the node's status for a round is the worst over its shards.
_SEVERITY = ("committed", "alone", "skipped", "resynced", "failed")


def shard_run_id(run_id: str, rank: int, world_size: int) -> str:
    return f"{run_id}.shard{rank}of{world_size}"


def node_swarm_view(config: Config, world_size: int) -> dict[str, Any]:
    """The fields every node of the run must share, plus the node's local world size."""
    return dict(config.swarm_view(), local_world_size=world_size)


def view_hash(view: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(view, sort_keys=True).encode()).hexdigest()


def _offset_port(maddr: str, rank: int) -> str:
    """Rank r of a node listens on the configured TCP port + r (port 0 stays 0: any port)."""
    def bump(m: re.Match) -> str:
        port = int(m.group(1))
        return f"/tcp/{port + rank}" if port else m.group(0)

    return re.sub(r"/tcp/(\d+)", bump, maddr)


def shard_config(config: Config, rank: int, world_size: int) -> Config:
    """Rank `rank`'s config for its `SwarmSync`: the shard's namespace and its own p2p identity."""
    p2p = config.p2p
    identity = f"{p2p.identity_path}.rank{rank}" if p2p.identity_path and rank else p2p.identity_path
    p2p = p2p.model_copy(update={
        "identity_path": identity,
        "host_maddrs": [_offset_port(a, rank) for a in p2p.host_maddrs],
        "announce_maddrs": [_offset_port(a, rank) for a in p2p.announce_maddrs],
    })
    return config.model_copy(update={"run_id": shard_run_id(config.run_id, rank, world_size), "p2p": p2p})


class _ShardHash:
    def __init__(self, outer: Any):
        self._outer = outer

    def params_sha256(self) -> str:
        return self._outer.shard_sha256()


class _ShardView:
    """What `SwarmSync` sees of the node: this rank's shard, with adoption deferred.

    `SwarmSync` reads round/step/tokens and the hash of θ, asks for the state to serve, and
    hands a downloaded state to `adopt_state`; here the download is only kept, so that the
    node adopts all shards together or none.
    """

    def __init__(self, node: Any, shard_config_hash: str):
        self._node = node
        self.outer = _ShardHash(node.outer)
        self.fetched: tuple[dict[str, torch.Tensor], int] | None = None
        self._config_hash = shard_config_hash

    def __getattr__(self, name: str) -> Any:
        if name in ("round", "step", "tokens", "joined_at_round", "resyncs"):
            return getattr(self._node, name)
        raise AttributeError(name)

    def adopt_state(self, tensors: dict[str, torch.Tensor], round_: int) -> None:
        self.fetched = (tensors, round_)

    def shared_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        meta = {"round": self._node.round, "params_sha256": self._node.outer.shard_sha256(),
                "config_hash": self._config_hash}
        return self._node.outer.state_tensors(), meta


class ShardSync:
    """The `Sync` of one local rank. Create it before `init_local_ranks` (hivemind forks), then
    `attach` the process group."""

    def __init__(self, config: Config, run_dir: Path, stop: StopRequested, rank: int, world_size: int,
                 faults: Faults | None = None):
        from diloco_p2p.swarm.sync import SwarmSync

        self.rank, self.world_size = rank, world_size
        self.run_id = config.run_id
        self.node_view = node_swarm_view(config, world_size)
        self.node_hash = view_hash(self.node_view)
        shard_dir = run_dir if rank == 0 else run_dir / "ranks" / str(rank)
        self.inner = SwarmSync(shard_config(config, rank, world_size), shard_dir, stop, faults)
        self.peer_id = self.inner.peer_id  # until `attach`: then rank 0's, the node's identity
        self.ranks: LocalRanks | None = None
        self._node: Any = None
        self._node_record: dict[str, Any] = {}
        self._heartbeat = None
        if rank == 0:
            try:
                self.check_node_config()
            except BaseException:
                self.inner.close()
                raise
            self._heartbeat = self.inner.loop.submit(self._publish_node_forever())

    def attach(self, ranks: LocalRanks) -> None:
        self.ranks = ranks
        self.peer_id = ranks.broadcast_str(self.inner.peer_id)

    # -- admission: the plain run id holds one record per node -----------------------------------

    def check_node_config(self) -> None:
        """Refuse a run whose nodes have another local world size (or another config)."""
        from diloco_p2p.swarm.records import check_config, majority, read_progress_async

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

    # -- the three calls of the loop ----------------------------------------------------------------

    def before_round(self, node: Any) -> dict[str, Any] | None:
        assert self.ranks is not None, "attach() the local ranks first"
        self._node = node
        view = _ShardView(node, self.inner.config_hash)
        self.inner.before_round(view)  # looks at our shard's namespace; may download our shard
        mine = view.fetched[1] if view.fetched else -1
        target = int(self.ranks.all_reduce([mine], "max")[0])
        if target < 0:
            return None  # no shard is behind: the usual case
        if mine != target:  # another shard of ours is behind the swarm: follow it to its round
            view.fetched = self._fetch(target)
        got = view.fetched[1] if view.fetched else -1
        low, neg_high = self.ranks.all_reduce([got, -got], "min")
        if low < 0 or low != -neg_high:
            log.warning("resync to round %d abandoned: not every shard of this node could download it", target)
            return None
        dropped = node.round
        node.adopt_state(*view.fetched)  # every rank its own shard, of the same round
        return {"status": "resynced", "group_size": 0, "average": None,
                "extra": {"dropped_round": dropped, "resyncs": node.resyncs, "joined_at_round": node.joined_at_round,
                          "shards": self.world_size}}

    def _fetch(self, round_: int) -> tuple[dict[str, torch.Tensor], int] | None:
        from diloco_p2p.swarm.state_sharing import StateUnavailable, fetch_state, unpack_state
        from diloco_p2p.swarm.sync import Interrupted

        timeout = self.inner.cfg.state_timeout
        try:
            fetched = self.inner._interruptible(
                fetch_state(self.inner.dht, self.inner.p2p, run_id=self.inner.run_id, min_round=round_,
                            exclude=self.inner.resync_exclude, timeout=timeout), timeout=timeout + 10)
        except (StateUnavailable, TimeoutError, Interrupted) as e:
            log.warning("could not download our shard at round %d (%s)", round_, e)
            return None
        tensors, meta = unpack_state(fetched.blob)
        self.inner.adopted(meta)
        return tensors, int(meta["round"])

    def average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> SyncOutcome:
        """Average our Δ shard with the same shard of the other nodes; report the node's outcome."""
        assert self.ranks is not None and self._node is not None
        out = self.inner.average(round, delta, weight, self._node.outer.shard_sha256())
        severity = _SEVERITY.index(out.status) if out.status in _SEVERITY else len(_SEVERITY) - 1
        worst, neg_group, seconds = self.ranks.all_reduce([severity, -out.group_size, out.allreduce_seconds], "max")
        sent, received, committed = self.ranks.all_reduce(
            [out.bytes_sent, out.bytes_received, float(out.status == "committed")], "sum")
        return SyncOutcome(
            average=out.average, status=_SEVERITY[int(worst)], group_size=int(-neg_group),
            allreduce_seconds=seconds, bytes_sent=int(sent), bytes_received=int(received),
            extra=dict(out.extra, shards=self.world_size, shards_committed=int(committed)),
        )

    def announce(self, node: Any) -> None:
        self.inner.announce(_ShardView(node, self.inner.config_hash))

    def after_round(self, node: Any, record: dict[str, Any]) -> None:
        self.inner.after_round(_ShardView(node, self.inner.config_hash), record)
        if self.rank == 0:
            self._node_record = dict(
                peer_id=self.peer_id, round=node.round, step=node.step, tokens=node.tokens,
                tokens_per_s=record.get("tokens_per_s") or 0.0, params_sha256=record["params_sha256"],
                config_hash=self.node_hash, config_view=self.node_view, status=record.get("status", "started"),
                train_loss=record.get("train_loss"), eval_loss=record.get("eval_loss"),
                group_size=record.get("group_size", 0), joined_at_round=node.joined_at_round or 0,
                resyncs=node.resyncs,
            )
            self.inner.loop.run(self._publish_node(), timeout=30)

    async def _publish_node(self) -> None:
        from diloco_p2p.swarm.records import ProgressRecord, publish_progress_async
        from diloco_p2p.swarm.sync import PROGRESS_TTL

        if self._node_record:
            record = ProgressRecord.build(**dict(self._node_record, updated=None))
            await publish_progress_async(self.inner.dht, self.run_id, record, ttl=PROGRESS_TTL)

    async def _publish_node_forever(self) -> None:
        from diloco_p2p.swarm.sync import PROGRESS_TTL

        while True:
            await asyncio.sleep(PROGRESS_TTL / 4)
            await self._publish_node()

    def dht_peers(self) -> int:
        return self.inner.dht_peers()

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            try:
                from diloco_p2p.swarm.records import withdraw_progress_async

                self.inner.loop.run(withdraw_progress_async(self.inner.dht, self.run_id, self.peer_id), timeout=10)
            except Exception as e:  # shutting down: report, do not mask the exit
                log.warning("could not withdraw the node's progress record: %s", e)
        self.inner.close()
