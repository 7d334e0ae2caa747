"""The progress record every node publishes in the DHT, and what readers conclude from them.

One DHT key per run, ``f"{run_id}.progress"``, holds a dictionary: subkey = the node's peer id
(base58), value = its `ProgressRecord` (round, tokens, throughput, losses, hash of θ, hash and
view of the swarm-relevant config). Readers use it to

- refuse a node whose config differs from the swarm's, naming the differing fields
  (`check_config`);
- decide whether a node must adopt the swarm's state: behind, in a minority, or cut off
  (`resync_target`);
- show what the swarm is doing (`diloco-p2p status`).

Validation happens twice. Storing peers run hivemind's `SchemaValidator` (give
`progress_validator(run_id)` to `start_dht`), which rejects records that need any type
conversion; and every reader parses each entry again with the same strict model, because the
peers that happen to hold the key (a seed, say) may not know our run id or may run another
version. An entry that does not parse, has expired, or names another peer than its subkey is
dropped, never trusted.

hivemind cannot delete a DHT value. A node that leaves stores a *tombstone* (``None``) under
its subkey with an expiration just past its last record's, which replaces the record on the
storing peers; readers skip tombstones.

The models here are pydantic.v1 models (hivemind's schema machinery is built on v1); they are
deliberately separate from the v2 config models in `diloco_p2p.config`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

import hivemind
import pydantic.v1 as pydantic
from hivemind.dht.schema import SchemaValidator
from hivemind.utils import get_dht_time

from diloco_p2p import __version__
from diloco_p2p.config import diff_swarm_fields
from diloco_p2p.errors import UserError

logger = logging.getLogger(__name__)

# What a record's `status` may say about the node's last round. `started`: no round finished
# yet; the others are the round outcomes of the round protocol (issue 3) and of catch-up.
STATUSES = ("started", "committed", "alone", "failed", "skipped", "resynced")
# A sensible lifetime for a record: a node republishes at least once per round and when it
# leaves; a record older than this belongs to a node that died without saying so.
DEFAULT_TTL = 600.0

PeerB58 = pydantic.constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")
Hex64 = pydantic.constr(strict=True, regex=r"^[0-9a-f]{64}$")
Count = pydantic.conint(strict=True, ge=0)
FiniteFloat = pydantic.confloat(strict=True, allow_inf_nan=False)
NonNegFloat = pydantic.confloat(strict=True, ge=0, allow_inf_nan=False)


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
        updated: float | None = None,
        version: str = __version__,
    ) -> ProgressRecord:
        """Make a record from ordinary Python values: numbers are cast to the strict wire types,
        a non-finite loss becomes ``None`` (a diverged node stays visible instead of having its
        record rejected), `config_view` may be the `swarm_view()` dict, `updated` defaults to now.
        Raises `pydantic.v1.ValidationError` for values the schema rejects (negative round...)."""
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


class _SchemaBase(pydantic.BaseModel):
    # Our own Config class: hivemind's SchemaValidator sets `schema.Config.extra`, and a model
    # without one would resolve that to pydantic.v1's global BaseConfig and change every model.
    class Config:
        extra = pydantic.Extra.forbid


def progress_validator(run_id: str) -> SchemaValidator:
    """A hivemind validator for this run's progress key; pass it to `start_dht(record_validators=...)`.

    The schema's field name is the raw DHT key (hivemind hashes field names to match keys), and
    the value is a dictionary of subkeys; ``None`` is a tombstone."""
    schema = pydantic.create_model(
        "ProgressSchema",
        __base__=_SchemaBase,
        **{progress_key(run_id): (Optional[dict[PeerB58, Optional[ProgressRecord]]], None)},
    )
    return SchemaValidator(schema, allow_extra_keys=True)


# ---------------------------------------------------------------- publishing and reading


def publish_progress(
    dht: hivemind.DHT, run_id: str, record: ProgressRecord, ttl: float = DEFAULT_TTL
) -> bool:
    """Store our record for `ttl` seconds; False if no peer accepted it (the caller logs and goes on)."""
    return bool(dht.store(progress_key(run_id), record.dict(), get_dht_time() + ttl, subkey=record.peer_id))


async def publish_progress_async(
    dht: hivemind.DHT,
    run_id: str,
    record: ProgressRecord,
    ttl: float = DEFAULT_TTL,
    timeout: float | None = None,
) -> bool:
    """`publish_progress` for coroutines: awaits hivemind's future instead of blocking the loop."""
    future = dht.store(
        progress_key(run_id), record.dict(), get_dht_time() + ttl, subkey=record.peer_id, return_future=True
    )
    return bool(await asyncio.wait_for(future, timeout))


