"""Pure parts of state sharing: announcement parsing and validation, and the donor order that
spreads joiners over donors."""

from __future__ import annotations

import hashlib
from collections import Counter
from types import SimpleNamespace

import pydantic.v1 as pydantic
from hivemind.p2p import PeerID

from diloco_p2p.swarm.state.announcements import (
    StateAnnouncement,
    order_candidates,
    parse_announcements,
    rendezvous_order,
    state_key,
    state_validator,
)
from tests.unit.dht_fixtures import PEERS as SIGNED
from tests.unit.dht_fixtures import dht_record, subkey

NOW = 1_000_000.0  # the same as dht_fixtures.NOW: its records expire at NOW + 60
# Valid base58 peer ids (sha2-256 multihashes of fixed bytes: "Qm..."), deterministic.
PEERS = [PeerID(b"\x12\x20" + hashlib.sha256(bytes([i])).digest()).to_base58() for i in range(40)]
SHA_A, SHA_B, THETA = "a" * 64, "b" * 64, "c" * 64


def _entry(value, expiration=NOW + 30):
    return SimpleNamespace(value=value, expiration_time=expiration)


def _value(round=3, sha=SHA_A, size=100, params_hash=THETA):
    return {"round": round, "sha256": sha, "size": size, "params_hash": params_hash}


def test_parse_keeps_valid_entries_newest_first_and_drops_the_rest():
    P = SIGNED
    found = SimpleNamespace(value={
        subkey(P[0]): _entry(_value(round=3)),
        subkey(P[1]): _entry(_value(round=5, sha=SHA_B, params_hash=None)),
        subkey(P[2]): _entry(None),  # tombstone: the donor withdrew
        subkey(P[3]): _entry(_value(), expiration=NOW - 1),  # expired
        subkey(P[4]): _entry(_value(round=-1)),
        subkey(P[5]): _entry(_value(size=1.5)),
        subkey(P[6]): _entry({**_value(), "extra": 1}),
        subkey(P[7]): _entry(_value(sha="A" * 64)),  # not lowercase hex
        subkey(P[8]): _entry(_value(round=True)),  # bool is not a round
        subkey(P[2], signer=P[3]): _entry(_value(round=9)),  # P3 announcing in P2's name
        P[4]: _entry(_value(round=9)),  # unsigned
        "not-a-peer-id": _entry(_value()),
    })
    anns = parse_announcements(found, now=NOW)
    assert anns == [
        StateAnnouncement(P[1], 5, SHA_B, 100, None),
        StateAnnouncement(P[0], 3, SHA_A, 100, THETA),
    ]
    assert parse_announcements(None, now=NOW) == []
    assert parse_announcements(SimpleNamespace(value="junk"), now=NOW) == []


def test_hivemind_validator_accepts_announcements_and_tombstones_only():
    v = state_validator("r")
    own = subkey(SIGNED[0])
    assert v.validate(dht_record(state_key("r"), own, _value()))
    assert v.validate(dht_record(state_key("r"), own, _value(params_hash=None)))
    assert v.validate(dht_record(state_key("r"), own, None))
    assert not v.validate(dht_record(state_key("r"), own, _value(size=-5)))
    assert not v.validate(dht_record(state_key("r"), own, {**_value(), "how": "pickle"}))
    assert not v.validate(dht_record(state_key("r"), "nonsense!", _value()))
    assert not v.validate(dht_record(state_key("r"), PEERS[0], _value()))  # unsigned
    assert v.validate(dht_record(state_key("another-run"), PEERS[0], {"whatever": 1}))
    assert pydantic.BaseConfig.extra == pydantic.Extra.ignore  # the global config is untouched


def test_rendezvous_spreads_joiners_evenly_over_donors():
    donors, joiners = PEERS[:4], [f"joiner-{i}" for i in range(4000)]
    firsts = Counter(rendezvous_order(j, donors)[0] for j in joiners)
    assert set(firsts) == set(donors)
    # uniform: each donor gets 1000 ± a few standard deviations (sd ≈ 27)
    assert all(850 < n < 1150 for n in firsts.values()), firsts
    # hivemind's priority order would send all 4000 joiners to one donor.


def test_rendezvous_moves_only_the_joiners_of_a_donor_that_left():
    donors, joiners = PEERS[:5], [f"joiner-{i}" for i in range(1000)]
    before = {j: rendezvous_order(j, donors)[0] for j in joiners}
    after = {j: rendezvous_order(j, donors[1:])[0] for j in joiners}
    moved = [j for j in joiners if before[j] != after[j]]
    assert moved and all(before[j] == donors[0] for j in moved)
    assert len(moved) == sum(1 for j in joiners if before[j] == donors[0])


