"""The pure rules of matchmaking: the session, who leads whom, the answer, the checks.

One round's session, who leads whom, the one answer a leader hands every member, and the checks
on what peers send. No I/O here (the protocol that moves these values is `matchmaking`); `now`
comes in as an argument, so the rules are unit-tested on their own.
The protocol: docs/protocol/matchmaking.md
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import PeerID

PROTOCOL_VERSION = 1
MAX_WEIGHT = 1e18
MAX_WAIT = 86400.0  # a group's reported wait past a day is not believed

# Why form_group returned None (or "group"): `Matchmaker.last_outcome`.
# group: a Group; alone: nobody joined; void: closed below min_group_size; late: the round's group
# closed at its deadline before we arrived; timeout: our leader vanished; aborted: stop() was called
# or the form_group task was cancelled.
GROUP, ALONE, VOID, LATE, TIMEOUT, ABORTED = "group", "alone", "void", "late", "timeout", "aborted"


@dataclass
class Group:
    """A closed group, identical on every member (`peers` in the same order everywhere)."""

    group_id: str
    peers: list[PeerID]
    my_index: int
    weights: dict[str, float] | None = None  # base58 peer id -> weight the member announced
    leader: PeerID | None = None
    speeds: dict[str, float] | None = None  # base58 peer id -> its compute speed (tokens/s), for DyLU
    public: dict[str, bool] | None = None  # base58 peer id -> whether it can be dialled (None: all can)
    # Seconds from the leader's registration to the close (None: a leader that does not say).
    # The samples of `liveness.AdaptiveDeadline`.
    wait: float | None = None

    def public_flags(self) -> list[bool] | None:
        """`public` in member order, for the all-reduce (None when every member is public)."""
        if not self.public or all(self.public.values()):
            return None
        return [self.public.get(p.to_base58(), True) for p in self.peers]

    @property
    def size(self) -> int:
        return len(self.peers)


def finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def valid_weight(w: Any) -> bool:
    return finite_number(w) and 0 <= w <= MAX_WEIGHT


@dataclass
class Entry:
    """A registration read from the DHT."""

    peer: str
    t: float
    w: float
    done: str | None
    pub: bool = True  # whether it can be dialled; a private peer never leads (`Session.best_candidate`)


@dataclass
class Epoch:
    """A stretch of time during which this node leads: its members and the one answer all get."""

    members: dict[str, tuple[float, int]]  # peer -> (weight, token of the stream that joined it)
    speeds: dict[str, float] = field(default_factory=dict)  # peer -> announced speed (tokens/s of compute)
    public: dict[str, bool] = field(default_factory=dict)  # peer -> whether it can be dialled
    answer: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    close_reason: str | None = None  # "full", "complete" or "expired" once closed with a group


@dataclass
class Session:
    key: str
    round: int
    params_hash: str
    me: str
    t: float
    weight: float
    min_size: int
    target: int
    timeout: float
    request_timeout: float
    epoch: Epoch | None = None
    following: tuple[str, float] | None = None  # (leader, its t) while following or trying to
    # The live swarm at this round and θ besides us (from progress records, given by the caller):
    # once all of them are members there is no one left to wait for.
    expected: frozenset[str] = frozenset()
    refresh: Callable[[], Awaitable[Collection[str]]] | None = None  # reads `expected` again (the leader)
    speed: float = 0.0  # our tokens per second of compute this round (0: not measured)
    public: bool = True  # whether others can dial us (`diloco_p2p.swarm.transport.reach`)
    # When we lead: close after this many seconds instead of `timeout` (an adaptive deadline,
    # `liveness.AdaptiveDeadline`, at most `timeout`). A follower's patience stays `timeout`:
    # its leader may not have learnt the same deadline.
    close_after: float | None = None

    @property
    def close_at(self) -> float:
        return self.t + min(self.timeout, self.close_after or self.timeout)

    @property
    def deadline(self) -> float:
        return self.t + self.timeout + self.request_timeout

    def lead(self) -> Epoch:
        self.epoch = Epoch({self.me: (self.weight, 0)}, {self.me: self.speed}, {self.me: self.public})
        self.following = None
        return self.epoch

    def follow(self, leader: str, leader_t: float) -> None:
        """Forfeit leadership (redirecting current followers) and follow `leader`."""
        if self.epoch is not None and not self.epoch.answer.done():
            self.epoch.answer.set_result({"s": "redirect", "to": leader, "t": leader_t})
        self.epoch, self.following = None, (leader, leader_t)

    def best_candidate(self, view: dict[str, Entry], excluded: set[str]) -> Entry | None:
        """The live registration that precedes us in (t, peer id), or None if we are the best.
        Only public peers lead (a private one cannot be dialled): they are the candidates, and a
        private node follows the first of them whatever its own t (it never leads, so no loop)."""
        best: Entry | None = None
        for e in view.values():
            if e.done is None and e.pub and e.peer != self.me and e.peer not in excluded:
                if self.precedes(e.t, e.peer) and (best is None or (e.t, e.peer) < (best.t, best.peer)):
                    best = e
        return best

    def precedes(self, t: float, peer: str) -> bool:
        """Whether we may follow `peer` registered at `t` (a private node may follow anyone)."""
        return not self.public or (t, peer) < (self.t, self.me)

    def closing_reason(self, epoch: Epoch) -> str | None:
        """Why the open group we lead should close now: ``full`` (target reached), ``complete``
        (every peer we expect has joined, and enough of them for a group), or None (keep waiting)."""
        if len(epoch.members) >= self.target:
            return "full"
        if self.expected and self.expected <= epoch.members.keys() and len(epoch.members) >= max(2, self.min_size):
            return "complete"
        return None

    def close(self, epoch: Epoch, run_id: str, reason: str, now: float) -> None:
        """Close the open group we lead: one answer object, handed to every member."""
        if epoch.answer.done():
            return
        peers = sorted(epoch.members)
        if len(peers) < max(2, self.min_size):
            epoch.answer.set_result({"s": "void", "n": len(peers)})
            return
        digest = hashlib.sha256(
            json.dumps([run_id, self.round, self.params_hash, self.me, now, peers]).encode()
        ).hexdigest()[:32]
        epoch.close_reason = reason
        epoch.answer.set_result({
            "s": "group", "id": digest, "leader": self.me, "why": reason, "peers": peers,
            "w": {p: epoch.members[p][0] for p in peers},
            "sp": {p: epoch.speeds.get(p, 0.0) for p in peers},
            "pub": {p: epoch.public.get(p, True) for p in peers},
            "wait": now - self.t,
        })

    def final(self, answer: dict[str, Any], *, own: bool) -> Final | None:
        """Turn a leader's answer (`own`: our own) into our result; None if malformed or not naming us."""
        if answer.get("s") == "void":
            return Final(None, ALONE if own and answer.get("n") == 1 else VOID)
        if answer.get("s") != "group":
            return None
        peers, weights, group_id, why = answer.get("peers"), answer.get("w"), answer.get("id"), answer.get("why")
        leader = answer.get("leader")
        if not (
            isinstance(group_id, str)
            and isinstance(leader, str)
            and isinstance(peers, list)
            and len(peers) >= 2
            and all(isinstance(p, str) for p in peers)
            and len(set(peers)) == len(peers)
            and self.me in peers
            and leader in peers
            and isinstance(weights, dict)
            and set(weights) == set(peers)
            and all(valid_weight(w) for w in weights.values())
        ):
            return None
        try:
            peer_ids = [PeerID.from_base58(p) for p in peers]
            leader_id = PeerID.from_base58(leader)
        except Exception:
            return None
        speeds = answer.get("sp")
        speeds = ({p: float(v) for p, v in speeds.items()} if isinstance(speeds, dict) and set(speeds) == set(peers)
                  and all(valid_weight(v) for v in speeds.values()) else None)  # optional: absent = unknown
        public = answer.get("pub")  # optional: absent = every member public
        public = (dict(public) if isinstance(public, dict) and set(public) == set(peers)
                  and all(isinstance(v, bool) for v in public.values()) else None)
        why = why if why in ("full", "complete", "expired") else None
        wait = answer.get("wait")  # optional: absent = unknown
        wait = float(wait) if finite_number(wait) and 0 <= wait <= MAX_WAIT else None
        group = Group(group_id, peer_ids, peers.index(self.me), {p: float(w) for p, w in weights.items()}, leader_id,
                      speeds, public, wait)
        return Final(group, GROUP, why)

    def rejects(self, request: dict[str, Any], follower: str) -> bool:
        """Whether a join request for this session is malformed (answered ``closed: bad_request``)."""
        return (
            request.get("v") != PROTOCOL_VERSION
            or request.get("h") != self.params_hash
            or not valid_weight(request.get("w"))
            or not finite_number(request.get("hb"))
            or follower == self.me
        )


@dataclass
class Final:
    group: Group | None
    outcome: str
    close_reason: str | None = None


@dataclass
class Redirect:
    to: str
    t: float


def parse_view(result: Any) -> dict[str, Entry]:
    """The well-formed registrations in the result of `dht.get(key)` (None: nothing stored)."""
    view: dict[str, Entry] = {}
    if result is None or not isinstance(result.value, dict):
        return view
    for peer, item in result.value.items():
        value = getattr(item, "value", None)
        if not isinstance(peer, str) or not isinstance(value, dict):
            continue
        t, w, done = value.get("t"), value.get("w"), value.get("done")
        if finite_number(t) and valid_weight(w) and (done is None or isinstance(done, str)):
            view[peer] = Entry(peer, float(t), float(w), done, value.get("pub") is not False)
    return view