def read_progress(dht: hivemind.DHT, run_id: str, timeout: float | None = None) -> dict[str, ProgressRecord]:
    """Every live, valid record of the run by peer id; raises TimeoutError past `timeout`."""
    found = dht.get(progress_key(run_id), latest=True, return_future=True).result(timeout)
    return parse_progress(found)


async def read_progress_async(
    dht: hivemind.DHT, run_id: str, timeout: float | None = None
) -> dict[str, ProgressRecord]:
    found = await asyncio.wait_for(dht.get(progress_key(run_id), latest=True, return_future=True), timeout)
    return parse_progress(found)


def withdraw_progress(dht: hivemind.DHT, run_id: str, peer_id: str, timeout: float | None = 10.0) -> bool:
    """Make our record disappear for readers: store a tombstone that outlives the record."""
    key = progress_key(run_id)
    try:
        found = dht.get(key, latest=True, return_future=True).result(timeout)
    except TimeoutError:
        found = None
    expiration = _tombstone_expiration(found, peer_id)
    return bool(dht.store(key, None, expiration, subkey=peer_id, return_future=True).result(timeout))


async def withdraw_progress_async(
    dht: hivemind.DHT, run_id: str, peer_id: str, timeout: float | None = 10.0
) -> bool:
    key = progress_key(run_id)
    try:
        found = await asyncio.wait_for(dht.get(key, latest=True, return_future=True), timeout)
    except TimeoutError:
        found = None
    expiration = _tombstone_expiration(found, peer_id)
    return bool(
        await asyncio.wait_for(dht.store(key, None, expiration, subkey=peer_id, return_future=True), timeout)
    )


def _tombstone_expiration(found: Any, peer_id: str) -> float:
    """Just past our record's expiration, so the tombstone replaces it (the later expiration wins
    per subkey) and a restarted node with the same identity can soon publish again. If we cannot
    see our record, outlive any record published with the default ttl."""
    entries = getattr(found, "value", None)
    entry = entries.get(peer_id) if isinstance(entries, dict) else None
    if entry is not None and getattr(entry, "expiration_time", None) is not None:
        return max(float(entry.expiration_time) + 1e-3, get_dht_time() + 1.0)
    return get_dht_time() + DEFAULT_TTL


def parse_progress(found: Any, now: float | None = None) -> dict[str, ProgressRecord]:
    """Records from the result of `dht.get(progress_key)`: drops tombstones, expired entries,
    entries that fail the schema and entries whose subkey is not their own peer id."""
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        return {}
    now = get_dht_time() if now is None else now
    out: dict[str, ProgressRecord] = {}
    for subkey, item in entries.items():
        value, expiration = getattr(item, "value", None), getattr(item, "expiration_time", None)
        if value is None or expiration is None or expiration < now:
            continue
        try:
            record = ProgressRecord.parse_obj(value)
        except (pydantic.ValidationError, TypeError) as e:
            logger.debug("dropping an invalid progress record under %r: %s", subkey, e)
            continue
        if record.peer_id != subkey:
            logger.debug("dropping a progress record for %s stored under %r", record.peer_id, subkey)
            continue
        out[subkey] = record
    return out


# ---------------------------------------------------------------- conclusions from records


def majority(values: Iterable[str]) -> str | None:
    """The most frequent value; ties go to the smallest, so every reader picks the same one."""
    counts = Counter(values)
    if not counts:
        return None
    return min(counts, key=lambda v: (-counts[v], v))


def round_majorities(records: Mapping[str, ProgressRecord]) -> dict[int, str]:
    """For each round some node reports, the majority params hash among the nodes at that round.

    Nodes at different rounds hold different θ by design, so agreement is only meaningful
    within a round."""
    by_round: dict[int, list[str]] = {}
    for r in records.values():
        by_round.setdefault(r.round, []).append(r.params_sha256)
    return {rnd: majority(hashes) for rnd, hashes in by_round.items()}  # type: ignore[misc]


# Rounds a node may end without a group, while others average, before it concludes it was cut
# off from them (one such round happens when a group forms without it).
MAX_UNBACKED_ROUNDS = 2


