"""Standing: whose progress records may move this node. Headcount is not standing.

Anyone can make a peer id, so fresh identities backing a made-up round would outvote honest
nodes under a headcount quorum. A record backs a state only if its peer has standing with the
reader (`Standing.peers`): *earned* by committing a round in one group with this node, or named
in such a peer's latest record (one hop of a web of trust); or *witnessed* by the run's seed
(``--witness``, `Witness`), whose signed list a node without standing of its own takes. A witness
that trusts nobody yet moves nobody. After BTARD (Gorbunov et al. 2021), Psyche's witnesses and
PGP's web of trust. The rule and its bound: docs/protocol/records.md, docs/threat-model.md
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht.schema import SchemaValidator

from diloco_p2p.swarm.membership.records import ProgressRecord
from diloco_p2p.swarm.trust.schema import PeerB58, live_values, subkey_validator

MAX_WITNESSED = 256  # peers a witness lists
WITNESS_TTL = 60.0


class Standing:
    """The peers this node trusts to back a state: those it committed rounds with, one hop of
    theirs, and what the run's witness lists. Thread-safe enough: sets replaced, never mutated
    while read elsewhere."""

    def __init__(self, me: str):
        self.me = me
        self.direct: dict[str, int] = {}  # peer -> the last round we committed together
        self.witnessed: frozenset[str] | None = None  # None: no witness has spoken to us

    def committed(self, members: Iterable[str], round: int) -> None:
        """We committed `round` in a group with `members` (the all-reduce took every member's part)."""
        self.direct = {**self.direct, **{p: round for p in members if p != self.me}}

    def witness(self, peers: Iterable[str] | None) -> None:
        """What the seeds' witness says now (None: no witness spoke)."""
        self.witnessed = None if peers is None else frozenset(peers) - {self.me}

    def peers(self, records: Mapping[str, ProgressRecord]) -> frozenset[str]:
        """Who has standing now: direct and witnessed peers, and the members named in their records."""
        trusted = set(self.direct) | set(self.witnessed or ())
        for peer in list(trusted):
            record = records.get(peer)
            if record is not None and record.members:
                trusted.update(record.members)
        return frozenset(trusted - {self.me})

    def among(self, records: Mapping[str, ProgressRecord]) -> frozenset[str] | None:
        """The standing peers that have a record now. None while none has and no witness spoke:
        the node then has no view of its own (a newcomer before its first group, in a run whose
        seed witnesses nothing) and the headcount quorum decides, as before standing existed."""
        present = self.peers(records) & set(records)
        return frozenset(present) if present or self.witnessed is not None else None


# ------------------------------------------------------------------------------ the seed's witness


def witness_key(run_id: str) -> str:
    return f"{run_id}.witness"


class WitnessValue(pydantic.BaseModel):
    round: pydantic.conint(strict=True, ge=0)
    peers: pydantic.conlist(PeerB58, max_items=MAX_WITNESSED)

    class Config:
        extra = pydantic.Extra.forbid


def witness_validator(run_id: str) -> SchemaValidator:
    return subkey_validator("WitnessSchema", witness_key(run_id), WitnessValue)


def parse_witness(found: Any, witnesses: Iterable[str], now: float | None = None) -> set[str] | None:
    """The peers the given witnesses (peer ids) vouch for, from `dht.get(witness_key)`: only
    entries signed by a witness count (a witness's subkey is its own peer id, signed). None when
    no witness published anything (none runs, or it abstains): not the same as trusting nobody."""
    allowed, out, spoke = set(witnesses), set(), False
    for peer, value in live_values(found, now):
        if peer not in allowed:
            continue
        try:
            out.update(WitnessValue.parse_obj(value).peers)
            spoke = True
        except (pydantic.ValidationError, TypeError):
            continue
    return out if spoke else None


class Witness:
    """The seed's view of one run: it trusts `founders`, the first group it sees commit whose
    members it saw start (trust on first use), and every peer a trusted peer's record names. One
    that first looks at a run someone already averaged in, or sees groups commit for `PATIENCE`
    looks with none to trust, abstains without founders. docs/protocol/records.md, "Standing"."""

    PATIENCE = 30  # looks (about a second each) with committed groups and none trustworthy

    def __init__(self, founders: Iterable[str] = ()) -> None:
        self.trusted: set[str] = set(founders)
        self.round = 0
        self.abstains: bool | None = None  # decided at the first look
        self.fresh: set[str] = set()  # peers seen before they had averaged
        self._untrusting = 0

    def observe(self, records: Mapping[str, ProgressRecord]) -> frozenset[str]:
        if self.abstains is None:
            self.abstains = not self.trusted and any(r.averaged_round is not None for r in records.values())
        self.fresh |= {p for p, r in records.items() if r.averaged_round is None}
        if not self.trusted and not self.abstains:
            self.trusted = set(_first_group(records, self.fresh))
            committed = any(r.averaged_round is not None for r in records.values())
            self._untrusting = self._untrusting + 1 if committed and not self.trusted else 0
            self.abstains = self._untrusting >= self.PATIENCE
        grew = True
        while grew:  # members named by trusted peers, until nothing new
            named = {m for p in self.trusted if (r := records.get(p)) and r.members for m in r.members}
            grew = not named <= self.trusted
            self.trusted |= named
        present = [r.round for p, r in records.items() if p in self.trusted]
        self.round = max(present, default=self.round)
        return frozenset(self.trusted)

    def listed(self, records: Mapping[str, ProgressRecord]) -> list[str]:
        """The trusted peers to publish: those with a record now first, at most `MAX_WITNESSED`."""
        live = sorted(p for p in self.trusted if p in records)
        return (live + sorted(self.trusted - set(live)))[:MAX_WITNESSED]


def _first_group(records: Mapping[str, ProgressRecord], fresh: set[str]) -> list[str]:
    """The earliest committed group whose every member the witness saw before it had averaged
    and whose every member's record names that same group (the lowest `averaged_round`; ties:
    the larger group, then the smallest ids); none: []."""
    groups = []
    for r in records.values():
        members = set(r.members or ())
        if len(members) < 2 or r.peer_id not in members or r.averaged_round is None or not members <= fresh:
            continue
        if all(p in records and set(records[p].members or ()) == members and
               records[p].averaged_round == r.averaged_round for p in members):
            groups.append((r.averaged_round, -len(members), sorted(members)))
    return min(groups)[2] if groups else []
