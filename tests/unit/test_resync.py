"""What a node concludes from the swarm's progress records: config refusal, majorities, resync."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest

from diloco_p2p.config import Config
from diloco_p2p.errors import UserError
from diloco_p2p.swarm.membership.resync import (
    MAX_UNBACKED_ROUNDS,
    LastGroup,
    Resync,
    check_config,
    majority,
    reference_records,
    resync_target,
    round_majorities,
    tie_winner,
    vouched_records,
)
from tests.unit.dht_fixtures import PEERS, make

# ---------------------------------------------------------------- config refusal


def test_check_config_lists_differing_fields():
    theirs = Config(run_id="r", outer={"lr": 0.5})
    ours = Config(run_id="r")
    records = {p: make(p, cfg=theirs) for p in PEERS[:3]}
    records[PEERS[3]] = make(PEERS[3], cfg=ours)  # a minority agrees with us
    with pytest.raises(UserError) as e:
        check_config(records, ours.swarm_view(), ours.swarm_hash(), our_peer=PEERS[6])
    msg = str(e.value)
    assert msg.startswith("config differs from the swarm's (3 peers): outer.lr: 0.7 != 0.5")
    assert "\n" not in msg


def test_a_node_of_another_all_reduce_protocol_is_refused_by_name():
    """Nodes that cannot average with each other differ in their views' protocol and say so."""
    ours = Config(run_id="r")
    older = {**ours.swarm_view(), "protocol": 4}
    record = make(PEERS[0], config_view=older, config_hash=hashlib.sha256(
        json.dumps(older, sort_keys=True).encode()).hexdigest())
    with pytest.raises(UserError, match=r"protocol: 5 != 4"):
        check_config({PEERS[0]: record}, ours.swarm_view(), ours.swarm_hash(), PEERS[6])


def test_check_config_lists_every_differing_field():
    theirs = Config(run_id="r", outer={"lr": 0.5, "inner_steps": 20}, sync={"compression": "int8"})
    ours = Config(run_id="r")
    with pytest.raises(UserError) as e:
        check_config({PEERS[0]: make(PEERS[0], cfg=theirs)}, ours.swarm_view(), ours.swarm_hash(), PEERS[6])
    msg = str(e.value)
    for part in (
        "outer.lr: 0.7 != 0.5",
        "outer.inner_steps: 500 != 20",
        "sync.compression: 'fp16' != 'int8'",
    ):
        assert part in msg
    assert "inner.batch_size" not in msg  # not a swarm field


def test_check_config_accepts_agreement_solitude_and_ties():
    ours, other = Config(run_id="r"), Config(run_id="r", seed=1)
    view, h = ours.swarm_view(), ours.swarm_hash()
    check_config({}, view, h, PEERS[0])
    # our own (stale) record with another config is not "the swarm"
    check_config({PEERS[0]: make(PEERS[0], cfg=other)}, view, h, PEERS[0])
    check_config({p: make(p, cfg=ours) for p in PEERS[1:3]}, view, h, PEERS[0])
    check_config({PEERS[1]: make(PEERS[1], cfg=ours), PEERS[2]: make(PEERS[2], cfg=other)}, view, h, PEERS[0])


def test_check_config_same_fields_different_hash_blames_versions():
    ours = Config(run_id="r")
    rec = make(PEERS[1], cfg=ours, config_hash="b" * 64, version="9.9.9")
    with pytest.raises(UserError, match="another diloco-p2p version.*9.9.9"):
        check_config({PEERS[1]: rec}, ours.swarm_view(), ours.swarm_hash(), PEERS[0])


# ---------------------------------------------------------------- majorities


def test_round_majorities_per_round():
    records = {
        PEERS[0]: make(PEERS[0], round=3, params_sha256="c" * 64),
        PEERS[1]: make(PEERS[1], round=3, params_sha256="b" * 64),
        PEERS[2]: make(PEERS[2], round=3, params_sha256="c" * 64),
        PEERS[3]: make(PEERS[3], round=2, params_sha256="d" * 64),
    }
    assert round_majorities(records) == {3: "c" * 64, 2: "d" * 64}


H = {c: c * 64 for c in "abcdef"}