def _averaged(r: ProgressRecord) -> int:
    return -1 if r.averaged_round is None else r.averaged_round


def reference_records(others: Mapping[str, ProgressRecord]) -> dict[str, ProgressRecord]:
    """The records that speak for the swarm's state: those whose θ was averaged most recently.

    Each record carries `averaged_round`: the last round its θ came out of a group (committed,
    or resynced from a state that did; a node that ends rounds alone keeps the old value). A
    record whose `averaged_round` is below the newest one is *superseded*: other nodes averaged
    after its θ last did, so the swarm went on without it (a node cut off by a partition, or one
    that restarted and has not averaged yet). It does not count, even with a newer round
    number: alone rounds are often quicker than averaged ones. A node training on alone because
    every other node died is not superseded (the records those nodes left behind are no newer
    than its last averaged round). With no averaging anywhere yet, every record counts."""
    newest = max(map(_averaged, others.values()), default=-1)
    return {peer: r for peer, r in others.items() if _averaged(r) >= newest}


@dataclass(frozen=True)
class Resync:
    """Download the swarm's state: of round `min_round` or later, from any donor but `exclude`."""

    min_round: int
    reason: str
    exclude: frozenset[str]


def resync_target(
    others: Mapping[str, ProgressRecord], our_round: int, our_hash: str, averaged_round: int | None = None
) -> Resync | None:
    """Whether a node at (`our_round`, `our_hash`), whose θ was last averaged at round
    `averaged_round` (None: not since it started), must adopt the swarm's state, and which.

    The swarm's state is that of the `reference_records`; with `top` their newest round:

    - behind (`top` > ours): download a state of round >= `top`;
    - same round, our hash not the majority's (ties to the smallest hash): download;
    - cut off: the reference nodes averaged after our θ last did, we ended
      `MAX_UNBACKED_ROUNDS` or more rounds since without a group, and we are ahead of them in
      round number: our rounds since hold our own data only, so go back to their state.

    Nodes whose records do not count are never asked for the state (`exclude`). The rule reads
    the same records the same way on every node, so a fork heals deterministically.
    """
    if not others:
        return None
    reference = reference_records(others)
    exclude = frozenset(others) - frozenset(reference)
    top = max(r.round for r in reference.values())
    if top > our_round:
        return Resync(top, f"behind: swarm at round {top}, we are at {our_round}", exclude)
    same_round = [r.params_sha256 for r in reference.values() if r.round == our_round]
    if top == our_round:
        if majority([*same_round, our_hash]) == our_hash:
            return None
        theirs = round_majorities(reference)[top]
        return Resync(top, f"our parameters {our_hash[:12]} differ from the swarm's {theirs[:12]} at round {top}",
                      exclude)
    ours = -1 if averaged_round is None else averaged_round
    theirs = _averaged(next(iter(reference.values())))
    if theirs > ours and our_round - ours >= MAX_UNBACKED_ROUNDS:
        return Resync(top, f"our rounds {ours + 1}..{our_round} ended without a group while {len(reference)} "
                           f"node(s) averaged up to round {theirs}: we were cut off; back to the swarm's state", exclude)
    return None


def check_config(
    records: Mapping[str, ProgressRecord], our_view: Mapping[str, Any], our_hash: str, our_peer: str
) -> None:
    """Raise `UserError` if the other peers' majority config hash is not ours, listing the fields
    that differ (ours != the swarm's). No other peers, or a tie that includes our hash: accept."""
    others = [r for peer, r in records.items() if peer != our_peer]
    counts = Counter(r.config_hash for r in others)
    if not counts or counts[our_hash] == max(counts.values()):
        return
    swarm_hash = majority(r.config_hash for r in others)
    holders = [r for r in others if r.config_hash == swarm_hash]
    ours = json.loads(json.dumps(dict(our_view), sort_keys=True))  # compare as it travels: JSON
    diffs = diff_swarm_fields(ours, holders[0].view())
    where = f"config differs from the swarm's ({len(holders)} peers)"
    if not diffs:
        raise UserError(
            f"{where}: the config hashes differ ({our_hash[:12]} != {swarm_hash[:12]}) but no field does; "
            f"the peers probably run another diloco-p2p version (ours {__version__}, theirs {holders[0].version})"
        )
    raise UserError(
        f"{where}: {'; '.join(diffs)} (ours != swarm's); set these fields to the swarm's values "
        "in your config file or with --set"
    )
