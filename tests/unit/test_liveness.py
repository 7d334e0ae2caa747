"""Who a round waits for and how long (`liveness`), with explicit clocks: the rule, the adaptive
deadline, the per-peer absences, and how they reach the progress record, `status` and Prometheus."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import pytest

from diloco_p2p.loop.metrics import NodeMetrics, exposition
from diloco_p2p.ops.status import format_away, format_table, status_rows
from diloco_p2p.swarm.membership.liveness import (
    AdaptiveDeadline,
    Presence,
    allreduce_sample,
    seen_missing,
    verdicts,
    waited_for,
)
from diloco_p2p.swarm.membership.records import ProgressRecord, progress_key, progress_validator
from tests.unit.dht_fixtures import NOW, PEERS, dht_record, make, subkey

STALE = 35.0


@dataclass
class Seen:
    round: int
    updated: float = NOW


def test_a_round_waits_for_peers_at_the_round_only():
    records = {
        "at": Seen(6),  # finished round 6: computing round 7 with us
        "lagging": Seen(5),  # its record of round 6 may still be on its way
        "behind": Seen(4),  # finished neither round 5 nor 6: missed them
        "far": Seen(1),  # a restarted node before its download
        "ahead": Seen(7),  # past round 7: neither waited for nor away
        "silent": Seen(6, updated=NOW - STALE - 1),  # at the round, but its heartbeat stopped
        "liar": Seen(6),
    }
    found = verdicts(records, 7, NOW, stale_after=STALE, distrusted={"liar"})
    assert "ahead" not in found
    assert found["at"] is None and found["lagging"] is None
    assert found["behind"] == "missed round 5" and found["far"] == "missed round 2"
    assert found["silent"].startswith("silent for 36")
    assert found["liar"] == "a reducer caught lying"
    assert waited_for(found) == ["at", "lagging"]


def test_under_overlap_a_record_one_round_behind_is_still_live():
    records = {"in-flight": Seen(4), "missed": Seen(3)}
    assert waited_for(verdicts(records, 7, NOW, stale_after=STALE, lag=1)) == ["in-flight"]
    assert waited_for(verdicts(records, 7, NOW, stale_after=STALE, lag=0)) == []


def test_a_record_refreshed_just_in_time_is_live():
    found = verdicts({"p": Seen(2, updated=NOW - STALE)}, 3, NOW, stale_after=STALE)
    assert found == {"p": None}


def test_the_deadline_is_the_ceiling_until_it_has_enough_samples():
    d = AdaptiveDeadline(ceiling=15.0, min_samples=4)
    for x in (0.4, 0.6, 0.5):
        d.observe(x)
        assert d.current() == 15.0
    d.observe(0.5)
    samples = [0.4, 0.6, 0.5, 0.5]
    median = statistics.median(samples)
    mad = statistics.median(abs(x - median) for x in samples)
    expected = median + d.k * max(1.4826 * mad, d.spread * median) + d.slack
    assert d.current() == pytest.approx(max(d.floor, expected))
    assert d.current() < 15.0


def test_the_deadline_follows_the_swarm_and_stays_within_its_bounds():
    d = AdaptiveDeadline(ceiling=15.0, floor=1.0, slack=0.5, window=8)
    for _ in range(8):
        d.observe(0.01)  # a very regular, very quick swarm: the floor
    assert d.current() == 1.0
    for _ in range(8):
        d.observe(3.0)  # the swarm slowed down: the window forgets the quick rounds
    assert d.current() == pytest.approx(3.0 + 4 * 0.75 + 0.5)
    for _ in range(8):
        d.observe(100.0)  # slower than the configured timeout: the timeout bounds it
    assert d.current() == 15.0


def test_a_noisy_history_widens_the_deadline():
    calm, noisy = AdaptiveDeadline(ceiling=60.0), AdaptiveDeadline(ceiling=60.0)
    for x in (1.0, 1.0, 1.1, 0.9, 1.0, 1.0):
        calm.observe(x)
    for x in (0.2, 1.0, 3.0, 0.5, 1.0, 2.5):
        noisy.observe(x)
    assert noisy.current() > calm.current()


def test_presence_logs_once_when_a_peer_leaves_and_once_when_it_is_back():
    p = Presence()
    assert p.update(1, {"a": None, "b": None}, now=100.0) == []
    (left,) = p.update(2, {"a": None, "b": "missed round 1"}, now=110.0)
    assert (left.peer, left.round, left.back) == ("b", 2, False)
    assert "no longer waited for from round 2: missed round 1" in left.message("b")
    assert p.update(3, {"a": None, "b": "missed round 1"}, now=120.0) == []  # still away: no new line
    assert p.away(now=125.0) == {"b": {"missed": 2, "away_s": 15.0, "away": True}}
    (back,) = p.update(4, {"a": None, "b": None}, now=140.0)
    assert (back.peer, back.back, back.missed, back.seconds) == ("b", True, 2, 30.0)
    assert "back at round 4 after 2 missed rounds (30.0 s away)" in back.message("b")
    assert p.away(now=500.0) == {"b": {"missed": 2, "away_s": 30.0, "away": False}}


def test_a_peer_whose_record_is_gone_is_away_and_one_ahead_is_present():
    p = Presence()
    p.update(1, {"a": None, "b": None}, now=0.0)
    events = p.update(2, {}, now=5.0, ahead=["a"])  # a is past round 2; b's record vanished
    assert [(e.peer, e.back, e.why) for e in events] == [("b", False, "no live progress record")]
    assert p.update(2, {"b": None}, now=6.0) == []  # one verdict per peer and round


def test_presence_forgets_the_oldest_peers_past_its_limit(monkeypatch):
    monkeypatch.setattr("diloco_p2p.swarm.membership.liveness.MAX_TRACKED", 3)
    p = Presence()
    for r, peer in enumerate("abcde", start=1):
        p.update(r, {peer: "missed round 0"}, now=float(r))
    assert sorted(p.peers) == ["c", "d", "e"]


def _absent(peer: str, missed: int, away_s: float, away: bool) -> dict:
    return {peer: {"missed": missed, "away_s": away_s, "away": away}}


def test_the_progress_record_carries_absences_and_storing_peers_accept_it():
    record = make(PEERS[0], away=_absent(PEERS[1], 3, 42.5, True))
    assert record.away[PEERS[1]].missed == 3
    assert ProgressRecord.parse_obj(record.dict()) == record
    assert progress_validator("r").validate(dht_record(progress_key("r"), subkey(PEERS[0]), record.dict()))
    assert make(PEERS[0], away={}).away is None  # nobody missed anything: the field stays absent
    bad = record.dict()
    bad["away"][PEERS[1]]["missed"] = -1
    assert not progress_validator("r").validate(dht_record(progress_key("r"), subkey(PEERS[0]), bad))


def test_status_shows_what_the_others_saw_of_each_peer():
    records = {
        PEERS[0]: make(PEERS[0], away={**_absent(PEERS[1], 2, 20.0, False), **_absent(PEERS[3], 9, 90.0, True)}),
        PEERS[1]: make(PEERS[1]),
        PEERS[2]: make(PEERS[2], away=_absent(PEERS[1], 4, 12.0, True)),
    }
    rows = {row["peer_id"]: row for row in status_rows(records, now=NOW)}
    assert (rows[PEERS[1]]["missed_rounds"], rows[PEERS[1]]["away_s"], rows[PEERS[1]]["away_now"]) == (4, 20.0, True)
    assert (rows[PEERS[0]]["missed_rounds"], rows[PEERS[0]]["away_now"]) == (0, False)
    table = format_table(list(rows.values()))
    assert "MISSED" in table.splitlines()[0] and "20s now" in table
    footer = format_away(status_rows(records, now=NOW))  # PEERS[3] has no record of its own
    assert "AWAY, NO RECORD" in footer and "missed 9 rounds, away 90s (now)" in footer


def test_prometheus_exports_each_peers_absences_and_the_deadlines():
    metrics = NodeMetrics()
    metrics.observe_round({"round": 5, "status": "committed", "waited_for": 2, "matchmaking_deadline": 1.75,
                           "allreduce_deadline": 6.0, "away": _absent("peerB", 3, 41.0, True)})
    text = exposition(metrics.registry).decode()
    assert 'diloco_peer_missed_rounds{peer="peerB"} 3.0' in text
    assert 'diloco_peer_away_seconds{peer="peerB"} 41.0' in text
    assert 'diloco_peer_away{peer="peerB"} 1.0' in text
    assert "diloco_peers_waited_for 2.0" in text and "diloco_matchmaking_deadline_seconds 1.75" in text
    metrics.observe_round({"round": 6, "status": "committed", "away": _absent("peerB", 3, 50.0, False)})
    assert 'diloco_peer_away{peer="peerB"} 0.0' in exposition(metrics.registry).decode()


def test_a_volunteer_cut_every_round_soon_widens_the_deadline():
    """A group the deadline closed is a sample of the deadline: a straggler that is cut round
    after round pushes the deadline up until it fits, while one cut now and then does not."""
    d = AdaptiveDeadline(ceiling=15.0, window=16)
    for _ in range(16):
        d.observe(0.5)
    quick = d.current()
    d.observe(quick)  # one fault: one censored sample
    assert d.current() == quick
    deadlines = []
    for _ in range(d.window + 4):  # a straggler that needs 6 s is cut every round, then fits
        d.observe(min(d.current(), 6.0))
        deadlines.append(d.current())
    assert deadlines[-1] >= 6.0 > quick
    assert min(deadlines) >= quick


def test_a_member_of_our_last_group_is_waited_for_before_its_record_arrives():
    """It committed round 6 with us; its records of rounds 5 and 6 may still be on their way."""
    records = {"slow-store": Seen(4), "stranger": Seen(4)}
    found = verdicts(records, 7, NOW, stale_after=STALE, members={"slow-store"})
    assert found == {"slow-store": None, "stranger": "missed round 5"}
    silent = verdicts({"slow-store": Seen(4, updated=NOW - STALE - 1)}, 7, NOW, stale_after=STALE,
                      members={"slow-store"})
    assert silent["slow-store"].startswith("silent")  # but not one that stopped heart-beating


def test_a_peer_our_last_round_did_without_is_not_waited_for_again():
    """Round 6 expected "frozen" and "dead" and closed without them (or left them out of its
    all-reduce): round 7 does not wait for them although their records (of round 5) are within the
    two-round window; one whose download has since published round 6 is waited for again."""
    records = {"frozen": Seen(5), "dead": Seen(5), "caught-up": Seen(6), "lagging": Seen(5)}
    found = verdicts(records, 7, NOW, stale_after=STALE, missing={"frozen", "dead", "caught-up"})
    assert found == {"frozen": "missed round 6", "dead": "missed round 6", "caught-up": None, "lagging": None}
    assert waited_for(found) == ["caught-up", "lagging"]
    # under overlap a record trails by the round in flight: round 5 is as good as round 6 there
    overlap = verdicts({"in-flight": Seen(5), "frozen": Seen(4)}, 7, NOW, stale_after=STALE, lag=1,
                       missing={"in-flight", "frozen"})
    assert overlap == {"in-flight": None, "frozen": "missed round 6"}


def test_who_a_committed_round_did_without():
    expected, peers = {"b", "c", "gone"}, ["me", "b", "c", "late-joiner"]
    # one butterfly: `agreed_with` covers the group, so a member whose mask never came was left out
    assert seen_missing(expected, peers, ["me", "b", "late-joiner"], one_butterfly=True, me="me") == {"gone", "c"}
    # a grid: a member hears only its row's masks; the group says who was in
    assert seen_missing(expected, peers, ["me", "b"], one_butterfly=False, me="me") == {"gone"}
    assert seen_missing(set(), ["me", "b"], ["me", "b"], one_butterfly=True, me="me") == frozenset()


def test_only_an_all_reduce_with_every_member_in_time_is_a_deadline_sample():
    everyone = ["a", "b", "c"]
    assert allreduce_sample("ok", 0.4, 3, everyone, everyone, one_butterfly=True) == 0.4
    assert allreduce_sample("partial", 5.0, 3, everyone, everyone, one_butterfly=True) is None  # a part cut
    assert allreduce_sample("failed", 5.0, 3, [], [], one_butterfly=True) is None
    assert allreduce_sample("ok", 5.0, 3, ["a", "b"], everyone, one_butterfly=True) is None  # a Δ missing
    assert allreduce_sample("ok", 5.0, 3, everyone, ["a", "b"], one_butterfly=True) is None  # a mask late
    assert allreduce_sample("ok", 0.4, 3, everyone, ["a"], one_butterfly=False) == 0.4  # a grid: row masks only


class _Swarm:
    """What `Vouching.is_vouched` and `records_at` read: its records, one scripted set per read."""

    def __init__(self, *reads):
        from diloco_p2p.swarm.vouching import Vouching

        self.reads = list(reads)
        self.vouching = Vouching(self._read_records, PEERS[8], None, "r", quorum=2, max_round=None, witnesses=set())

    async def _read_records(self):
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]


def _at(round_: int, theta: str, *peers: int) -> dict:
    return {PEERS[i]: make(PEERS[i], round=round_, params_sha256=theta * 64) for i in peers}


def test_a_state_at_the_swarms_front_is_vouched_for_once_its_quorum_has_published():
    """The newest state is announced a moment before its records (one backer, then two): a node
    catching up waits for the quorum instead of refusing the state and staying behind."""
    import asyncio

    def vouched(swarm, round_, theta, wait):
        return asyncio.run(swarm.vouching.is_vouched(round_, theta * 64, wait=wait))[0]

    one_then_two = _Swarm({**_at(8, "a", 0), **_at(7, "b", 1, 2)}, {**_at(8, "a", 0, 1), **_at(7, "b", 2)})
    assert vouched(one_then_two, 8, "a", wait=5.0)
    announced_first = _Swarm(_at(7, "b", 0, 1, 2), {**_at(8, "a", 0, 1), **_at(7, "b", 2)})
    assert vouched(announced_first, 8, "a", wait=5.0)  # one round past every record: its records follow
    assert not vouched(_Swarm({**_at(8, "a", 0), **_at(7, "b", 1, 2)}), 8, "a", wait=0.0)  # no time to wait
    assert not vouched(_Swarm(_at(7, "b", 0, 1, 2)), 9, "a", wait=5.0)  # two past the records: not the front
    assert not vouched(_Swarm(_at(9, "b", 0, 1, 2)), 8, "a", wait=5.0)  # behind the front, never vouched


def test_after_a_round_whose_group_formed_without_us_the_node_waits_for_its_records():
    """A restarted node joins the round in flight late and ends it alone; its next `before_round`
    reads the records until a quorum shows that round (the group's all-reduce ends meanwhile), so
    the rule sends it to the swarm's state now instead of after a whole lone round."""
    import asyncio
    import time

    def wait_for(swarm, round_, wait):
        return asyncio.run(swarm.vouching.records_at(round_, wait))

    # The group's records come on the third read: one backer first, then the quorum of two.
    arriving = _Swarm(_at(7, "b", 0, 1, 2), {**_at(8, "a", 0), **_at(7, "b", 1, 2)}, _at(8, "a", 0, 1, 2))
    found = wait_for(arriving, 8, wait=5.0)
    assert {r.round for r in found.values()} == {8} and not arriving.reads[1:]
    # They never come (the group failed, nobody publishes round 8 with a quorum): the wait is bounded.
    start = time.monotonic()
    never = wait_for(_Swarm({**_at(8, "a", 0), **_at(7, "b", 1, 2)}), 8, wait=0.5)
    assert 0.4 <= time.monotonic() - start < 3.0 and max(r.round for r in never.values()) == 8
    # Already there: no wait at all.
    assert {r.round for r in wait_for(_Swarm(_at(8, "a", 0, 1)), 8, wait=60.0).values()} == {8}
