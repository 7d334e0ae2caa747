"""Standing, not headcount: fresh identities backing a made-up later state move no node that has
peers it committed rounds with; a newcomer follows the peers the run's witness trusts."""

from __future__ import annotations

import hashlib

import pytest
from hivemind.p2p import PeerID

from diloco_p2p.swarm.membership.resync import resync_target, vouched_records, vouched_state_hash
from diloco_p2p.swarm.membership.standing import Standing, Witness
from tests.unit.dht_fixtures import make


def peer(name: str) -> str:
    """A well-formed peer id (a sha256 multihash), distinct per name."""
    return PeerID(b"\x12\x20" + hashlib.sha256(name.encode()).digest()).to_base58()


HONEST = [peer(f"honest-{i}") for i in range(4)]
SYBILS = [peer(f"sybil-{i}") for i in range(10)]
ME, OTHERS = HONEST[0], HONEST[1:]
THETA, FORGED = "a" * 64, "f" * 64


def _swarm(k: int, claim_round: int = 9) -> dict:
    """Three honest peers at round 3 (θ `THETA`, having committed it together with us), and `k`
    Sybils that each publish round `claim_round` with one made-up θ."""
    group = sorted(HONEST)
    records = {p: make(p, round=3, params_sha256=THETA, averaged_round=3, members=group) for p in OTHERS}
    records |= {s: make(s, round=claim_round, params_sha256=FORGED, averaged_round=claim_round, members=SYBILS[:k])
                for s in SYBILS[:k]}
    return records


@pytest.mark.parametrize("k", range(1, 11))
def test_k_fresh_identities_move_no_node_with_standing(k):
    records = _swarm(k)
    standing = Standing(ME)
    standing.committed(HONEST, 3)
    refused = []
    target = resync_target(records, 3, THETA, 3, quorum=2, standing=standing.among(records),
                           on_reject=lambda p, reason, why: refused.append((p, reason)))
    assert target is None
    assert {p for p, reason in refused if reason == "unvouched-state"} == set(SYBILS[:k])


def test_without_standing_two_identities_take_over_which_is_what_standing_closes():
    records = _swarm(2)
    target = resync_target(records, 3, THETA, 3, quorum=2)  # headcount: 2 backers make a quorum
    assert target is not None and target.params_hash == FORGED


def test_a_standing_peer_ahead_still_moves_us_and_sybils_cannot_join_its_quorum():
    """An honest peer one round ahead (we ended a round late) is followed; Sybils claiming the
    same round with another θ add nothing to either side."""
    records = _swarm(5, claim_round=4)
    for p in OTHERS:
        records[p] = make(p, round=4, params_sha256="b" * 64, averaged_round=4, members=sorted(HONEST))
    standing = Standing(ME)
    standing.committed(HONEST, 3)
    target = resync_target(records, 3, THETA, 3, quorum=2, standing=standing.among(records))
    assert target is not None and (target.min_round, target.params_hash) == (4, "b" * 64)


def test_with_no_quorum_of_standing_only_standing_records_count():
    """Two nodes (quorum 2, so no state has a quorum when they differ): the Sybils' later round is
    refused instead of counting as it would by headcount."""
    me, other = HONEST[:2]
    records = {other: make(other, round=3, params_sha256=THETA, averaged_round=2, members=[me, other])}
    records |= {s: make(s, round=8, params_sha256=FORGED, averaged_round=8) for s in SYBILS[:1]}
    standing = Standing(me)
    standing.committed([me, other], 2)
    kept = vouched_records(records, quorum=3, standing=standing.among(records))
    assert set(kept) == {other}


def test_standing_reaches_one_hop_through_the_members_a_standing_peer_names():
    a, b, c, d = HONEST
    standing = Standing(a)
    standing.committed([a, b], 1)
    records = {b: make(b, members=[b, c]), c: make(c, members=[c, SYBILS[0]]), SYBILS[0]: make(SYBILS[0], members=[SYBILS[0], d])}
    assert standing.peers(records) == {b, c}  # c: named by b; the Sybil named only by c (two hops) is not
    assert standing.among({SYBILS[0]: records[SYBILS[0]]}) is None  # no standing peer present: no view


def _started(*peers: str) -> dict:
    return {p: make(p, round=0, status="started", averaged_round=None) for p in peers}


def test_the_witness_trusts_the_first_group_it_saw_start_and_grows_only_through_trusted_records():
    a, b, c, d = HONEST
    witness = Witness()
    assert witness.observe(_started(a, b, c)) == frozenset() and not witness.abstains
    # The first committed group: every member's record names it (the witness may miss round 1).
    first = {p: make(p, round=2, averaged_round=2, members=[a, b, c]) for p in (a, b, c)}
    assert witness.observe(first) == {a, b, c}
    # Later, d commits with b; Sybils form their own group, naming each other and also b.
    later = dict(first)
    later[b] = make(b, round=3, averaged_round=3, members=[b, d])
    later[d] = make(d, round=3, averaged_round=3, members=[b, d])
    for s in SYBILS[:4]:
        later[s] = make(s, round=9, averaged_round=1, members=[*SYBILS[:4], b])
    assert witness.observe(later) == {a, b, c, d}
    assert witness.listed(later)[:4] == sorted([a, b, c, d])