def test_resync_when_behind_even_if_more_nodes_agree_on_an_older_round():
    records = {
        PEERS[0]: make(PEERS[0], round=3, params_sha256=H["c"]),
        PEERS[1]: make(PEERS[1], round=2, params_sha256=H["d"]),
        PEERS[2]: make(PEERS[2], round=2, params_sha256=H["d"]),
    }
    target = resync_target(records, 2, H["d"])
    assert target is not None and target.min_round == 3 and target.exclude == frozenset()
    assert "behind" in target.reason
    assert resync_target(records, 3, H["c"]) is None
    assert resync_target({}, 0, H["a"]) is None


def test_resync_when_in_a_minority_at_our_round():
    records = {PEERS[0]: make(PEERS[0], round=3, params_sha256=H["c"]),
               PEERS[1]: make(PEERS[1], round=3, params_sha256=H["c"])}
    target = resync_target(records, 3, H["b"])
    assert target is not None and target.min_round == 3 and "differ" in target.reason
    assert target.params_hash == H["c"]  # exactly the θ the two report
    # one against one: a tie moves nobody, whichever hash is smaller (a liar can grind its hash)
    one = {PEERS[0]: make(PEERS[0], round=3, params_sha256=H["c"])}
    assert resync_target(one, 3, H["b"]) is None
    assert resync_target({PEERS[1]: make(PEERS[1], round=3, params_sha256=H["b"])}, 3, H["c"]) is None


def test_a_node_cut_off_and_ahead_does_not_pull_the_averaging_nodes_back():
    """A partitioned node ended rounds 3..9 alone and is 'ahead' of the two nodes that kept
    averaging (round 8). They must not download its state; it must go back to theirs."""
    lone = PEERS[2]
    seen_by_a = {PEERS[1]: make(PEERS[1], round=8, params_sha256=H["b"], averaged_round=8),
                 lone: make(lone, round=9, params_sha256=H["e"], status="alone", group_size=1, averaged_round=2)}
    assert resync_target(seen_by_a, 8, H["b"], averaged_round=8) is None
    assert reference_records(seen_by_a).keys() == {PEERS[1]}
    # a at round 7 (it just fell behind b): catches up with b, and never from the lone node
    target = resync_target(seen_by_a, 7, H["a"], averaged_round=7)
    assert target is not None and target.min_round == 8 and target.exclude == {lone}

    seen_by_lone = {p: make(p, round=8, params_sha256=H["b"], averaged_round=8) for p in PEERS[:2]}
    # one round alone can be a group that formed without us: no step back yet
    assert resync_target(seen_by_lone, 9, H["e"], averaged_round=8) is None
    target = resync_target(seen_by_lone, 9, H["e"], averaged_round=2)
    assert target is not None and target.min_round == 8 and target.exclude == frozenset()
    assert "cut off" in target.reason


def test_lineages_of_one_averaged_round_merge_to_the_furthest_ahead_and_the_cut_off_one_never():
    """After a partition heals, c goes back to a's round-5 state (it inherits averaged_round 5),
    then all three end rounds alone while the links recover: a at 7, b at 7 (its round 5 failed:
    last averaged at 4), c at 9. Lineages of equal standing: a and b both take c's round 9, so the
    three meet again (CI saw this). c's record from before its return (last averaged at 1) moves
    nobody, however far ahead."""
    a, b, c = PEERS[:3]
    rec = {a: make(a, round=7, params_sha256=H["a"], status="alone", group_size=1, averaged_round=5),
           b: make(b, round=7, params_sha256=H["b"], status="alone", group_size=1, averaged_round=4),
           c: make(c, round=9, params_sha256=H["c"], status="alone", group_size=1, averaged_round=5)}
    for me, averaged in ((a, 5), (b, 4)):
        target = resync_target({p: r for p, r in rec.items() if p != me}, 7, rec[me].params_sha256,
                               averaged_round=averaged)
        assert target is not None and (target.min_round, target.params_hash) == (9, H["c"])
        assert target.exclude == ({b} if me == a else frozenset())  # b reads a as a reference too
    assert resync_target({a: rec[a], b: rec[b]}, 9, H["c"], averaged_round=5) is None  # c keeps its own
    cut_off = make(c, round=9, params_sha256=H["e"], status="alone", group_size=1, averaged_round=1)
    assert resync_target({b: rec[b], c: cut_off}, 7, H["a"], averaged_round=5) is None


