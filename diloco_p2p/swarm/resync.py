"""What a node concludes from the swarm's progress records: pure functions, no DHT I/O
(the records are read by `diloco_p2p.swarm.records`).

- `check_config`: refuse to join a swarm whose majority config differs from ours, naming the
  differing fields.
- `resync_target`: whether a node must adopt the swarm's state (behind, in a minority at its
  round, or cut off while the others averaged), and from which donors.

Every reader applies the same rule to the same records, so every node reaches the same verdict
without talking to the others; ties go to the smallest value for the same reason.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from diloco_p2p import __version__
from diloco_p2p.config import diff_swarm_fields
from diloco_p2p.errors import UserError
from diloco_p2p.swarm.records import ProgressRecord


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
        return Resync(
            top,
            f"our parameters {our_hash[:12]} differ from the swarm's {theirs[:12]} at round {top}",
            exclude,
        )
    ours = -1 if averaged_round is None else averaged_round
    theirs = _averaged(next(iter(reference.values())))
    if theirs > ours and our_round - ours >= MAX_UNBACKED_ROUNDS:
        return Resync(
            top,
            f"our rounds {ours + 1}..{our_round} ended without a group while {len(reference)} "
            f"node(s) averaged up to round {theirs}: we were cut off; back to the swarm's state",
            exclude,
        )
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
