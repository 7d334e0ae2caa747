"""Matchmaking's pure rules: who leads, the one answer a leader closes with, and what a member
accepts from a leader or a leader from a joiner."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID

from diloco_p2p.swarm.membership.grouping import ALONE, GROUP, VOID, Entry, Session, parse_view

PEERS = sorted(PeerID(b"\x12\x20" + hashlib.sha256(bytes([i])).digest()).to_base58() for i in range(4))
ME = PEERS[1]


def _session(min_size: int = 2, me: str = ME, t: float = 10.0) -> Session:
    return Session(key="k", round=3, params_hash="a" * 64, me=me, t=t, weight=1.0, min_size=min_size,
                   target=4, timeout=5.0, request_timeout=1.0)


def test_best_candidate_is_the_earliest_live_registration_before_us():
    s = _session()
    view = {
        PEERS[0]: Entry(PEERS[0], 9.0, 1.0, None),
        PEERS[2]: Entry(PEERS[2], 8.0, 1.0, "expired"),  # withdrawn
        PEERS[3]: Entry(PEERS[3], 7.0, 1.0, None),
        ME: Entry(ME, 5.0, 1.0, None),  # ourselves, whatever our record says
    }
    assert s.best_candidate(view, set()).peer == PEERS[3]
    assert s.best_candidate(view, {PEERS[3]}).peer == PEERS[0]
    assert s.best_candidate(view, {PEERS[3], PEERS[0]}) is None
    # the same time: the smaller peer id precedes
    tied = {PEERS[0]: Entry(PEERS[0], 10.0, 1.0, None), PEERS[2]: Entry(PEERS[2], 10.0, 1.0, None)}
    assert s.best_candidate(tied, set()).peer == PEERS[0]


def test_private_peers_never_lead_and_a_private_node_follows_any_public_one():
    view = {
        PEERS[0]: Entry(PEERS[0], 9.0, 1.0, None, pub=False),  # earliest live but behind NAT: never a leader
        PEERS[2]: Entry(PEERS[2], 12.0, 1.0, None),  # public, registered after us
    }
    assert _session().best_candidate(view, set()) is None  # public: leads rather than follow a later peer
    private = _session()
    private.public = False
    assert private.best_candidate(view, set()).peer == PEERS[2]  # private: follows the public one
    assert private.best_candidate(view, {PEERS[2]}) is None  # nobody public left: alone
    assert parse_view(SimpleNamespace(value={PEERS[0]: SimpleNamespace(value={"t": 1.0, "w": 1.0, "pub": False})}))[
        PEERS[0]].pub is False


def test_the_answer_tells_every_member_who_is_private():
    async def scenario():
        leader = _session(me=PEERS[0])
        epoch = leader.lead()
        epoch.members.update({PEERS[2]: (3.0, 7), ME: (2.0, 8)})
        epoch.public[ME] = False
        leader.close(epoch, "run", "full", now=1.0)
        return epoch.answer.result()

    answer = asyncio.run(scenario())
    group = _session().final(answer, own=False).group
    assert group.public == {PEERS[0]: True, ME: False, PEERS[2]: True}
    assert group.public_flags() == [True, False, True]  # member order
    del answer["pub"]  # a leader that does not say: everyone public
    assert _session().final(answer, own=False).group.public_flags() is None


def test_a_closed_group_is_one_answer_every_member_reads_alike():
    async def scenario():
        leader = _session(me=PEERS[0])
        epoch = leader.lead()
        epoch.members.update({PEERS[2]: (3.0, 7), ME: (2.0, 8)})
        leader.close(epoch, "run", "full", now=123.0)
        leader.close(epoch, "run", "expired", now=456.0)  # closed once: the second close changes nothing
        return epoch.answer.result(), epoch.close_reason

    answer, reason = asyncio.run(scenario())
    assert reason == "full" and answer["peers"] == [PEERS[0], ME, PEERS[2]]
    assert answer["w"] == {PEERS[0]: 1.0, ME: 2.0, PEERS[2]: 3.0}
    finals = [_session(me=p).final(answer, own=False) for p in answer["peers"]]
    assert {f.group.group_id for f in finals} == {answer["id"]} and all(f.outcome == GROUP for f in finals)
    assert [f.group.my_index for f in finals] == [0, 1, 2]
    assert _session(me=PEERS[3]).final(answer, own=False) is None  # not a member


@pytest.mark.parametrize("members", [1, 2])
def test_a_group_below_min_size_is_void(members):
    async def scenario():
        s = _session(min_size=3)
        epoch = s.lead()
        if members == 2:
            epoch.members[PEERS[0]] = (1.0, 1)
        s.close(epoch, "run", "expired", now=1.0)
        return s.final(epoch.answer.result(), own=True), epoch.close_reason

    final, reason = asyncio.run(scenario())
    assert final.group is None and final.outcome == (ALONE if members == 1 else VOID) and reason is None


@pytest.mark.parametrize(
    "change",
    [
        {"w": {PEERS[0]: 1.0, ME: float("inf")}},
        {"w": {PEERS[0]: 1.0}},
        {"peers": [PEERS[0], ME, ME]},
        {"peers": [ME]},
        {"leader": PEERS[3]},
        {"id": 5},
        {"peers": [PEERS[0], "not-base58!"], "w": {PEERS[0]: 1.0, "not-base58!": 1.0}},
    ],
)
def test_a_malformed_answer_is_no_group(change):
    good = {"s": "group", "id": "g", "leader": PEERS[0], "why": "full", "peers": [PEERS[0], ME],
            "w": {PEERS[0]: 1.0, ME: 1.0}}
    assert _session().final(good, own=False).group.peers[1].to_base58() == ME
    assert _session().final({**good, **change}, own=False) is None


def test_join_requests_must_match_the_session():
    s = _session()
    good = {"v": 1, "key": "k", "h": "a" * 64, "t": 0.0, "w": 1.0, "hb": 0.5}
    assert not s.rejects(good, PEERS[0])
    for bad in ({"v": 2}, {"h": "b" * 64}, {"w": -1.0}, {"w": float("nan")}, {"hb": "0.5"}, {"hb": True}):
        assert s.rejects({**good, **bad}, PEERS[0]), bad
    assert s.rejects(good, ME)  # not from ourselves


def test_parse_view_keeps_well_formed_registrations_only():
    def item(value):
        return SimpleNamespace(value=value)

    found = SimpleNamespace(value={
        PEERS[0]: item({"t": 1.5, "w": 2}),
        PEERS[2]: item({"t": 2.0, "w": 1.0, "done": "expired"}),
        PEERS[3]: item({"t": "soon", "w": 1.0}),
        ME: item({"t": 1.0, "w": 1.0, "done": 3}),
        5: item({"t": 1.0, "w": 1.0}),
    })
    assert parse_view(found) == {
        PEERS[0]: Entry(PEERS[0], 1.5, 2.0, None),
        PEERS[2]: Entry(PEERS[2], 2.0, 1.0, "expired"),
    }
    assert parse_view(None) == {}


def test_a_group_closes_when_every_expected_peer_is_in():
    async def reasons(min_size: int, target: int, expected: set[str], joins: list[list[str]]) -> list[str | None]:
        s = _session(min_size=min_size)
        s.target, s.expected = target, frozenset(expected)
        epoch = s.lead()
        out = [s.closing_reason(epoch)]
        for change in joins:
            for peer in change:
                if peer.startswith("-"):
                    del epoch.members[peer[1:]]
                else:
                    epoch.members[peer] = (1.0, len(epoch.members))
            out.append(s.closing_reason(epoch))
        return out

    # nobody expected: wait for the target (4) or the timeout
    assert asyncio.run(reasons(2, 4, set(), [[PEERS[0]], [PEERS[2], PEERS[3]]])) == [None, None, "full"]
    # two expected: close once both are in, not before; a member that leaves reopens the wait
    expected = {PEERS[0], PEERS[2]}
    assert asyncio.run(reasons(2, 8, expected, [[PEERS[0]], [PEERS[2]]])) == [None, None, "complete"]
    assert asyncio.run(reasons(2, 8, expected, [[PEERS[0], PEERS[3]], ["-" + PEERS[0], PEERS[2]]])) == [
        None, None, None]
    # all in, but fewer than min_group_size: wait for joiners (or the timeout)
    assert asyncio.run(reasons(3, 8, {PEERS[0]}, [[PEERS[0]]])) == [None, None]