def test_records_averaged_before_our_own_theta_never_move_us():
    """Just after a partition heals, a DHT read may return the cut-off node's record (ahead in
    round number, last averaged at round 1) and miss the record of the node we averaged with, or
    return an old copy of it. We averaged at round 4: neither is the swarm's state for us."""
    lone = make(PEERS[2], round=6, params_sha256=H["e"], status="alone", group_size=1, averaged_round=1)
    old_copy = make(PEERS[1], round=1, params_sha256=H["b"], averaged_round=1)
    for seen in ({PEERS[2]: lone}, {PEERS[2]: lone, PEERS[1]: old_copy}):
        assert resync_target(seen, 5, H["a"], averaged_round=4) is None
        assert reference_records(seen, averaged_round=4) == {}
        # the same view for a node that has not averaged since it started (a joiner): c leads
        target = resync_target(seen, 0, H["f"])
        assert target is not None and target.min_round == 6 and target.params_hash == H["e"]
    # a node we averaged with, at our averaged round, still counts
    partner = make(PEERS[1], round=6, params_sha256=H["b"], averaged_round=4)
    target = resync_target({PEERS[2]: lone, PEERS[1]: partner}, 5, H["a"], averaged_round=4)
    assert target is not None and target.min_round == 6 and target.params_hash == H["b"]
    assert target.exclude == {PEERS[2]}


def test_the_last_node_standing_is_the_swarm():
    """B died after round 2 (its committed record lingers until its TTL); A trains on alone.
    A joiner must take A's state, and A must not go back to B's."""
    dead = make(PEERS[1], round=2, params_sha256=H["b"], averaged_round=2)
    alive = make(PEERS[0], round=4, params_sha256=H["a"], status="alone", group_size=1, averaged_round=2)
    records = {PEERS[0]: alive, PEERS[1]: dead}
    target = resync_target(records, 0, H["f"])
    assert target is not None and target.min_round == 4 and target.exclude == frozenset()
    assert resync_target({PEERS[1]: dead}, 4, H["a"], averaged_round=2) is None
    # the joiner resynced from A: it inherits A's averaged round, so it does not supersede A
    # (if it did, A would go back to the joiner's copy of A's own state, and the two leapfrog)
    joiner = make(PEERS[2], round=4, params_sha256=H["a"], status="resynced", group_size=0, averaged_round=2)
    assert resync_target({PEERS[1]: dead, PEERS[2]: joiner}, 5, H["c"], averaged_round=2) is None


def test_a_stale_record_of_a_cut_off_node_does_not_pull_us_back():
    """The lone node's last record (committed at round 2) stays in the DHT until its TTL ends.
    For the two nodes still averaging it is old news, even when they themselves ended a few
    rounds alone (say, they lost each other for a while)."""
    stale = {PEERS[2]: make(PEERS[2], round=2, params_sha256=H["c"], averaged_round=2),
             PEERS[1]: make(PEERS[1], round=8, params_sha256=H["d"], status="alone", group_size=1, averaged_round=5)}
    assert resync_target(stale, 8, H["a"], averaged_round=5) is None
    # a node that has not averaged since it started goes back to an averaging swarm
    fresh = {PEERS[1]: make(PEERS[1], round=4, params_sha256=H["d"], averaged_round=4)}
    target = resync_target(fresh, 6, H["a"], averaged_round=None)
    assert target is not None and target.min_round == 4
    # ...but not when the swarm holds our own round and hash
    same = {PEERS[1]: make(PEERS[1], round=6, params_sha256=H["a"], averaged_round=6)}
    assert resync_target(same, 6, H["a"]) is None


def test_without_averaging_nodes_every_record_counts():
    """Nobody averaged yet (a swarm just started, or every node alone): the newest round leads."""
    records = {PEERS[0]: make(PEERS[0], round=9, params_sha256=H["e"], status="alone", group_size=1),
               PEERS[1]: make(PEERS[1], round=0, params_sha256=H["a"], status="started", group_size=0)}
    target = resync_target(records, 4, H["c"])
    assert target is not None and target.min_round == 9 and target.exclude == frozenset()
    # ahead of everyone and nobody averages: nothing to go back to
    assert resync_target(records, 12, H["c"]) is None


