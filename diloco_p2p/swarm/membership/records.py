"""The progress record every node publishes in the DHT, and what readers conclude from them.

One DHT key per run holds a dictionary: subkey = the node's signed peer id, value = its
`ProgressRecord` (round, tokens, losses, θ hash, averaged round, config view). Readers use it to
refuse a differing config, to decide on a resync (`resync`), to decide who a round waits for
(`liveness`) and for `diloco-p2p status`. Entries are validated by the storing peers and parsed
again by every reader; one that does not parse, has expired, or names another peer than its
signer is dropped. A node that leaves stores a tombstone, as hivemind cannot delete a value.
The records: docs/protocol/records.md
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Optional

import hivemind
import pydantic.v1 as pydantic
from hivemind.dht.schema import SchemaValidator
from hivemind.utils import get_dht_time

from diloco_p2p import __version__
from diloco_p2p.contract import REJECTION_REASONS, NodeState, RoundRecord
from diloco_p2p.swarm.transport.runner import BackgroundLoop
from diloco_p2p.swarm.trust.schema import Count, Hex64, OnReject, PeerB58, live_values, subkey_validator
from diloco_p2p.swarm.trust.signing import own_subkey

logger = logging.getLogger(__name__)

# What a record's `status` may say about the node's last round. `started`: no round finished
# yet; the others are the round outcomes of the round protocol (issue 3) and of catch-up.
STATUSES = ("started", "committed", "alone", "failed", "skipped", "resynced")
# A sensible lifetime for a record: a node republishes at least once per round and when it
# leaves; a record older than this belongs to a node that died without saying so.
DEFAULT_TTL = 600.0
PROGRESS_TTL = 60.0  # a running node's record: republished every round and every PROGRESS_REFRESH
PROGRESS_REFRESH = PROGRESS_TTL / 4
MAX_EXCLUDED = 32  # peers listed in a record's `excluded`

FiniteFloat = pydantic.confloat(strict=True, allow_inf_nan=False)
NonNegFloat = pydantic.confloat(strict=True, ge=0, allow_inf_nan=False)
MAX_AWAY = 32  # peers listed in a record's `away`
MAX_MEMBERS = 64  # peers listed in a record's `members` (the group it last committed with)


class Absence(pydantic.BaseModel):
    """How a node saw one peer miss rounds (`diloco_p2p.swarm.membership.liveness`)."""

    missed: Count  # rounds of the reporter that did not wait for it
    away_s: NonNegFloat  # seconds it was not waited for, in all
    away: bool  # not waited for right now

    class Config:
        extra = pydantic.Extra.forbid
        allow_mutation = False


class ProgressRecord(pydantic.BaseModel):
    """One node's progress as stored in the DHT; strict types (hivemind rejects conversions)."""

    peer_id: PeerB58
    round: Count
    step: Count
    tokens: Count
    tokens_per_s: NonNegFloat
    train_loss: Optional[FiniteFloat] = None
    eval_loss: Optional[FiniteFloat] = None
    params_sha256: Hex64
    config_hash: Hex64
    config_view: pydantic.constr(strict=True, max_length=65536)
    status: Literal[STATUSES]  # type: ignore[valid-type]
    group_size: Count
    joined_at_round: Count
    resyncs: Count
    averaged_round: Optional[Count] = None  # the last round its θ came out of a group (None: none yet)
    # Peers this node refuses to trust right now, with the reason (`diloco_p2p.swarm.trust.guard`).
    excluded: Optional[dict[PeerB58, Literal[REJECTION_REASONS]]] = None  # type: ignore[valid-type]
    # A closed run's admission token for this peer (`diloco_p2p.swarm.trust.admission`).
    admission_token: Optional[pydantic.constr(strict=True, max_length=4096)] = None
    # Whether other peers can dial this node (`diloco_p2p.swarm.transport.reach`); None: an older node, public.
    reachability: Optional[Literal["public", "private"]] = None
    # Peers this node saw miss rounds (`liveness.Presence`); absent while nobody did, so a swarm
    # without churn publishes what older nodes accept.
    away: Optional[dict[PeerB58, Absence]] = None
    # The peer whose state this θ came from while the node has not averaged since (`resync`'s
    # donor rule); absent otherwise, so a node that never resyncs publishes what older nodes accept.
    donor: Optional[PeerB58] = None
    # The hash of the whole state this node serves (θ, momentum, buffers: `codec.state_sha256`):
    # what a joiner checks a download against, beyond θ.
    state_sha256: Optional[Hex64] = None
    # The group it last committed a round with (`averaged_round`): the peers it vouches took part,
    # from which a reader that trusts this node extends its standing (`diloco_p2p.swarm.trust.standing`).
    members: Optional[pydantic.conlist(PeerB58, max_items=MAX_MEMBERS)] = None
    version: pydantic.constr(strict=True, min_length=1, max_length=64)
    updated: NonNegFloat

    class Config:
        extra = pydantic.Extra.forbid
        allow_mutation = False

    @classmethod
    def build(
        cls,
        *,
        peer_id: str,
        round: int,
        step: int,
        tokens: int,
        tokens_per_s: float,
        params_sha256: str,
        config_hash: str,
        config_view: Mapping[str, Any] | str,
        status: str = "started",
        train_loss: float | None = None,
        eval_loss: float | None = None,
        group_size: int = 0,
        joined_at_round: int = 0,
        resyncs: int = 0,
        averaged_round: int | None = None,
        excluded: Mapping[str, str] | None = None,
        admission_token: str | None = None,
        reachability: str | None = None,
        away: Mapping[str, Mapping[str, Any]] | None = None,
        donor: str | None = None,
        state_sha256: str | None = None,
        members: Iterable[str] | None = None,
        updated: float | None = None,
        version: str = __version__,
    ) -> ProgressRecord:
        """A record from plain values: numbers cast to the strict types, a non-finite loss as ``None``
        (a diverged node stays visible), `updated` now. Raises `ValidationError` for rejected values."""
        return cls(
            peer_id=peer_id,
            round=int(round),
            step=int(step),
            tokens=int(tokens),
            tokens_per_s=float(tokens_per_s),
            train_loss=_finite_or_none(train_loss),
            eval_loss=_finite_or_none(eval_loss),
            params_sha256=params_sha256,
            config_hash=config_hash,
            config_view=config_view
            if isinstance(config_view, str)
            else json.dumps(dict(config_view), sort_keys=True),
            status=status,
            group_size=int(group_size),
            joined_at_round=int(joined_at_round),
            resyncs=int(resyncs),
            averaged_round=None if averaged_round is None else int(averaged_round),
            excluded=dict(sorted(excluded.items())[:MAX_EXCLUDED]) if excluded else None,
            admission_token=admission_token,
            reachability=reachability,
            away={peer: Absence(missed=int(a["missed"]), away_s=float(a["away_s"]), away=bool(a["away"]))
                  for peer, a in sorted(away.items())[:MAX_AWAY]} if away else None,
            donor=donor or None,
            state_sha256=state_sha256,
            members=sorted(members)[:MAX_MEMBERS] if members else None,
            version=version,
            updated=float(get_dht_time() if updated is None else updated),
        )

    def view(self) -> dict[str, Any]:
        """The publisher's `swarm_view()` dict (empty if it does not decode)."""
        try:
            view = json.loads(self.config_view)
        except ValueError:
            return {}
        return view if isinstance(view, dict) else {}


