"""One all-reduce's bookkeeping on one peer, and the rule that commits its parts.

A `Session` holds the parts and deadlines, what arrived from whom, and the commit rule that
turns the masks members exchanged into the result (`conclude`). No sockets here; the protocol
that fills a `Session` is `allreduce`. The protocol: docs/protocol/allreduce.md
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.p2p import PeerID

from diloco_p2p.swarm.collective import aggregate, wire

log = logging.getLogger("diloco_p2p.swarm.collective.allreduce")

SCATTER_FRACTION = 0.4
GATHER_FRACTION = 0.7
RELAY_FRACTION = 0.85  # a public member waits for the private members' masks until here (allreduce.py)


@dataclass
class AllreduceResult:
    average: torch.Tensor  # flat fp32, identical on every member that returns "ok"/"partial"
    status: str  # "ok" (all parts committed) | "partial" (some parts zeroed) | "failed" (nothing usable)
    committed_parts: list[int]
    num_parts: int
    contributors: list[str]  # base58 ids whose contributions entered at least one committed part
    rejected: dict[str, str]  # base58 id -> nan | shape | weight | timeout | compression | group | norm | opposed
    bytes_sent: int  # frame bytes written to streams by the time the call returned
    bytes_received: int  # frame bytes parsed for this group
    seconds: float
    part_contributors: dict[int, list[str]] = field(default_factory=dict)  # committed part -> contributors
    agreed_with: list[str] = field(default_factory=list)  # members whose masks entered the intersection
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds since the start, when it ended
    reducers: dict[str, str] = field(default_factory=dict)  # reducer caught by the members' checks -> what it did
    opposed: dict[str, str] = field(default_factory=dict)  # sender most parts left out as "opposed" -> how many
    proven_malformed: list[str] = field(default_factory=list)  # malformed by our own part, or most parts'


class Session:
    """One all-reduce on this peer. Created by `allreduce()` or by the first message naming its
    group_id, whichever comes first; messages wait on `started` until the local call begins."""

    def __init__(self, group_id: str, now: float):
        self.group_id, self.touched = group_id, now
        self.started = asyncio.Event()
        self.changed = asyncio.Condition()
        self.finished, self.finished_at = False, 0.0

    def start(
        self, peer_ids: list[PeerID], me: int, n: int, compression: str, chunk: int, t0: float, T: float,
        public: list[bool] | None = None,
    ):
        self.peer_ids, self.names = peer_ids, [p.to_base58() for p in peer_ids]
        self.me, self.k, self.n = me, len(peer_ids), n
        self.index = {name: i for i, name in enumerate(self.names)}
        self.others = [j for j in range(self.k) if j != me]
        # Members that cannot be dialled (NAT, `diloco_p2p.swarm.transport.reach`) reduce no part; two of
        # them never talk to each other (`silent`). Their empty parts count as gathered by all.
        if public is not None and len(public) != self.k:
            raise ValueError("public must flag every member")
        self.public = list(public) if public is not None and any(public) else [True] * self.k
        self.bounds = wire.partition_among(n, self.public)
        self.silent = {j for j in self.others if not (self.public[me] or self.public[j])}
        self.compression, self.chunk = compression, chunk
        self.digest = wire.peers_digest(self.names)
        self.d_scatter, self.d_gather, self.d_relay, self.d_end = (
            t0 + SCATTER_FRACTION * T,
            t0 + GATHER_FRACTION * T,
            t0 + RELAY_FRACTION * T,
            t0 + T,
        )
        # Not zeroed (27 ms for 20M values, before the first byte leaves): every committed part is
        # written whole before it is held, and `conclude` zeroes the others.
        self.result: torch.Tensor | None = torch.empty(n, dtype=torch.float32)
        self.contribs: dict[int, tuple[float, list[bytes]]] = {}  # accepted scatter header -> chunks so far
        self.complete: set[int] = set()  # contributions whose every chunk arrived and checked out
        self.failed: dict[int, str] = {}  # accepted contributions that broke off mid-part (reason)
        self.gather_header: dict[str, Any] | None = None  # our streamed gather, once contributors are fixed
        self.out: list[bytes] = []  # our reduced chunks, in order, as the pipeline produces them
        self.out_final: bytes | None = None  # the streamed gather's trailer (ok/void), when it is decided
        self.fallback: tuple[dict[str, Any], list[bytes]] | None = None  # our part reduced again, whole
        self.rejected: dict[int, str] = {}  # reasons for contributions to *our* part
        self.gathered: dict[int, dict[str, Any]] = {  # part -> its (validated, complete) gather header
            j: {"empty": False, "stream": False, "contributors": [], "rejected": {}}
            for j in range(self.k) if not self.public[j]
        }
        self.masks: dict[int, list[int]] = {}
        self.mask_digests: dict[int, list[str]] = {}  # sparse all-gather: digests of the contributions held
        self.heard: set[int] = set()
        self.probing: set[int] = set()
        self.gone: set[int] = set()
        self.excluded: set[int] = set()  # sent us a message that contradicts our view (sizes, group, format)
        self.reduced = self.mask_fixed = self.mask_sent = False
        self.part_hook: Any = None  # `AllreduceService.allreduce(part_hook=...)`: a hierarchy's next level
        self.bytes_sent = self.bytes_received = 0
        self.phases: dict[str, float] = {}
        # Robust aggregation and reducer checks (`diloco_p2p.swarm.collective.aggregate`): set by allreduce().
        self.robust = aggregate.MEAN
        self.norms: dict[int, float | None] = {}  # stated norms of the contributions to our part
        self.part_norms: dict[int, float] = {}  # our contribution's norm per part, summed as it was sent
        self.own_norms: list[float | None] = []  # the norms our mask states, per part
        self.part_digests: dict[int, str] = {}  # part -> sha256 of its gathered bytes (ours included)
        self.part_sumsq: dict[int, float] = {}  # part -> Σx² of its gathered values, summed as they landed
        self.gram: torch.Tensor | None = None  # our part's contributions' inner products (`aggregate.opposed`)
        self.mask_lists: dict[int, tuple[list, list]] = {}  # member -> its mask's (part_digests, norms)
        self.relayed: dict[int, dict[int, list]] = {}  # public member -> private member -> norms it relayed
        # Quoted samples (`samples`): ours to send, parts whose quotes refute them, parts that misquoted us.
        self.own, self.own_weight = torch.empty(0), 0.0  # our contribution, set by allreduce()
        self.quotes: bytes | None = None
        self.refuted: dict[int, str] = {}
        self.bad_quotes: dict[int, str] = {}  # reducer -> why its quotes to us did not parse
        self.misquoted: set[int] = set()
        self.mask_misquoted: dict[int, set[int]] = {}  # member -> the parts its mask says misquoted it
        self.started.set()

    def mark(self, phase: str, started: float) -> None:
        self.phases[phase] = time.perf_counter() - started

    def header(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"kind": kind, "group": self.group_id, "digest": self.digest, **fields}

    def accept_own(self, weight: float, chunks: list[bytes], finite: bool,
                   decoded: Callable[[], Iterable[torch.Tensor]]) -> bool:
        """Our own contribution under the checks anyone's passes (weight, finite as decoded), for the
        all-gather; the butterfly checks its own part a chunk at a time (`AllreduceService._own_part`)."""
        reason = wire.weight_problem(weight, None, math.inf)
        if reason is None and not (finite and all(wire.is_finite(values) for values in decoded())):
            reason = "nan"
        if reason:
            self.rejected[self.me] = reason
            return False
        self.contribs[self.me] = (weight, chunks)
        self.complete.add(self.me)
        return True

    def refuse_header(self, j: int, h: dict[str, Any], shape: dict[str, Any],
                      fmt: dict[str, Any]) -> str | None:
        """Member j's contribution header, checked before its payload is read: the refusal reason (in
        `rejected`) or None. Another `shape` or `fmt` than ours excludes j; "nan" or "weight" refuses
        only this contribution."""
        if any(h[key] != value for key, value in shape.items()):
            reason = "shape"
        elif any(h[key] != value for key, value in fmt.items()):
            reason = "compression"
        elif h["finite"] is not True:
            reason = "nan"
        else:
            reason = wire.weight_problem(h["weight"], None, math.inf)
        if reason is not None:
            if reason not in ("weight", "nan"):
                self.excluded.add(j)
            self.rejected[j] = reason
        return reason

    def pending(self, done: Iterable[int], only_heard: bool) -> list[int]:
        """Live members still expected to deliver what `done` is keyed by."""
        skip = self.gone | self.excluded | self.silent | set(done)
        return [j for j in self.others if j not in skip and (j in self.heard or not only_heard)]

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool], deadline: float) -> None:
        async with self.changed:
            with suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self.changed.wait_for(predicate)

    def finish(self, now: float) -> None:
        self.finished, self.finished_at = True, now
        self.started.set()  # wakes messages still waiting for a start that will not come
        self.result, self.contribs = None, {}


def conclude(s: Session, seconds: float) -> AllreduceResult:
    """The result once the masks are in: committed parts = those every heard mask holds; the
    other parts are zero; "failed" (all zeros) when no other member confirmed anything."""
    assert s.result is not None
    masks = {j: mask for j, mask in s.masks.items() if j not in s.excluded}
    committed = [p for p in range(s.k) if all(mask[p] for mask in masks.values())]
    agreed = sorted(masks)
    average = s.result
    caught = _check_reducers(s, committed, masks)
    committed = [p for p in committed if p not in caught]
    blamed = {s.names[p]: why for p, (why, proven) in {**_misquoting(s, masks), **caught}.items() if proven}
    blamed.update({s.names[p]: why for p, why in s.bad_quotes.items()})
    if len(agreed) < 2 or not committed:  # nobody confirmed anything with us
        status, committed, average = "failed", [], torch.zeros(s.n, dtype=torch.float32)
    else:
        status = "ok" if len(committed) == s.k else "partial"
        for p in set(range(s.k)) - set(committed):
            average[s.bounds[p][0] : s.bounds[p][1]] = 0.0
    part_contributors = {p: [s.names[c] for c in s.gathered[p]["contributors"]] for p in committed}
    contributors = sorted({c for p in committed for c in s.gathered[p]["contributors"]})
    rejected: dict[str, str] = {}
    for p in committed or sorted(s.gathered):
        for j, reason in s.gathered[p]["rejected"].items():
            if rejected.get(s.names[int(j)], "timeout") == "timeout":  # a specific reason beats "timeout"
                rejected[s.names[int(j)]] = reason
    opposed = _named_by_most(s, committed, ("opposed",))
    malformed = _named_by_most(s, committed, MALFORMED_REASONS)
    malformed.update({s.names[j]: "ours" for j, why in s.rejected.items() if why in MALFORMED_REASONS and j != s.me})
    log.debug("allreduce %s: %s, parts %s/%d, rejected %s", s.group_id, status, committed, s.k, rejected)
    return AllreduceResult(
        average=average,
        status=status,
        committed_parts=committed,
        num_parts=s.k,
        contributors=[s.names[c] for c in contributors],
        rejected=rejected,
        bytes_sent=s.bytes_sent,
        bytes_received=s.bytes_received,
        seconds=seconds,
        part_contributors=part_contributors,
        agreed_with=[s.names[j] for j in agreed],
        phases=dict(s.phases),
        reducers=blamed,
        opposed=opposed,
        proven_malformed=sorted(name for name in malformed if name in rejected),
    )


MALFORMED_REASONS = ("nan", "shape", "compression")


def _named_by_most(s: Session, committed: list[int], reasons: tuple[str, ...]) -> dict[str, str]:
    """Senders that most committed parts but their own (two at least) refused for one of `reasons`:
    evidence one lying reducer cannot make up (`collective.outcome.blame` weighs it)."""
    out: dict[str, str] = {}
    for q in range(s.k):
        named = judged = 0
        for p in committed:
            if p == q:
                continue
            says = s.gathered[p]["rejected"].get(str(q))
            named += says in reasons
            judged += says in reasons or q in s.gathered[p]["contributors"]
        if named >= 2 and 2 * named > judged:
            out[s.names[q]] = f"{named} of {judged} parts"
    return out


def _misquoting(s: Session, masks: dict[int, list[int]]) -> dict[int, aggregate.Suspect]:
    """Parts whose contributors said (in their masks, which drop the part) that its reducer quoted
    them otherwise than they sent: proven when more than half of the others did (`samples`)."""
    out: dict[int, aggregate.Suspect] = {}
    for p, h in s.gathered.items():
        others = [c for c in h["contributors"] if c != p]
        said = [c for c in others if c in masks and p in s.mask_misquoted.get(c, ())]
        if said:
            out[p] = aggregate.Suspect(f"quoted {len(said)} of its {len(others)} other contributors to part {p} "
                                       "otherwise than they sent", 2 * len(said) > len(others))
            log.warning("allreduce %s: dropped part %d: reducer %s %s", s.group_id, p, s.names[p], out[p].why)
    return out


def _check_reducers(s: Session, committed: list[int], masks: dict[int, list[int]]) -> dict[int, aggregate.Suspect]:
    """Committed parts the masks heard make suspect (`aggregate.suspect_parts`), logged: each is
    dropped; its reducer is blamed only when proven."""
    assert s.result is not None
    lists = {j: s.mask_lists[j] for j in masks if j in s.mask_lists}
    if s.part_hook is not None:  # a hierarchy's row: a part is the column's average, not bounded by our row's norms
        lists = {j: (d, [None] * s.k) for j, (d, _) in lists.items()}
    norms = {p: math.sqrt(s.part_sumsq[p] if p in s.part_sumsq
                          else aggregate.part_sumsq(s.result[s.bounds[p][0] : s.bounds[p][1]], s.chunk))
             for p in committed}  # summed as each part landed; an empty (private member's) part here
    stated = {j: n for j, (_, n) in lists.items()}
    for j in sorted(s.relayed, reverse=True):  # private members we did not hear: the lowest public relay
        if j in masks and s.part_hook is None:
            stated.update({q: n for q, n in s.relayed[j].items() if q not in lists})
    caught = aggregate.suspect_parts(
        committed, {j: d for j, (d, _) in lists.items()}, stated,
        {p: s.gathered[p]["contributors"] for p in committed}, norms, s.robust.max_norm_ratio, s.compression,
        s.robust.min_part_ratio,
    )
    for p in committed:  # the same quotes on every member (they are in the digests): proven by its own bytes
        if p in s.refuted and p not in caught:
            caught[p] = aggregate.Suspect(f"its average of part {p} {s.refuted[p]}", True)
    for p, (why, proven) in caught.items():
        log.warning("allreduce %s: dropped part %d: reducer %s %s%s", s.group_id, p, s.names[p], why,
                    "" if proven else " (not blamed: fewer than half of the members lying in their masks could cause it)")
    return caught