def test_majority_ties_break_the_same_way_everywhere():
    assert majority(["f", "e", "f", "e"]) == "e"
    assert majority(["e", "f", "f", "e"]) == "e"
    assert majority([]) is None


# ---------------------------------------------------------------- one case per rule

SWARM_AT_5 = {p: make(p, round=5, params_sha256=H["c"], averaged_round=5) for p in PEERS[:2]}


@pytest.mark.parametrize(
    ("others", "ours", "expected"),
    [
        pytest.param(  # two rounds behind: download a state of the swarm's round
            SWARM_AT_5, dict(our_round=3, our_hash=H["a"], averaged_round=3),
            Resync(5, "behind: swarm at round 5, we are at 3", frozenset(), H["c"]),
            id="behind",
        ),
        pytest.param(  # c, c against our d at our round: the majority wins
            {**SWARM_AT_5, PEERS[2]: make(PEERS[2], round=5, params_sha256=H["b"], averaged_round=5)},
            dict(our_round=5, our_hash=H["d"], averaged_round=5),
            Resync(5, f"our parameters {H['d'][:12]} differ from the swarm's {H['c'][:12]} at round 5", frozenset(),
                   H["c"]),
            id="minority-hash",
        ),
        pytest.param(  # ahead in rounds, but averaged last at 2 while the swarm averaged at 5
            {**SWARM_AT_5, PEERS[3]: make(PEERS[3], round=3, params_sha256=H["e"], averaged_round=1)},
            dict(our_round=2 + MAX_UNBACKED_ROUNDS + 4, our_hash=H["f"], averaged_round=2),
            Resync(
                5,
                "our rounds 3..8 ended without a group while 2 node(s) averaged up to round 5: "
                "we were cut off; back to the swarm's state",
                frozenset({PEERS[3]}),  # superseded too: never a donor
                H["c"],
            ),
            id="cut-off",
        ),
        pytest.param(  # one against one at our round: the smaller hash stays
            {PEERS[0]: make(PEERS[0], round=5, params_sha256=H["b"], averaged_round=5)},
            dict(our_round=5, our_hash=H["a"], averaged_round=5), None,
            id="tie-we-hold-the-smaller-hash",
        ),
        pytest.param(  # ...and when they hold it: a tie never moves a node
            {PEERS[0]: make(PEERS[0], round=5, params_sha256=H["b"], averaged_round=5)},
            dict(our_round=5, our_hash=H["c"], averaged_round=5), None,
            id="tie-they-hold-the-smaller-hash",
        ),
        pytest.param(SWARM_AT_5, dict(our_round=5, our_hash=H["c"], averaged_round=5), None, id="in-step"),
        pytest.param(  # one round alone past the swarm: may be a group that formed without us
            SWARM_AT_5, dict(our_round=6, our_hash=H["e"], averaged_round=5), None, id="one-round-alone",
        ),
        pytest.param({}, dict(our_round=0, our_hash=H["a"]), None, id="nobody-else"),
    ],
)
def test_resync_target_rules(others, ours, expected):
    assert resync_target(others, **ours) == expected


def test_majority_ties_are_broken_by_the_smallest_value():
    assert majority(["b", "a"]) == majority(["a", "b"]) == "a"
    assert majority(["b", "b", "a"]) == "b"  # a tie only when the counts are equal


# ---------------------------------------------------------------- the swarm vouches (issue 12)

HONEST = {p: make(p, round=5, params_sha256=H["c"], averaged_round=5) for p in PEERS[:3]}


def _refusals():
    seen: list[tuple[str, str, str]] = []
    return seen, lambda *a: seen.append(a)


