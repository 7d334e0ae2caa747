"""What a node concludes from the swarm's progress records: pure functions, no DHT I/O.

`check_config` refuses a swarm whose majority config differs from ours; `vouched_records` keeps
the records that may move a node (a state counts only when `quorum` signed peers with standing
report it, `standing`); `resync_target` says whether a node must adopt the swarm's state
(behind, in a minority, or cut off while the others averaged), which one and from which donors.
Every reader applies the same rule to the same records, so all reach the same verdict; a tie of
θ hashes is broken by the donor a node follows or by the group it last committed with
(`LastGroup`), never by the hashes themselves, which an attacker could grind.
The rules: docs/protocol/records.md
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from diloco_p2p import __version__
from diloco_p2p.config import diff_swarm_fields
from diloco_p2p.errors import UserError
from diloco_p2p.swarm.membership.records import ProgressRecord


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


def reference_records(others: Mapping[str, ProgressRecord], averaged_round: int | None = None) -> dict[str, ProgressRecord]:
    """The records that speak for the swarm's state: those whose θ was averaged most recently,
    and not before our own θ was (`averaged_round`, None: not since we started).

    Each record carries `averaged_round`: the last round its θ came out of a group (committed,
    or resynced from a state that did; a node that ends rounds alone keeps the old value). A
    record whose `averaged_round` is below the newest one is *superseded*: other nodes averaged
    after its θ last did, so the swarm went on without it (a node cut off by a partition, or one
    that restarted and has not averaged yet). It does not count, even with a newer round
    number: alone rounds are often quicker than averaged ones. A node training on alone because
    every other node died is not superseded (the records those nodes left behind are no newer
    than its last averaged round). With no averaging anywhere yet, every record counts.

    Our own `averaged_round` supersedes too: a record whose θ was last averaged before ours is
    never the swarm's state for us, even when it is the newest we can read (a DHT read just after
    a partition heals may return the cut-off node's record and miss, or hold an old copy of, the
    record of the node we averaged with)."""
    ours = -1 if averaged_round is None else averaged_round
    newest = max([ours, *map(_averaged, others.values())])
    return {peer: r for peer, r in others.items() if _averaged(r) >= newest}


class LastGroup(NamedTuple):
    """The group a node last committed a round with: its own peer id, the members, the round."""

    me: str
    members: frozenset[str]
    round: int


@dataclass(frozen=True)
class Resync:
    """Download the swarm's state: of round `min_round` or later, from any donor but `exclude`;
    with `params_hash`, exactly that θ of round `min_round` (the state the swarm vouches for)."""

    min_round: int
    reason: str
    exclude: frozenset[str]
    params_hash: str | None = None


def vouched_records(
    others: Mapping[str, ProgressRecord],
    *,
    quorum: int = 1,
    max_round: int | None = None,
    on_reject: Callable[[str, str, str], None] | None = None,
    ours: tuple[int, str] | None = None,
    standing: frozenset[str] | None = None,
) -> dict[str, ProgressRecord]:
    """The records whose (round, θ hash) the swarm vouches for (see the module docstring).

    Records past `max_round` are refused (``past-max-rounds``). If some state has `quorum`
    distinct backers, only records of such states count; a record left out that claims a
    round later than every vouched state's is refused (``unvouched-state``): it would have made
    the others resync to it. Stragglers behind the vouched states are left out silently.
    `ours`, the reader's own (round, θ hash), backs that state too: the first member of our group
    to publish the round we just committed with it holds our θ, and is not refused for being
    ahead of the others' records (it was, a few times a minute, in a swarm with no fault at all).

    `standing` (`membership.standing`): the peers whose records may back a state. Given, only
    they (and `ours`) count as backers, however many others agree, and where no state has a
    quorum of them only their records count; a record of a peer without standing is kept only
    when it holds a state they back. None: every signed record counts (headcount)."""
    kept: dict[str, ProgressRecord] = {}
    for peer, r in others.items():
        if max_round is not None and r.round > max_round:
            _reject(on_reject, peer, "past-max-rounds", f"claims round {r.round} > train.max_rounds {max_round}")
        else:
            kept[peer] = r
    backing = kept if standing is None else {p: r for p, r in kept.items() if p in standing}
    backers = Counter([(r.round, r.params_sha256) for r in backing.values()] + ([ours] if ours else []))
    if not kept or max(backers.values(), default=0) < quorum:
        if standing is None:
            return kept
        held = {(r.round, r.params_sha256) for r in backing.values()}
        for peer, r in kept.items():
            if peer not in backing and (r.round, r.params_sha256) not in held and r.round > max(
                    (b.round for b in backing.values()), default=-1):
                _reject(on_reject, peer, "unvouched-state",
                        f"claims round {r.round} θ {r.params_sha256[:12]}; no peer with standing backs it")
        return {p: r for p, r in kept.items() if (r.round, r.params_sha256) in held}
    vouched = {p: r for p, r in kept.items() if backers[r.round, r.params_sha256] >= quorum}
    if not vouched:
        return {}  # only our own state has a quorum (of one): nobody else's record counts
    top = max(r.round for r in vouched.values())
    for peer, r in kept.items():
        if peer not in vouched and r.round > top:
            _reject(on_reject, peer, "unvouched-state",
                    f"claims round {r.round} θ {r.params_sha256[:12]} that {backers[r.round, r.params_sha256]} "
                    f"peer(s){' with standing' if standing is not None else ''} back (quorum {quorum}) while "
                    f"{max(backers.values())} back round {top}")
    return vouched


def vouched_state_hash(vouched: Mapping[str, ProgressRecord], round: int, params_hash: str | None,
                       standing: frozenset[str] | None = None) -> str | None:
    """The whole-state hash (`codec.state_sha256`) that the vouched records of (`round`,
    `params_hash`) publish, counting only peers with standing when given; the most published
    (None: none publishes one, e.g. records of an older release: then θ alone is checked)."""
    return majority(r.state_sha256 for p, r in vouched.items()
                    if r.round == round and r.params_sha256 == params_hash and r.state_sha256
                    and (standing is None or p in standing))


def _reject(on_reject: Callable[[str, str, str], None] | None, peer: str, reason: str, detail: str) -> None:
    if on_reject is not None:
        on_reject(peer, reason, detail)


def resync_target(
    others: Mapping[str, ProgressRecord], our_round: int, our_hash: str, averaged_round: int | None = None,
    *, quorum: int = 1, max_round: int | None = None, on_reject: Callable[[str, str, str], None] | None = None,
    group: LastGroup | None = None, donor: str | None = None, standing: frozenset[str] | None = None,
) -> Resync | None:
    """Whether a node at (`our_round`, `our_hash`), whose θ was last averaged at round
    `averaged_round` (None: not since it started), must adopt the swarm's state, and which.

    Only `vouched_records(others, quorum, max_round)` count. The swarm's state is that of their
    `reference_records` (none, when all of them were last averaged before our θ: we keep ours);
    with `top` their newest round:

    - behind (`top` > ours): download the state of round `top` with its most reported θ hash
      (any of them if several tie: each has `quorum` backers);
    - same round, another hash reported strictly more than any other, ours included: download
      it; a tie moves nobody, unless one of the two rules of the module docstring breaks it:
    - `donor`: the peer whose state we adopted, while we have not averaged since. If the tie is
      between exactly our hash and the one it holds at our round, we take its: our θ is its θ plus
      rounds we ended alone. Without this, a node that adopted a state just as its donor ended a
      round alone (the two then end a round alone each) is in a 1-1 tie with it for good. The donor
      keeps its θ: the record names its donor, and the group rule never moves a node to a
      follower's hash; a third tied hash moves nobody;
    - `group`: the group we last committed with, kept over the rounds we ended alone since
      (`tie_winner` among its members that follow nobody and last averaged in that round);
    - cut off: the reference nodes averaged after our θ last did, we ended
      `MAX_UNBACKED_ROUNDS` or more rounds since without a group, and we are ahead of them in
      round number: our rounds since hold our own data only, so go back to their state.

    Nodes whose records do not count are never asked for the state (`exclude`). The rule reads
    the same records the same way on every node, so a fork heals deterministically.
    """
    vouched = vouched_records(others, quorum=quorum, max_round=max_round, on_reject=on_reject,
                              ours=(our_round, our_hash), standing=standing)
    if not vouched:
        return None
    reference = reference_records(vouched, averaged_round)
    if not reference:
        return None  # every record we read is older news than our own θ
    exclude = frozenset(others) - frozenset(reference)
    top = max(r.round for r in reference.values())
    at_top = Counter(r.params_sha256 for r in reference.values() if r.round == top)
    if top > our_round:
        return Resync(top, f"behind: swarm at round {top}, we are at {our_round}", exclude, _unique_top(at_top))
    if top == our_round:
        counts = at_top + Counter([our_hash])
        theirs = _unique_top(counts)
        why = "differ from the swarm's"
        holders = {p: r.params_sha256 for p, r in reference.items() if r.round == top}
        if theirs is None and donor in holders and _tied(counts) == {our_hash, holders[donor]}:
            theirs, why = holders[donor], f"tie with the peer we took our state from ({donor[:12]}): follow"
        if theirs is None and group is not None:
            drawn = {p: h for p, h in holders.items() if p in group.members and reference[p].donor is None
                     and reference[p].averaged_round == group.round}
            if donor is None and averaged_round == group.round:
                drawn[group.me] = our_hash
            theirs, why = tie_winner(counts, drawn, drawn.keys(), top), "lost a tie of our group to"
        if theirs is None or theirs == our_hash:
            return None  # ours is the most reported, or a tie: never move to an arbitrary hash
        return Resync(top, f"our parameters {our_hash[:12]} {why} {theirs[:12]} at round {top}", exclude, theirs)
    ours = -1 if averaged_round is None else averaged_round
    theirs = _averaged(next(iter(reference.values())))
    if theirs > ours and our_round - ours >= MAX_UNBACKED_ROUNDS:
        return Resync(
            top,
            f"our rounds {ours + 1}..{our_round} ended without a group while {len(reference)} "
            f"node(s) averaged up to round {theirs}: we were cut off; back to the swarm's state",
            exclude, _unique_top(at_top),
        )
    return None


def tie_winner(counts: Counter[str], holders: Mapping[str, str], group: Collection[str], round: int) -> str | None:
    """Among the hashes tied for the most reports (`counts`), the one whose holder (peer -> hash)
    in `group` has the smallest sha256(peer id, round); None if no member of `group` holds one."""
    tied = _tied(counts)
    eligible = [p for p, h in holders.items() if h in tied and p in group]
    if not eligible:
        return None
    return holders[min(eligible, key=lambda p: hashlib.sha256(f"{p}:{round}".encode()).hexdigest())]


def _tied(counts: Counter[str]) -> set[str]:
    """The values reported most often (several: a tie)."""
    best = max(counts.values(), default=0)
    return {h for h, c in counts.items() if c == best}


def _unique_top(counts: Counter[str]) -> str | None:
    """The most frequent value, or None when several are the most frequent."""
    ranked = counts.most_common(2)
    if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
        return None
    return ranked[0][0]


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