def _finite_or_none(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def progress_key(run_id: str) -> str:
    return f"{run_id}.progress"


def progress_validator(run_id: str) -> SchemaValidator:
    """A hivemind validator for this run's progress key; pass it to `start_dht(record_validators=...)`."""
    return subkey_validator("ProgressSchema", progress_key(run_id), ProgressRecord)


# ---------------------------------------------------------------- publishing and reading


def publish_progress(
    dht: hivemind.DHT, run_id: str, record: ProgressRecord, ttl: float = DEFAULT_TTL
) -> bool:
    """Store our record for `ttl` seconds; False if no peer accepted it (the caller logs and goes on)."""
    subkey = own_subkey(dht, record.peer_id)
    return bool(dht.store(progress_key(run_id), record.dict(), get_dht_time() + ttl, subkey=subkey))


async def publish_progress_async(
    dht: hivemind.DHT,
    run_id: str,
    record: ProgressRecord,
    ttl: float = DEFAULT_TTL,
    timeout: float | None = None,
) -> bool:
    """`publish_progress` for coroutines: awaits hivemind's future instead of blocking the loop."""
    subkey = own_subkey(dht, record.peer_id)
    future = dht.store(progress_key(run_id), record.dict(), get_dht_time() + ttl, subkey=subkey, return_future=True)
    return bool(await asyncio.wait_for(future, timeout))


def read_progress(
    dht: hivemind.DHT, run_id: str, timeout: float | None = None, on_reject: OnReject | None = None
) -> dict[str, ProgressRecord]:
    """Every live, valid record of the run by peer id; raises TimeoutError past `timeout`."""
    found = dht.get(progress_key(run_id), latest=True, return_future=True).result(timeout)
    return parse_progress(found, on_reject=on_reject)


async def read_progress_async(
    dht: hivemind.DHT, run_id: str, timeout: float | None = None, on_reject: OnReject | None = None
) -> dict[str, ProgressRecord]:
    found = await asyncio.wait_for(dht.get(progress_key(run_id), latest=True, return_future=True), timeout)
    return parse_progress(found, on_reject=on_reject)


def withdraw_progress(dht: hivemind.DHT, run_id: str, peer_id: str, timeout: float | None = 10.0) -> bool:
    """Make our record disappear for readers: store a tombstone that outlives the record."""
    key, subkey = progress_key(run_id), own_subkey(dht, peer_id)
    try:
        found = dht.get(key, latest=True, return_future=True).result(timeout)
    except TimeoutError:
        found = None
    expiration = _tombstone_expiration(found, subkey)
    return bool(dht.store(key, None, expiration, subkey=subkey, return_future=True).result(timeout))


async def withdraw_progress_async(
    dht: hivemind.DHT, run_id: str, peer_id: str, timeout: float | None = 10.0
) -> bool:
    key, subkey = progress_key(run_id), own_subkey(dht, peer_id)
    try:
        found = await asyncio.wait_for(dht.get(key, latest=True, return_future=True), timeout)
    except TimeoutError:
        found = None
    expiration = _tombstone_expiration(found, subkey)
    return bool(
        await asyncio.wait_for(dht.store(key, None, expiration, subkey=subkey, return_future=True), timeout)
    )


def _tombstone_expiration(found: Any, subkey: str) -> float:
    """Just past our record's expiration, so the tombstone replaces it (the later expiration wins
    per subkey) and a restarted node with the same identity can soon publish again. If we cannot
    see our record, outlive any record published with the default ttl."""
    entries = getattr(found, "value", None)
    entry = entries.get(subkey) if isinstance(entries, dict) else None
    if entry is not None and getattr(entry, "expiration_time", None) is not None:
        return max(float(entry.expiration_time) + 1e-3, get_dht_time() + 1.0)
    return get_dht_time() + DEFAULT_TTL


def parse_progress(
    found: Any, now: float | None = None, on_reject: OnReject | None = None
) -> dict[str, ProgressRecord]:
    """Records from the result of `dht.get(progress_key)`: drops tombstones, expired entries,
    unsigned entries and entries that fail the schema; refuses (`on_reject`, ``forged-record``)
    an entry signed by another peer than its subkey's, or whose record names another peer."""
    out: dict[str, ProgressRecord] = {}
    for peer, value in live_values(found, now, on_reject):
        try:
            record = ProgressRecord.parse_obj(value)
        except (pydantic.ValidationError, TypeError) as e:
            logger.debug("dropping an invalid progress record of %s: %s", peer, e)
            continue
        if record.peer_id != peer:
            if on_reject is not None:
                on_reject(peer, "forged-record", f"its signed record claims to be {record.peer_id}'s")
            continue
        out[peer] = record
    return out


class ProgressPublisher:
    """One progress record of ours in one DHT namespace, refreshed every `PROGRESS_REFRESH`
    while a long round runs, so we do not look gone."""

    def __init__(self, dht: Any, loop: BackgroundLoop, run_id: str):
        self.dht, self.loop, self.run_id = dht, loop, run_id
        self.fields: dict[str, Any] = {}
        self._refresh = loop.submit(self._refresh_forever())

    def publish(self, fields: dict[str, Any]) -> None:
        self.fields = fields
        self.loop.run(self._publish(), timeout=30)

    async def _publish(self) -> None:
        if self.fields:
            record = ProgressRecord.build(**dict(self.fields, updated=None))
            await publish_progress_async(self.dht, self.run_id, record, ttl=PROGRESS_TTL)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_REFRESH)
            await self._publish()

    def stop_refreshing(self) -> None:
        self._refresh.cancel()


def progress_fields(node: NodeState, record: RoundRecord | None, **endpoint: Any) -> dict[str, Any]:
    """A DHT progress record's fields: the node's counters, the round's numbers (None: the node
    has just started) and the endpoint's identity, hash and config view."""
    return dict(
        round=node.round, step=node.step, tokens=node.tokens, joined_at_round=node.joined_at_round or 0,
        resyncs=node.resyncs, version=__version__, status=record.status if record else "started",
        tokens_per_s=(record.tokens_per_s if record else 0.0) or 0.0, train_loss=record.train_loss if record else None,
        eval_loss=record.eval_loss if record else None, group_size=record.group_size if record else 0, **endpoint,
    )