def test_a_lone_record_claiming_a_later_round_moves_nobody_and_is_named():
    """The forged-record attack: a peer publishes round 999 (and serves a made-up θ with a
    matching sha256). Three honest nodes at round 5 agree: nobody resyncs to it."""
    liar = make(PEERS[6], round=999, params_sha256=H["f"], averaged_round=999)
    others = {**{p: HONEST[p] for p in PEERS[1:3]}, PEERS[6]: liar}
    seen, on_reject = _refusals()
    assert resync_target(others, 5, H["c"], 5, quorum=2, on_reject=on_reject) is None
    assert [(p, r) for p, r, _ in seen] == [(PEERS[6], "unvouched-state")]
    # a node that is behind goes to the honest round, exactly their θ, never to the liar's
    target = resync_target({**HONEST, PEERS[6]: liar}, 3, H["a"], 3, quorum=2)
    assert target is not None and (target.min_round, target.params_hash) == (5, H["c"])
    # quorum 1 (the old rule) would have followed it: the test above can fail
    assert resync_target(others, 5, H["c"], 5, quorum=1).min_round == 999


def test_a_superseding_averaged_round_does_not_make_honest_records_stale():
    liar = make(PEERS[6], round=5, params_sha256=H["f"], averaged_round=500)
    assert resync_target({**HONEST, PEERS[6]: liar}, 5, H["c"], 5, quorum=2) is None


def test_never_past_max_rounds():
    """Even two peers backing a round past train.max_rounds do not move us there."""
    ahead = {p: make(p, round=50, params_sha256=H["f"], averaged_round=50) for p in PEERS[5:7]}
    seen, on_reject = _refusals()
    assert resync_target({**HONEST, **ahead}, 5, H["c"], 5, quorum=2, max_round=10, on_reject=on_reject) is None
    assert {(p, r) for p, r, _ in seen} == {(PEERS[5], "past-max-rounds"), (PEERS[6], "past-max-rounds")}
    assert "train.max_rounds 10" in seen[0][2]
    # within max_rounds the same two would be followed (they have a quorum and the newest round)
    assert resync_target({**HONEST, **ahead}, 5, H["c"], 5, quorum=2, max_round=50).min_round == 50


def test_without_any_quorum_every_record_counts():
    """A joiner with one established node in the swarm: nothing has a quorum of 2, so the
    lone node's state is the swarm's (an open run cannot tell it from a liar: docs/threat-model.md)."""
    one = {PEERS[1]: make(PEERS[1], round=7, params_sha256=H["d"], status="alone", group_size=1)}
    assert vouched_records(one, quorum=2) == one
    target = resync_target(one, 0, H["a"], quorum=2)
    assert target is not None and (target.min_round, target.params_hash) == (7, H["d"])


def test_vouched_records_leave_stragglers_out_silently():
    straggler = make(PEERS[5], round=2, params_sha256=H["a"])
    seen, on_reject = _refusals()
    assert vouched_records({**HONEST, PEERS[5]: straggler}, quorum=2, on_reject=on_reject) == HONEST
    assert seen == []


def test_behind_with_two_vouched_hashes_at_the_top_round_takes_whichever_a_donor_has():
    split = {**{p: make(p, round=5, params_sha256=H["c"]) for p in PEERS[:2]},
             **{p: make(p, round=5, params_sha256=H["d"]) for p in PEERS[2:4]}}
    target = resync_target(split, 3, H["a"], quorum=2)
    assert target is not None and target.min_round == 5 and target.params_hash is None


def test_a_tie_within_our_last_group_is_broken_the_same_way_by_both_sides():
    """A 1-1 fork of a group of two: each side sees the other's record. With the group known, both
    pick the hash of the member with the smallest sha256(peer id, round): exactly one moves."""
    a, b = PEERS[0], PEERS[1]
    for round in range(6):
        rec = {a: make(a, round=round, params_sha256=H["a"], averaged_round=round),
               b: make(b, round=round, params_sha256=H["b"], averaged_round=round)}
        group = frozenset({a, b})
        seen_by_a = resync_target({b: rec[b]}, round, H["a"], round, quorum=2, group=LastGroup(a, group, round))
        seen_by_b = resync_target({a: rec[a]}, round, H["b"], round, quorum=2, group=LastGroup(b, group, round))
        winner = min((a, b), key=lambda p: hashlib.sha256(f"{p}:{round}".encode()).hexdigest())
        loser_target, winner_target = (seen_by_b, seen_by_a) if winner == a else (seen_by_a, seen_by_b)
        assert winner_target is None
        assert loser_target is not None and loser_target.params_hash == rec[winner].params_sha256
        assert loser_target.min_round == round and "tie" in loser_target.reason
        # without the group (or with a peer outside it), a tie moves nobody
        assert resync_target({b: rec[b]}, round, H["a"], round, quorum=2) is None
        stranger = PEERS[5]
        claim = {stranger: make(stranger, round=round, params_sha256=H["c"], averaged_round=round)}
        assert resync_target(claim, round, H["a"], round, quorum=2, group=LastGroup(a, group, round)) is None