def test_rendezvous_order_is_a_deterministic_permutation():
    order = rendezvous_order("me", PEERS[:6])
    assert sorted(order) == sorted(PEERS[:6])
    assert rendezvous_order("me", list(reversed(PEERS[:6]))) == order
    assert rendezvous_order("someone else", PEERS[:6]) != order  # (holds for these fixed ids)


def test_candidates_newest_round_first_then_majority_theta_then_rendezvous():
    anns = [
        StateAnnouncement(PEERS[0], 4, SHA_A, 10, THETA),
        StateAnnouncement(PEERS[1], 5, SHA_A, 10, "d" * 64),  # newest round, but alone in its θ
        StateAnnouncement(PEERS[2], 5, SHA_B, 10, "e" * 64),
        StateAnnouncement(PEERS[3], 5, SHA_B, 10, "e" * 64),
        StateAnnouncement(PEERS[4], 5, "f" * 64, 10, "e" * 64),  # same θ, other blob (own inner state)
    ]
    order = order_candidates(anns, "joiner-x")
    assert [a.round for a in order] == [5, 5, 5, 5, 4]
    assert {a.peer_id for a in order[:3]} == set(PEERS[2:5])  # majority θ at round 5
    expected = rendezvous_order("joiner-x", PEERS[2:5])
    assert [a.peer_id for a in order[:3]] == expected
    assert order[3].peer_id == PEERS[1] and order[4].peer_id == PEERS[0]


def test_prefer_puts_named_donors_first_within_their_group():
    anns = [StateAnnouncement(p, 5, SHA_A, 10, THETA) for p in PEERS[:4]]
    order = [a.peer_id for a in order_candidates(anns, "j", prefer=[PEERS[3], PEERS[1], "absent"])]
    assert order[:2] == [PEERS[3], PEERS[1]]
    assert order[2:] == [p for p in rendezvous_order("j", PEERS[:4]) if p not in (PEERS[3], PEERS[1])]
    # a preferred donor of an older round does not jump ahead of the newest state
    older = StateAnnouncement(PEERS[9], 4, SHA_B, 10, None)
    assert order_candidates([*anns, older], "j", prefer=[PEERS[9]])[-1] == older


def test_state_check_accepts_only_a_vouched_state_and_blames_only_liars():
    import torch

    from diloco_p2p.swarm.state.codec import StateCheck, pack_state, theta_sha256

    theta = {"outer.theta": torch.arange(8, dtype=torch.float32), "outer.momentum": torch.zeros(8)}
    other = {**theta, "outer.theta": theta["outer.theta"] * 2}
    good, made_up = theta_sha256(theta), theta_sha256(other)
    blob = pack_state(theta, {"round": 5})

    def ann(round=5, params_hash=good):
        return StateAnnouncement("QmDonor", round, "0" * 64, len(blob), params_hash)

    check = StateCheck(5, good, max_round=10)
    assert check(blob, ann()) is None and check.unpacked is not None and check.unpacked[1]["round"] == 5
    # a made-up θ announced under the vouched hash (its blob's sha256 matching): the donor lied
    why, lied = StateCheck(5, good, 10)(pack_state(other, {"round": 5}), ann())
    assert lied and "announced θ" in why
    # a round other than announced: lied; junk: lied
    assert StateCheck(5, good, 10)(pack_state(theta, {"round": 6}), ann())[1] is True
    assert StateCheck(None, None, None)(b"xx", ann()) == ("state of 2 bytes is truncated: no safetensors header", True)
    # what it announced, but not what the swarm vouches for: refused, nobody blamed
    assert StateCheck(5, good, 10)(pack_state(other, {"round": 5}), ann(params_hash=made_up)) == (
        f"its round 5 θ {made_up[:12]} is not the round 5 θ {good[:12]} the swarm vouches for", False)
    later = pack_state(other, {"round": 7})
    assert StateCheck(5, good, 10)(later, ann(7, made_up))[1] is False
    assert StateCheck(5, good, 10, vouched=lambda r, h: (r, h) == (7, made_up))(later, ann(7, made_up)) is None
    assert "past train.max_rounds 4" in StateCheck(None, None, 4)(blob, ann())[0]
    assert "no round" in StateCheck(None, None, None)(pack_state(theta, {}), None)[0]
