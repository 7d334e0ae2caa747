"""What a node refuses, seen and counted.

Every refusal of a peer (a forged record, a peer a closed run has not admitted, a state nobody
vouches for or past `train.max_rounds`, a downloaded θ that is not the one vouched for) goes
through `Guard.reject`: one log line naming the peer (full base58 id), the reason and what it
did, once per round for the same refusal (records are read several times a round); the round's refusals go into the round record (`rejections`, then
``diloco_rejections_total{reason}`` in Prometheus, `diloco_p2p.loop.metrics`), and the peers refused
recently into our progress record (`excluded`), which `diloco-p2p status` shows.

Reasons are a small fixed set (`diloco_p2p.contract.REJECTION_REASONS`) so they can be labels.
"""

from __future__ import annotations

import logging
import threading
import time

from diloco_p2p.contract import REJECTION_REASONS

log = logging.getLogger(__name__)

# How long a refused peer stays listed in our record's `excluded` after its last refusal.
EXCLUDED_FOR = 600.0
# Refusals after which we download no state from the peer: it lied about its record or state, lied
# as a reducer, or is not a member of a closed run. Not `unvouched-state`: the first member to
# publish a round is ahead of its quorum for a moment, and every member is, now and then, in a
# swarm that does not wait for us; nor the all-reduce's `weight` and `norm`.
NO_STATE_FROM = frozenset({"forged-record", "not-admitted", "bad-state", "reducer"})
# Refusals after which matchmaking keeps the peer out of our groups: a caught reducer, a sender of
# a malformed contribution (each costs its group a part, or its share, of every round it joins).
# Not `opposed`: honest Δs at a small H can point against the others' (an honest node of a group of
# 3 at H = 4 was, and was kept out for the rest of its run); left out of the part, it loses a round.
KEPT_OUT = frozenset({"reducer", "malformed"})


class Guard:
    """The refusals of one swarm endpoint. Thread-safe: stream handlers run on the network loop,
    the record checks on the training thread."""

    def __init__(self, excluded_for: float = EXCLUDED_FOR, clock=time.monotonic):
        self.excluded_for, self.clock = excluded_for, clock
        self._round: dict[str, set[str]] = {}
        self._logged: set[tuple[str, str, str]] = set()
        self._last: dict[str, tuple[str, float]] = {}
        self._caught: dict[str, float] = {}  # peer -> when it was last caught as a reducer
        self._no_state: dict[str, float] = {}  # peer -> when it was last refused for a reason in NO_STATE_FROM
        self._lock = threading.Lock()

    def reject(self, peer: str, reason: str, detail: str, keep_out: bool = True) -> None:
        """Refuse `peer` for `reason` (one of `REJECTION_REASONS`); `detail` says what it did.
        `keep_out` False: named and counted, but not left out of our groups whatever the reason."""
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        with self._lock:
            new = (peer, reason, detail) not in self._logged
            self._logged.add((peer, reason, detail))
            self._round.setdefault(peer, set()).add(reason)
            self._last[peer] = (reason, self.clock())
            if reason in KEPT_OUT and keep_out:
                self._caught[peer] = self._last[peer][1]
            if reason in NO_STATE_FROM:
                self._no_state[peer] = self._last[peer][1]
        if new:
            log.warning("refused peer %s: %s (%s)", peer, reason, detail)

    def drain(self) -> dict[str, list[str]] | None:
        """This round's refusals (peer -> its reasons, sorted), None if none; the next round starts empty."""
        with self._lock:
            out, self._round = self._round, {}
            self._logged.clear()
        return {peer: sorted(reasons) for peer, reasons in out.items()} or None

    def excluded(self) -> dict[str, str]:
        """Peers refused within `excluded_for` seconds, with the last reason."""
        now = self.clock()
        with self._lock:
            return {p: reason for p, (reason, t) in self._last.items() if now - t <= self.excluded_for}

    def no_state_from(self) -> set[str]:
        """Peers refused within `excluded_for` for a reason in `NO_STATE_FROM`, whatever they
        were refused for since: a catch-up downloads nothing from them."""
        now = self.clock()
        with self._lock:
            return {p for p, t in self._no_state.items() if now - t <= self.excluded_for}

    def distrusted(self) -> set[str]:
        """Peers caught as a reducer or sending malformed contributions within `excluded_for`,
        whatever they were refused for since:
        matchmaking keeps them out of our groups (`diloco_p2p.swarm.collective.aggregate`)."""
        now = self.clock()
        with self._lock:
            return {p for p, t in self._caught.items() if now - t <= self.excluded_for}