def _tie_of_two(a: str, b: str, round: int, averaged: int, *, donor_of_b: str | None = None):
    """What a and b conclude at `round` (a 1-1 tie) when both last committed round `averaged`
    together and b may follow a donor."""
    rec_a = make(a, round=round, params_sha256=H["a"], averaged_round=averaged, status="alone")
    rec_b = make(b, round=round, params_sha256=H["b"], averaged_round=averaged, status="alone", donor=donor_of_b)
    group = frozenset({a, b})
    seen_by_a = resync_target({b: rec_b}, round, H["a"], averaged, quorum=2, group=LastGroup(a, group, averaged))
    seen_by_b = resync_target({a: rec_a}, round, H["b"], averaged, quorum=2, group=LastGroup(b, group, averaged),
                              donor=donor_of_b)
    return seen_by_a, seen_by_b


def test_two_nodes_that_split_after_committing_together_merge_again_whatever_rounds_they_ended_alone():
    """A swarm of two that committed round 3 together, then each ended rounds alone (a matchmaking
    race): their keys hold different θ, so they never meet again unless the tie breaks. The group
    of round 3 is kept over the lone rounds: at any later round exactly one of them moves, to the
    hash of the member with the smallest sha256(peer id, round)."""
    a, b = PEERS[0], PEERS[1]
    for round in range(4, 12):
        seen_by_a, seen_by_b = _tie_of_two(a, b, round, averaged=3)
        winner = min((a, b), key=lambda p: hashlib.sha256(f"{p}:{round}".encode()).hexdigest())
        moved, stayed = (seen_by_b, seen_by_a) if winner == a else (seen_by_a, seen_by_b)
        assert stayed is None
        assert moved is not None and moved.params_hash == H["a" if winner == a else "b"] and moved.min_round == round


def test_a_follower_of_a_donor_is_never_drawn_by_its_donors_group_so_only_it_moves():
    """b restarted, took a's state (a was a member of b's group before the crash; b, a fresh process,
    knows no group of its own) and ended a round alone, as a did. b follows a (the donor rule) and
    its record says so; a must not move to b's hash by the group rule at any round (the two would
    swap θ and tie again for good). The same when b keeps the group (it lost a tie and downloaded)."""
    a, b = PEERS[0], PEERS[1]
    for round in range(4, 12):
        seen_by_a, seen_by_b = _tie_of_two(a, b, round, averaged=3, donor_of_b=a)
        assert seen_by_a is None
        assert seen_by_b is not None and seen_by_b.params_hash == H["a"]
        rec_b = make(b, round=round, params_sha256=H["b"], averaged_round=3, status="alone", donor=a)
        assert resync_target({b: rec_b}, round, H["a"], 3, quorum=2, group=LastGroup(a, frozenset({a, b}), 3)) is None


def test_the_group_rule_draws_only_members_that_last_averaged_in_the_groups_round():
    """A member that has averaged since (with others) is no longer of our split group, and we are not
    either once our own θ was averaged since: nobody moves by the group rule then."""
    a, b = PEERS[0], PEERS[1]
    group = frozenset({a, b})
    for round in range(5, 12):
        later = make(b, round=round, params_sha256=H["b"], averaged_round=4, status="alone")
        assert resync_target({b: later}, round, H["a"], 3, quorum=2, group=LastGroup(a, group, 3)) is None
        rec_a = make(a, round=round, params_sha256=H["a"], averaged_round=3, status="alone")
        assert resync_target({a: rec_a}, round, H["b"], 4, quorum=2, group=LastGroup(b, group, 3)) is None


