"""Who a round waits for, and for how long: the liveness rule and the adaptive deadlines.

A group closes once every peer it expects has joined, so the expected set decides how long the
whole swarm stands still. It expects only *live* peers: at the round (a record at most two
rounds behind), heart-beating, trusted, and not seen missing from our last committed round; a
peer further behind comes back by downloading the state. `AdaptiveDeadline` learns the waits of
matchmaking and the all-reduce (a robust median plus a margin, within the configured timeout);
`Presence` turns the verdicts into what an operator reads (missed rounds, time away, one log line
each way). Everything here is pure: times come in as arguments.
The rules and why: docs/protocol/matchmaking.md
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

MAD_TO_SIGMA = 1.4826  # the MAD of a normal sample times this estimates its standard deviation
MAX_TRACKED = 64  # peers `Presence` keeps numbers for (the most recently seen); older ones are forgotten


class Progress(Protocol):
    """What the rule reads of a peer's progress record (`records.ProgressRecord`)."""

    round: int
    updated: float


def verdicts(records: Mapping[str, Progress], round: int, now: float, *, stale_after: float, lag: int = 0,
             distrusted: Collection[str] = (), members: Collection[str] = (),
             missing: Collection[str] = ()) -> dict[str, str | None]:
    """For each peer whose record is below `round`: None if the round waits for it, else why not, for
    the log. `members` finished round `round - 1`'s all-reduce with us; `missing`: `seen_missing`."""
    out: dict[str, str | None] = {}
    for peer, r in records.items():
        if r.round >= round:
            continue
        if peer in distrusted:
            out[peer] = "a reducer caught lying"
        elif r.round < round - 2 - lag and peer not in members:
            out[peer] = f"missed round {r.round + 1}"
        elif peer in missing and r.round < round - 1 - lag:
            out[peer] = f"missed round {round - 1}"
        elif now - r.updated > stale_after:
            out[peer] = f"silent for {now - r.updated:.0f} s"
        else:
            out[peer] = None
    return out


def waited_for(found: Mapping[str, str | None]) -> list[str]:
    """The peers `verdicts` says a round waits for."""
    return sorted(peer for peer, why in found.items() if why is None)


def seen_missing(expected: Collection[str], peers: Collection[str], agreed_with: Collection[str], *,
                 one_butterfly: bool, me: str) -> frozenset[str]:
    """The peers a committed round of ours expected and did without: not in its group, or (one
    butterfly) left out by the all-reduce; in a grid a member hears only its row, so the group says."""
    done = set(agreed_with) if one_butterfly else set(peers)
    return frozenset(set(expected) | set(peers)) - done - {me}


def allreduce_sample(status: str, seconds: float, size: int, contributors: Collection[str],
                     agreed_with: Collection[str], *, one_butterfly: bool) -> float | None:
    """`seconds` if an all-reduce is a sample of how long one takes (every member in time: all
    parts committed, every member's Δ in, and in one butterfly every member's mask heard), else
    None: one cut by its deadline measures the deadline, not the swarm."""
    everyone = len(contributors) == size and (not one_butterfly or len(agreed_with) == size)
    return seconds if status == "ok" and everyone else None


@dataclass
class AdaptiveDeadline:
    """A deadline learned from recent durations; `ceiling` (the configured timeout) bounds it."""

    ceiling: float
    floor: float = 1.0
    slack: float = 0.5  # seconds on top: scheduling and DHT jitter that a tight history does not show
    k: float = 4.0  # deviations above the median
    spread: float = 0.25  # the deviation is at least this fraction of the median (a very regular history)
    window: int = 16
    min_samples: int = 4
    samples: deque[float] = field(default_factory=deque)

    def observe(self, seconds: float) -> None:
        """One duration that ended because it was complete (not cut by the deadline)."""
        if seconds >= 0:
            self.samples.append(float(seconds))
            while len(self.samples) > self.window:
                self.samples.popleft()

    def current(self) -> float:
        if len(self.samples) < self.min_samples:
            return self.ceiling
        median = statistics.median(self.samples)
        mad = statistics.median(abs(x - median) for x in self.samples)
        proposed = median + self.k * max(MAD_TO_SIGMA * mad, self.spread * median) + self.slack
        return min(self.ceiling, max(self.floor, proposed))


@dataclass
class PeerPresence:
    missed_rounds: int = 0  # rounds of ours that did not wait for it
    away_seconds: float = 0.0  # time not waited for, ended stretches only (see `Presence.away`)
    away_since: float | None = None  # when the current stretch began (None: present)
    why: str | None = None  # why it is not waited for, while away
    stretch_missed: int = 0  # rounds missed in the current absence
    last_round: int = -1  # the last round we judged it at


@dataclass
class Event:
    """A change a node logs once: `peer` stopped being waited for (`back` False) or is back."""

    peer: str
    round: int
    back: bool
    why: str | None = None  # why it is not waited for (back False)
    missed: int = 0  # rounds missed in the stretch that ended (back True)
    seconds: float = 0.0  # length of that stretch (back True)

    def message(self, short: str) -> str:
        if self.back:
            return (f"peer {short} is back at round {self.round} after {self.missed} missed "
                    f"round{'s' if self.missed != 1 else ''} ({self.seconds:.1f} s away)")
        return f"peer {short} is no longer waited for from round {self.round}: {self.why}"


class Presence:
    """Per peer, the rounds it missed and the time it was away, as this node saw them."""

    def __init__(self) -> None:
        self.peers: dict[str, PeerPresence] = {}

    def update(self, round: int, found: Mapping[str, str | None], now: float, ahead: Collection[str] = ()) -> list[Event]:
        """Take round `round`'s verdicts (`verdicts`; `ahead`: peers past the round, present).
        A peer absent from both has no live record: it is away too (it left or its record expired)."""
        events: list[Event] = []
        for peer, why in found.items():
            events += self._judge(peer, round, why, now)
        for peer in ahead:
            events += self._judge(peer, round, None, now)
        for peer, p in list(self.peers.items()):
            if peer not in found and peer not in ahead and p.last_round < round:
                events += self._judge(peer, round, "no live progress record", now)
        while len(self.peers) > MAX_TRACKED:
            oldest = min(self.peers, key=lambda q: self.peers[q].last_round)
            del self.peers[oldest]
        return events

    def _judge(self, peer: str, round: int, why: str | None, now: float) -> list[Event]:
        p = self.peers.setdefault(peer, PeerPresence())
        if p.last_round >= round:
            return []
        p.last_round = round
        if why is None:
            if p.away_since is None:
                return []
            seconds, missed = now - p.away_since, p.stretch_missed
            p.away_seconds += seconds
            p.away_since, p.why, p.stretch_missed = None, None, 0
            return [Event(peer, round, back=True, missed=missed, seconds=seconds)]
        p.missed_rounds += 1
        p.stretch_missed += 1
        if p.away_since is not None:
            p.why = why
            return []
        p.away_since, p.why = now, why
        return [Event(peer, round, back=False, why=why)]

    def away(self, now: float) -> dict[str, dict[str, float | int | bool]]:
        """Per peer ever missed: ``missed`` rounds, ``away_s`` seconds (the current stretch
        included) and whether it is ``away`` now."""
        return {
            peer: {"missed": p.missed_rounds,
                   "away_s": round(p.away_seconds + (now - p.away_since if p.away_since is not None else 0.0), 1),
                   "away": p.away_since is not None}
            for peer, p in sorted(self.peers.items()) if p.missed_rounds
        }
