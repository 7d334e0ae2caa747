"""The swarm seen from the training loop: one object that averages a pseudo-gradient per round.

`SwarmSync` composes hivemind's DHT with our own pieces on its P2P transport: matchmaking, the
all-reduce, state sharing, progress records and the resync policy. It sees the node only as a
`NodeState` (`diloco_p2p.contract`) and hands back data; the loop calls `announce` (a node with
another config is refused here), `before_round` (a node behind or in a minority gets the
swarm's verified state to adopt), `average` (the round's one group all-reduces Δ; a round with
no group follows `sync.alone_policy`) and `after_round` (publish the record, serve the state).
Network faults are data: each round ends committed, alone, failed or resynced.
One round through the layers: docs/architecture.md
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from hivemind.utils import get_dht_time

from diloco_p2p.config import P2PConfig, SyncConfig
from diloco_p2p.contract import NodeState, RoundOutcome, RoundRecord, StopRequested, SwarmState, view_hash
from diloco_p2p.faults import Faults
from diloco_p2p.logs import short_peer
from diloco_p2p.swarm.collective import hierarchy
from diloco_p2p.swarm.collective.aggregate import robust_of
from diloco_p2p.swarm.collective.allreduce import AllreduceService
from diloco_p2p.swarm.collective.allreduce_state import AllreduceResult
from diloco_p2p.swarm.collective.outcome import blame, kept, round_outcome
from diloco_p2p.swarm.datashare import DataShare
from diloco_p2p.swarm.membership import liveness, resync
from diloco_p2p.swarm.membership.grouping import LATE
from diloco_p2p.swarm.membership.liveness import AdaptiveDeadline, Presence, verdicts, waited_for
from diloco_p2p.swarm.membership.matchmaking import Matchmaker
from diloco_p2p.swarm.membership.records import (
    PROGRESS_REFRESH,
    ProgressPublisher,
    ProgressRecord,
    progress_fields,
    progress_validator,
    read_progress_async,
    withdraw_progress_async,
)
from diloco_p2p.swarm.membership.resync import check_config, reference_records, resync_target
from diloco_p2p.swarm.membership.standing import witness_validator
from diloco_p2p.swarm.state.announcements import StateAnnouncement, state_validator
from diloco_p2p.swarm.state.client import StateUnavailable, fetch_state
from diloco_p2p.swarm.state.codec import THETA, Layout, StateCheck, pack_state, state_sha256
from diloco_p2p.swarm.state.server import StateServer
from diloco_p2p.swarm.transport.dht import dht_peer_count, start_dht, validate_maddrs
from diloco_p2p.swarm.transport.reach import PRIVATE, ReachServer, log_shortage, resolve
from diloco_p2p.swarm.transport.runner import BackgroundLoop
from diloco_p2p.swarm.trust.admission import Admission
from diloco_p2p.swarm.trust.guard import Guard
from diloco_p2p.swarm.vouching import RECORDS_TIMEOUT, VOUCH_WAIT, Vouching, layout_of

log = logging.getLogger(__name__)

STALE_AFTER = 2 * PROGRESS_REFRESH + 5.0  # a record older than this is a node that stopped heart-beating


class Interrupted(Exception):
    """A swarm call was cut short by a stop request or its own deadline."""


class SwarmSync:
    """One swarm endpoint: a DHT peer with its p2pd, in the DHT namespace `run_id`.

    A node of one rank has one, in its run's namespace; each rank of an N-rank node has its own,
    in its shard's namespace (`diloco_p2p.swarm.multirank`). `swarm_view` is what every node of
    the namespace must share (`Config.swarm_view()`): a node whose view differs is refused.
    """

    def __init__(self, cfg: SyncConfig, p2p: P2PConfig, *, run_id: str, swarm_view: dict[str, Any], run_dir: Path,
                 stop: StopRequested, faults: Faults | None = None, max_round: int | None = None):
        self.cfg, self.stop, self.run_id, self.run_dir = cfg, stop, run_id, run_dir
        self.max_round = max_round  # train.max_rounds: no state past it is ever adopted
        self.guard = Guard()  # every refusal of a peer: logged, counted, in the round record
        self.faults = faults or Faults()
        self.swarm_view, self.config_hash = swarm_view, view_hash(swarm_view)
        self.agreement: dict[str, bool] = {}
        # Dynamic local updates: each member's tokens per second of compute in our last group
        # (None: no group), measured from the end of `before_round` to `average`.
        self.speeds: dict[str, float] | None = None
        self._computing_since: float | None = None
        # The last round our θ came out of a group, directly or via a resync (`reference_records`).
        self.averaged_round: int | None = None
        self._adopted_averaged_round: int | None = None
        self.resync_exclude: frozenset[str] = frozenset()  # peers whose state is not the swarm's
        self.last_group: resync.LastGroup | None = None  # whom we last committed a round with (breaks a tie)
        # (round, members whose masks we heard) of our last all-reduce: they finished that round with us
        self._grouped: tuple[int, frozenset[str]] = (-1, frozenset())
        # whom this round's matchmaking waits for; (round, those it did without) of our last committed one
        self._expected, self._missing = frozenset[str](), (-1, frozenset[str]())
        self._late = -1  # the last round we ended alone because its group had formed without us
        self._committed: tuple[int, Any] | None = None  # (round, group) of our last committed all-reduce
        self.donor: str | None = None  # whose state we adopted, until we next commit a round (a tie: follow it)
        self._layout: Layout | None = None  # what a state of our model may hold (`codec.Layout`), from our own
        self._state_hash: str | None = None  # the whole state we serve, hashed (`codec.state_sha256`)
        # The seeds we bootstrapped from: their witness lists the peers a newcomer trusts (`standing`).
        self._witnesses = {a.rsplit("/p2p/", 1)[1] for a in validate_maddrs(p2p.initial_peers, "p2p.initial_peers")
                           if "/p2p/" in a}
        # Who a round waits for and how long (`liveness`): the configured timeouts are the upper bounds.
        self.presence = Presence()
        self.group_deadline = AdaptiveDeadline(ceiling=cfg.matchmaking_timeout, floor=1.5)
        # An all-reduce that runs out of time fails for the whole group: a wider margin than matchmaking's.
        self.allreduce_deadline = AdaptiveDeadline(ceiling=cfg.allreduce_timeout, floor=5.0, slack=2.0, k=6.0,
                                                   spread=0.5)
        self._lag = 0 if cfg.overlap == "none" else 1  # under overlap a record trails by the round in flight
        self._liveness: dict[str, object] = {}  # this round's liveness numbers, for its outcome
        run_dir.mkdir(parents=True, exist_ok=True)
        identity = Path(p2p.identity_path) if p2p.identity_path else run_dir / "identity.key"
        # Behind NAT (nobody can dial us) we join the DHT as a client and reduce no all-reduce part.
        self.reachability, why = resolve(p2p)
        self.public = self.reachability != PRIVATE
        self._shortage: str | None = None
        # hivemind forks the DHT process: create it before any thread of ours.
        validators = [progress_validator(run_id), state_validator(run_id), witness_validator(run_id)]
        self.dht = start_dht(p2p, identity, client_mode=not self.public, record_validators=validators)
        log.info("reachability: %s (%s)%s", self.reachability, why, "" if self.public else
                 "; averaging through public peers over our own connections, serving no part and no state")
        self.loop = BackgroundLoop()
        self.progress: ProgressPublisher | None = None
        try:
            self.p2p = self.loop.run(self.dht.replicate_p2p())
            self.peer_id = self.p2p.peer_id.to_base58()
            # What the records vouch for, and whose records may move us (`membership.standing`).
            self.vouching = Vouching(self._read_records, self.peer_id, self.dht, run_id, cfg.resync_quorum,
                                     max_round, self._witnesses)
            self.admission = Admission(cfg.admission, run_id, self.peer_id, self.guard, refresh=self._read_records)
            self.matchmaker = Matchmaker(self.dht, self.p2p, run_id=run_id, public=self.public)
            self.reach = ReachServer(self.p2p) if self.public else None  # dial-back probes of joiners
            # A reducer that lies, only when the fault tests plan it (`diloco_p2p.faults`).
            service = self.faults.reducer(AllreduceService)
            pace = cfg.link_mbit * 1e6 / 8 * cfg.pace if cfg.link_mbit and cfg.pace else None  # bytes/s
            self.allreduce = service(self.p2p, prefix=run_id, pace_bytes=pace)
            self.state_server = StateServer(self.dht, self.p2p, run_id=run_id)
            self.datashare = DataShare(self.dht, self.p2p, self.loop)  # the corpus's shards (`datashare`)
            for service in (self.matchmaker, self.allreduce, self.state_server, self.datashare):
                service.admit = self.admission.check_stream  # a closed run serves its members only
            self.datashare.admitted = self.admission.admits  # ...and fetches from its members only
            self.matchmaker.distrusted = self.guard.distrusted  # caught reducers: out of our groups
            self.loop.run(self._start())
            self.check_config()  # a refused node leaves before it ever published anything
            self.progress = ProgressPublisher(self.dht, self.loop, run_id)
        except BaseException:
            self.close()
            raise

    async def _start(self) -> None:
        await self.matchmaker.start()
        await self.allreduce.start()
        await self.state_server.start()
        await self.datashare.start()
        if self.reach is not None:
            await self.reach.start()

    # -- admission -----------------------------------------------------------------------------

    async def _read_records(self) -> dict[str, ProgressRecord]:
        """The run's records that count: signed by their peer (forgeries are refused on the way)
        and, in a closed run, of admitted peers (tokens in the records admit their peers)."""
        found = await read_progress_async(self.dht, self.run_id, on_reject=self.guard.reject)
        self.admission.learn((peer, r.admission_token) for peer, r in found.items())
        admitted = self.admission.filter(found, "a progress record")
        return {peer: r for peer, r in found.items() if peer in admitted}

    def records(self) -> dict[str, ProgressRecord]:
        found = self.loop.run(self._read_records(), timeout=30)
        return {peer: r for peer, r in found.items() if peer != self.peer_id}

    def check_config(self) -> None:
        """Refuse to join a swarm whose config differs from ours (raises UserError listing fields)."""
        check_config(self.records(), self.swarm_view, self.config_hash, self.peer_id)

    # -- the calls of the loop -----------------------------------------------------------------

    def announce(self, node: NodeState) -> None:
        """Publish a `started` record as soon as the node is built: the swarm (and `status`)
        sees us before our first round ends, and a node with another config is refused at once."""
        self._publish(node, None)
        self.faults.start_gate()

    def before_round(self, node: NodeState) -> SwarmState | None:
        """The swarm's state if we are behind, hold a minority θ or were cut off from the
        averaging nodes (`resync_target`); None to train on from our own."""
        late, self._late = self._late == node.round, -1  # our round's group formed without us
        others = self._records_at(node.round) if late else self.records()
        ours = node.shard_sha256
        reference = reference_records(others, self.averaged_round)  # the nodes that speak for the swarm's state
        self.resync_exclude = frozenset(others) - frozenset(reference)
        # For the round's record: do those at our round hold our θ, and every node our config?
        same_round = [r.params_sha256 for r in reference.values() if r.round == node.round]
        self.agreement = {"params_agree": all(h == ours for h in same_round),
                          "config_agree": all(r.config_hash == self.config_hash for r in others.values())}
        self._layout = layout_of(node.state)
        standing = self._read_or(self.vouching.standing_among(others), self.vouching.standing.among(others))
        target = resync_target(others, node.round, ours, self.averaged_round, quorum=self.cfg.resync_quorum,
                               max_round=self.max_round, on_reject=self.guard.reject, group=self.last_group,
                               donor=self.donor, standing=standing)
        if target is None:
            self._computing_since = time.perf_counter()  # the node trains now: its speed for DyLU
            return None
        log.warning("%s; downloading the swarm's state", target.reason)
        # What we serve is stale from now on: a joiner must not download it while we catch up.
        self.loop.run(self.state_server.withdraw(), timeout=15)
        state = self.fetch(target.min_round, target.exclude, target.params_hash)
        if state is not None:
            state.behind_seconds = self._behind(state.round)
        return state

    def _records_at(self, round: int) -> dict[str, ProgressRecord]:
        """The others' records once a quorum vouches for a state at `round` or later, waiting at
        most the all-reduce's deadline: read before them, a late node would train a lone round."""
        wait = self.allreduce_deadline.current() + VOUCH_WAIT
        start = time.perf_counter()
        try:
            found = self._interruptible(self.vouching.records_at(round, wait), timeout=wait + RECORDS_TIMEOUT)
        except Interrupted:
            return self.records()
        log.info("round %d: its group formed without us; its records in %.1f s", round, time.perf_counter() - start)
        return found

    def _behind(self, round: int) -> float | None:
        """How long ago the swarm began round `round + 1`: now minus the median time its members
        published `round` (None: no record at that round, or no view of the records). Clocks of
        different machines enter here; `schedule.catch_up_steps` only shortens one round by it."""
        try:
            records = self.loop.run(self._read_records(), timeout=RECORDS_TIMEOUT)
        except Exception:  # no view of the swarm: run the round whole
            return None
        published = [r.updated for p, r in records.items() if p != self.peer_id and r.round == round]
        return max(0.0, get_dht_time() - statistics.median(published)) if published else None

    def fetch(self, min_round: int, exclude: frozenset[str] | None = None,
              params_hash: str | None = None) -> SwarmState | None:
        """Download and check the swarm's state at `min_round` or later (with `params_hash`, that θ
        or a later state the records vouch for); None if no donor served one in time. A donor that
        fails a check is refused (``bad-state``) and not asked again."""
        start = time.perf_counter()
        exclude = (self.resync_exclude if exclude is None else exclude) | self.guard.no_state_from()
        accepted: dict[tuple[int, str | None], str | None] = {}  # vouched state -> its whole-state hash
        refused: set[tuple[int, str | None]] = set()

        async def accept(ann: StateAnnouncement) -> bool:
            """Try a donor only for the target state or a later one the records vouch for, and in
            a closed run only an admitted one (the stream's peer id is the announcement's)."""
            if self.admission.refuses_donor(ann.peer_id):
                return False
            state = (ann.round, ann.params_hash)
            if params_hash is None or state in accepted:
                return True
            if ann.round > min_round and state not in refused:
                vouched, whole = await self.vouching.is_vouched(ann.round, ann.params_hash, wait=VOUCH_WAIT)
                if vouched:
                    accepted[state] = whole
                else:
                    refused.add(state)  # asked once: a state nobody vouches for does not cost us each pass
            return state in accepted

        if params_hash is not None:
            accepted[min_round, params_hash] = self._read_or(self.vouching.state_hash(min_round, params_hash), None)
        layout = self._layout
        check = StateCheck(min_round if params_hash else None, params_hash, self.max_round,
                           vouched=lambda r, h: (r, h) in accepted, layout=layout,
                           state_hash=lambda r, h: accepted.get((r, h)))
        try:
            fetched = self._interruptible(
                fetch_state(self.dht, self.p2p, run_id=self.run_id, min_round=min_round, exclude=exclude,
                            verify=check, accept=accept, timeout=self.cfg.state_timeout,
                            max_donors=self.cfg.state_donors, max_size=layout.max_size() if layout else None),
                timeout=self.cfg.state_timeout + 10,
            )
        except (StateUnavailable, TimeoutError, Interrupted) as e:
            for donor, why in getattr(e, "forged", {}).items():
                self.guard.reject(donor, "bad-state", why)
            log.warning("could not download the swarm's state (%s); training on from our own", e)
            return None
        for donor, why in fetched.forged.items():
            self.guard.reject(donor, "bad-state", why)
        tensors, meta = check.unpacked
        value = meta.get("averaged_round")  # our θ's averaging history is now the donor's
        self._adopted_averaged_round = value if isinstance(value, int) and value >= 0 else None
        outcome = RoundOutcome(status="resynced", group_size=0, state_bytes=fetched.bytes,
                               state_seconds=time.perf_counter() - start, donor=fetched.donor, **self.agreement)
        outcome.rejections = self.guard.drain()
        return SwarmState(tensors=tensors, round=int(meta["round"]), outcome=outcome)

    def average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> RoundOutcome:
        self.faults.fire("delta", round)
        delta = self.faults.poison("delta", round, delta)
        delta, weight = self.faults.lie(round, delta, weight, self.cfg.max_weight_ratio)
        self.faults.arm_reducer(self.allreduce, round)
        try:
            group = self._interruptible(self._form_group(round, params_hash, weight),
                                        timeout=self.cfg.matchmaking_timeout + 30)
            self.speeds = group.speeds if group is not None else None
            if group is None:
                self._late = round if self.matchmaker.last_outcome == LATE else -1
                log.info("round %d: no group (%s); ending the round alone", round, self.matchmaker.last_outcome)
                return self._seen(round_outcome(delta, None, 1, self.cfg.alone_policy, self.agreement))
            self.faults.fire("group", round)
            if group.wait is not None:
                self.group_deadline.observe(group.wait)
            allreduce_timeout = self.allreduce_deadline.current()
            self._liveness["allreduce_deadline"] = allreduce_timeout
            result = self._interruptible(self._average(round, group, delta, weight, allreduce_timeout),
                                         timeout=allreduce_timeout + 30)
        except Interrupted as e:
            log.warning("round %d: averaging interrupted (%s)", round, e)
            return self._seen(round_outcome(delta, None, 1, self.cfg.alone_policy, self.agreement, interrupted=True))
        self.faults.keep(self.run_dir, round, *kept(delta, weight, result))  # tests (``keep@average``)
        self._committed = (round, group) if result.status != "failed" else None  # sync.average_moments' group
        one_butterfly = len(group.peers) <= self.cfg.target_group_size  # else a grid (`hierarchy`)
        if result.status != "failed":
            peers = [p.to_base58() for p in group.peers]
            self.last_group = resync.LastGroup(self.peer_id, frozenset(peers), round)
            self.vouching.standing.committed(result.agreed_with, round)  # their bytes and ours made this round
            self._grouped = (round, frozenset(result.agreed_with))  # who finished the round with us
            self._missing = (round, liveness.seen_missing(self._expected, peers, result.agreed_with,
                                                          one_butterfly=one_butterfly, me=self.peer_id))
        sample = liveness.allreduce_sample(result.status, result.seconds, len(group.peers), result.contributors,
                                           result.agreed_with, one_butterfly=one_butterfly)
        if sample is not None:
            self.allreduce_deadline.observe(sample)
        blame(self.guard, round, result, me=self.peer_id)
        return self._seen(round_outcome(delta, result, len(group.peers), self.cfg.alone_policy, self.agreement))

    def average_moments(self, round: int, moments: torch.Tensor, weight: float) -> RoundOutcome:
        """sync.average_moments: a second all-reduce, of the inner first moments, in the group that
        just committed `round`, under the same wire and checks; its refusals of peers are its own."""
        if self._committed is None or self._committed[0] != round:
            return RoundOutcome(status="alone")
        group, moments = self._committed[1], self.faults.poison("moments", round, moments)
        moments, weight = self.faults.lie(round, moments, weight, self.cfg.max_weight_ratio, point="moments")
        timeout = self.allreduce_deadline.current()
        try:
            result = self._interruptible(self._average(round, group, moments, weight, timeout, ".moments"),
                                         timeout=timeout + 30)
        except Interrupted as e:
            log.warning("round %d: the moments' all-reduce was interrupted (%s)", round, e)
            return RoundOutcome(status="failed", rejections=self.guard.drain())
        blame(self.guard, round, result, me=self.peer_id)
        self.faults.keep(self.run_dir / "moments", round, *kept(moments, weight, result))  # tests
        outcome = round_outcome(moments, result, len(group.peers), "skip", {})
        outcome.rejections = self.guard.drain()
        return outcome

    async def _average(self, round: int, group: Any, delta: torch.Tensor, weight: float,
                       timeout: float, what: str = "") -> AllreduceResult:
        """The group's all-reduce (`what`: of another vector, under its own group id; `hierarchy`), then
        our matchmaking registration withdrawn (held back meanwhile: `Matchmaker.release`)."""
        try:
            return await hierarchy.average(
                self.allreduce, group.group_id + what, group.peers, delta, weight,
                butterfly_max=self.cfg.target_group_size, compression=self.cfg.compression, timeout=timeout,
                max_weight_ratio=self.cfg.max_weight_ratio, robust=robust_of(self.cfg), density=self.cfg.topk_density,
                public=group.public_flags(), on_scattered=lambda: self.faults.fire("allreduce", round),
            )
        finally:
            self.matchmaker.release()

    def _seen(self, outcome: RoundOutcome) -> RoundOutcome:
        """The round's refusals of peers go into its record (`diloco_p2p.swarm.trust.guard`), its
        liveness numbers (who it waited for, who is away, the deadlines: `liveness`), and the
        all-reduce's wire-time ratio when the operator declared the link (`sync.link_mbit`)."""
        for name, value in self._liveness.items():
            setattr(outcome, name, value)
        self._liveness = {}
        if self.cfg.link_mbit and outcome.bytes_sent and outcome.allreduce_seconds > 0:
            outcome.wire_ratio = outcome.allreduce_seconds / (outcome.bytes_sent * 8 / (self.cfg.link_mbit * 1e6))
        outcome.rejections = self.guard.drain()
        return outcome

    async def _form_group(self, round: int, params_hash: str, weight: float):
        """Matchmaking for `round`, expecting the live swarm (`liveness`: peers at the round,
        heart-beating and trusted), read again while we lead; a group closes once they are all
        in, or at the adaptive deadline for one that went quiet in this very round. A peer that
        missed a round is not waited for: it catches up by a state download."""
        try:
            records = await asyncio.wait_for(self._read_records(), RECORDS_TIMEOUT)
        except Exception as e:  # no view of the swarm: the group closes when full or at the timeout
            log.debug("round %d: could not read progress records (%r)", round, e)
            records = {}
        distrusted = self.guard.distrusted()  # caught reducers: not waited for, not grouped with

        members = self._grouped[1] if self._grouped[0] == round - 1 else ()  # did the last round with us
        missing = self._missing[1] if self._missing[0] == round - 1 else ()  # the last round did without

        def judge(records: dict[str, ProgressRecord]) -> dict[str, str | None]:
            others = {peer: r for peer, r in records.items() if peer != self.peer_id}
            return verdicts(others, round, get_dht_time(), stale_after=STALE_AFTER, lag=self._lag,
                            distrusted=distrusted, members=members, missing=missing)

        async def refresh() -> list[str]:  # while we lead: who started, came back or left since
            return waited_for(judge(await self._read_records()))

        found = judge(records)
        expected = waited_for(found)
        self._expected = frozenset(expected)
        if records:  # no view: no verdicts either (a DHT hiccup is not everybody leaving)
            ahead = [p for p, r in records.items() if p != self.peer_id and r.round >= round]
            for event in self.presence.update(round, found, get_dht_time(), ahead):
                log.info("%s", event.message(short_peer(event.peer) or event.peer))
        close_after = self.group_deadline.current()
        self._liveness = {"waited_for": len(expected), "away": self.presence.away(get_dht_time()) or None,
                          "matchmaking_deadline": close_after}
        self._shortage = log_shortage(records, self.peer_id, self.public, self._shortage)
        computing = time.perf_counter() - self._computing_since if self._computing_since else 0.0
        self._computing_since = None
        # One membership per round, whatever its size: the all-reduce runs in sub-groups past
        # target_group_size (`hierarchy`), so the swarm never splits into groups that fork θ.
        return await self.matchmaker.form_group(round, params_hash, weight, min_group_size=self.cfg.min_group_size,
                                                target_group_size=hierarchy.MAX_MEMBERS,
                                                timeout=self.cfg.matchmaking_timeout, expected=expected,
                                                refresh_expected=refresh, hold_withdrawal=True,
                                                speed=weight / computing if computing > 0 else 0.0,
                                                close_after=close_after)

    def _read_or(self, coro, default: Any) -> Any:
        """A DHT read of `vouching`, or `default` if it did not answer in time (bounded: no raise)."""
        try:
            return self.loop.run(coro, timeout=RECORDS_TIMEOUT + 1)
        except Exception:
            return default

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

    def after_round(self, node: NodeState, record: RoundRecord) -> None:
        """Serve the new state to joiners and publish our progress record."""
        if record.status == "committed":
            self.averaged_round, self.donor = node.round, None
        elif record.status == "resynced":
            self.averaged_round, self.donor = self._adopted_averaged_round, record.donor or None
        meta = {"round": node.round, "params_sha256": node.shard_sha256, "config_hash": self.config_hash,
                "averaged_round": self.averaged_round}
        self._state_hash = state_sha256(node.state, node.round, self.averaged_round, known={THETA: node.shard_sha256})
        if self.public:  # nobody could dial a private donor
            self.loop.run(self.state_server.set_state(node.round, pack_state(node.state, meta), node.shard_sha256),
                          timeout=60)
        # The state first: a node that reads our record at this round and falls behind finds the
        # state to download (it is not waited for, so a failed download would cost it a round).
        self._publish(node, record)

    def dht_peers(self) -> int:
        """DHT peers this node knows (its routing table), for the node's metrics."""
        return dht_peer_count(self.dht)

    # -- our progress record ---------------------------------------------------------------------

    def _publish(self, node: NodeState, record: RoundRecord | None) -> None:
        assert self.progress is not None
        group = self.last_group  # the group our θ last came out of: we vouch its members took part
        members = sorted(group.members | {self.peer_id}) if group and group.round == self.averaged_round else None
        self.progress.publish(progress_fields(node, record, peer_id=self.peer_id, params_sha256=node.shard_sha256,
                                              config_hash=self.config_hash, config_view=self.swarm_view,
                                              averaged_round=self.averaged_round, excluded=self.guard.excluded(),
                                              admission_token=self.admission.token,
                                              reachability=self.reachability,
                                              away=self.presence.away(get_dht_time()), donor=self.donor,
                                              state_sha256=self._state_hash if record is not None else None,
                                              members=members))

    def close(self) -> None:
        """Withdraw our records and stop serving; bounded so a shutdown never hangs."""
        if self.progress is not None:
            self.progress.stop_refreshing()
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
        for service in ("datashare", "state_server", "allreduce", "matchmaker", "reach"):
            if getattr(self, service, None) is not None:
                await getattr(self, service).stop()
        if hasattr(self, "p2p"):
            await self.p2p.shutdown()  # our replica only: the DHT process owns the daemon