def test_tie_winner_ignores_the_hashes_and_peers_outside_the_group():
    counts = Counter({H["a"]: 2, H["b"]: 2, H["c"]: 1})
    holders = {PEERS[0]: H["a"], PEERS[1]: H["b"], PEERS[2]: H["c"], PEERS[3]: H["a"]}
    assert tie_winner(counts, holders, {PEERS[2]}, 4) is None  # its hash is not among the tied
    assert tie_winner(counts, holders, {PEERS[1]}, 4) == H["b"]
    both = tie_winner(counts, holders, set(holders), 4)
    assert both == tie_winner(counts, dict(reversed(list(holders.items()))), set(holders), 4)


def test_a_node_that_took_its_donors_state_follows_it_in_a_tie_and_the_donor_stays():
    """The 1-1 lock of a swarm of two: d adopted a's round-3 state just as a ended round 4 alone;
    d then ended round 4 alone too. Each sees the other at round 4 with another θ hash, and no
    group of theirs breaks the tie. d, which has not averaged since it took a's state, follows a;
    a (d is not its donor) keeps its θ; a stranger's tied hash moves d nowhere."""
    a, d, stranger = PEERS[0], PEERS[1], PEERS[5]
    rec_a = make(a, round=4, params_sha256=H["a"], averaged_round=2, status="alone")
    rec_d = make(d, round=4, params_sha256=H["d"], averaged_round=2, status="alone")
    seen_by_d = resync_target({a: rec_a}, 4, H["d"], 2, quorum=2, donor=a)
    assert seen_by_d is not None and seen_by_d.params_hash == H["a"] and seen_by_d.min_round == 4
    assert "took our state from" in seen_by_d.reason
    assert resync_target({d: rec_d}, 4, H["a"], 2, quorum=2) is None  # a has no donor
    assert resync_target({d: rec_d}, 4, H["a"], 2, quorum=2, donor=stranger) is None
    # only a tie of exactly our hash and the donor's moves us (a third hash tied: nobody moves), and a
    # majority elsewhere beats the donor as it beats anyone
    claim = {stranger: make(stranger, round=4, params_sha256=H["c"], averaged_round=2)}
    assert resync_target({a: rec_a, **claim}, 4, H["d"], 2, quorum=2, donor=stranger) is None
    assert resync_target({a: rec_a, **claim}, 4, H["d"], 2, quorum=2, donor=a) is None
    pair = {p: make(p, round=4, params_sha256=H["c"], averaged_round=2) for p in PEERS[2:4]}
    assert resync_target({a: rec_a, **pair}, 4, H["d"], 2, quorum=2, donor=a).params_hash == H["c"]


def test_the_first_member_to_publish_the_round_we_hold_too_is_not_refused():
    """We just committed round 6 with a and b; a published its record of round 6 first, b's of
    round 5 is still the newest it has. a's state is ours: it is vouched for (we back it), not an
    unvouched claim ahead of the others, and nobody moves. A lone claim of a state we do not hold is
    still refused, and we back our own state only."""
    a, b, liar = PEERS[0], PEERS[1], PEERS[6]
    ahead = {a: make(a, round=6, params_sha256=H["d"], averaged_round=6),
             b: make(b, round=5, params_sha256=H["c"], averaged_round=5),
             PEERS[2]: make(PEERS[2], round=5, params_sha256=H["c"], averaged_round=5)}
    seen, on_reject = _refusals()
    assert resync_target(ahead, 6, H["d"], 6, quorum=2, on_reject=on_reject) is None
    assert seen == []
    assert set(vouched_records(ahead, quorum=2, ours=(6, H["d"]))) == set(ahead)  # round 5 has its two too
    assert resync_target(ahead, 6, H["e"], 6, quorum=2, on_reject=on_reject) is None  # we hold another θ
    assert [(p, r) for p, r, _ in seen] == [(a, "unvouched-state")]
    # our backing never vouches for a claim of another round, nor stands alone
    lone = {liar: make(liar, round=9, params_sha256=H["f"], averaged_round=9), **dict(list(ahead.items())[1:])}
    assert set(vouched_records(lone, quorum=2, ours=(6, H["d"]))) == {b, PEERS[2]}
    assert vouched_records({}, quorum=2, ours=(6, H["d"])) == {}