def test_sybils_that_show_up_already_averaged_found_nothing_even_with_the_earliest_round():
    witness = Witness()
    witness.observe(_started(*HONEST[:3]))
    sybils = {s: make(s, round=1, averaged_round=1, members=SYBILS[:6]) for s in SYBILS[:6]}
    assert witness.observe(sybils) == frozenset()  # consistent, and earlier, but never seen start
    records = sybils | {p: make(p, round=3, averaged_round=3, members=HONEST[:3]) for p in HONEST[:3]}
    assert witness.observe(records) == set(HONEST[:3])


def test_a_witness_that_comes_late_abstains_unless_the_operator_names_founders():
    records = {p: make(p, round=7, averaged_round=7, members=HONEST[:3]) for p in HONEST[:3]}
    late = Witness()
    assert late.observe(records) == frozenset() and late.abstains
    founded = Witness(founders=[HONEST[0]])
    assert founded.observe(records) == set(HONEST[:3]) and not founded.abstains


def test_a_witness_that_sees_groups_commit_and_can_trust_none_gives_up_instead_of_blocking_newcomers():
    witness = Witness()
    witness.observe(_started(HONEST[0]))  # it saw one of them start, not the others
    records = {p: make(p, round=2, averaged_round=2, members=HONEST[:3]) for p in HONEST[:3]}
    for _ in range(Witness.PATIENCE - 1):
        assert witness.observe(records) == frozenset() and not witness.abstains
    witness.observe(records)
    assert witness.abstains


def test_a_group_whose_members_do_not_all_name_it_is_not_a_first_group():
    witness = Witness()
    a, b = SYBILS[:2]
    witness.observe(_started(a, b, HONEST[1]))
    records = {a: make(a, averaged_round=1, members=[a, HONEST[1]]), b: make(b, averaged_round=1, members=[b])}
    assert witness.observe(records) == frozenset()


def test_the_vouched_whole_state_hash_counts_only_standing_peers():
    records = {p: make(p, round=3, params_sha256=THETA, state_sha256="1" * 64) for p in OTHERS}
    records |= {s: make(s, round=3, params_sha256=THETA, state_sha256="2" * 64) for s in SYBILS[:5]}
    assert vouched_state_hash(records, 3, THETA, frozenset(OTHERS)) == "1" * 64
    assert vouched_state_hash(records, 3, THETA) == "2" * 64  # by headcount the Sybils' momentum wins
    assert vouched_state_hash(records, 4, THETA) is None


def test_a_witness_that_trusts_nobody_yet_moves_no_newcomer():
    """At a run's start no group has committed: the witness says so, and two Sybils claiming a
    later round move nobody (without a witness, the headcount would)."""
    records = {s: make(s, round=9, params_sha256=FORGED, averaged_round=9) for s in SYBILS[:2]}
    newcomer = Standing(ME)
    assert newcomer.among(records) is None
    assert resync_target(records, 0, THETA, None, quorum=2, standing=newcomer.among(records)) is not None
    newcomer.witness([])
    assert newcomer.among(records) == frozenset()
    assert resync_target(records, 0, THETA, None, quorum=2, standing=newcomer.among(records)) is None
    newcomer.witness(OTHERS)  # later: the witness trusts the honest group, and a newcomer follows it
    records |= {p: make(p, round=4, params_sha256=THETA, averaged_round=4, members=sorted(HONEST)) for p in OTHERS}
    target = resync_target(records, 0, "0" * 64, None, quorum=2, standing=newcomer.among(records))
    assert target is not None and (target.min_round, target.params_hash) == (4, THETA)


def test_no_record_and_no_backer_is_no_view_not_an_error():
    standing = frozenset({OTHERS[0]})
    assert vouched_records({SYBILS[0]: make(SYBILS[0], round=5)}, quorum=2, standing=standing) == {}
    # quorum 1: our own state is vouched by us alone; a standing peer elsewhere and a Sybil move nothing
    records = {SYBILS[0]: make(SYBILS[0], round=5, params_sha256=FORGED)}
    assert vouched_records(records, quorum=1, standing=frozenset(), ours=(3, THETA)) == {}


def test_no_witness_record_is_not_a_witness_that_trusts_nobody():
    """A run whose seeds witness nothing: the node keeps the headcount (None), it is not locked out."""
    from diloco_p2p.swarm.membership.standing import parse_witness

    assert parse_witness(None, {HONEST[0]}) is None
    newcomer = Standing(ME)
    newcomer.witness(parse_witness(None, {HONEST[0]}))
    assert newcomer.among({}) is None


def test_only_a_witness_signed_entry_counts():
    from types import SimpleNamespace

    from diloco_p2p.swarm.membership.standing import parse_witness
    from tests.unit.dht_fixtures import NOW, PEERS, subkey

    def entry(value):
        return SimpleNamespace(value=value, expiration_time=NOW + 60)

    seed, stranger = PEERS[0], PEERS[1]
    found = SimpleNamespace(value={
        subkey(seed): entry({"round": 3, "peers": OTHERS}),
        subkey(stranger): entry({"round": 9, "peers": list(SYBILS[:3])}),  # signed, but no witness of ours
        subkey(seed, signer=stranger): entry({"round": 9, "peers": list(SYBILS[3:6])}),  # under the seed's id
    })
    assert parse_witness(found, {seed}, now=NOW) == set(OTHERS)
    assert parse_witness(found, {PEERS[2]}, now=NOW) is None
