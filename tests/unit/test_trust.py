"""Records nobody can forge (signing), admission tokens and the admission rule, and how
refusals are seen (guard): pure parts, no network."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P, PeerID

from diloco_p2p.config import AdmissionConfig
from diloco_p2p.errors import UserError
from diloco_p2p.swarm.membership.records import progress_key, progress_validator
from diloco_p2p.swarm.trust import signing
from diloco_p2p.swarm.trust.admission import Admission, TokenError, issue_token, verify_token
from diloco_p2p.swarm.trust.guard import Guard
from tests.unit.dht_fixtures import KEYS, NOW, PEERS, dht_record, make, subkey


@pytest.fixture(scope="module")
def identity(tmp_path_factory):
    path = tmp_path_factory.mktemp("id") / "identity.key"
    P2P.generate_identity(str(path))
    return path


def test_an_identity_file_signs_as_its_peer_id(identity):
    key = signing.load_private_key(identity)
    peer = PeerID.from_identity(identity.read_bytes()).to_base58()
    assert signing.peer_id_of_public_key(signing.public_key_text(key)) == peer
    assert signing.peer_id_of_public_key("ssh-rsa AAAAnot-a-key") is None


def _validator(identity):
    """What a node's DHT runs: hivemind's signature validator, then our schema."""
    return CompositeValidator([signing.signature_validator(identity), progress_validator("r")])


def test_only_the_owner_can_write_under_its_subkey(identity):
    v = _validator(identity)
    me = PeerID.from_identity(identity.read_bytes()).to_base58()
    own = signing.owned_subkey(me, signing.public_key_text(signing.load_private_key(identity)))
    record = dht_record(progress_key("r"), own, make(me).dict())
    signed = dataclasses.replace(record, value=v.sign_value(record))
    assert signed.value != record.value and v.validate(signed)
    # unsigned, tampered with, or its life extended by a replay: refused
    assert not v.validate(record)
    tampered = dht_record(progress_key("r"), own, make(me, round=99).dict())
    assert not v.validate(dataclasses.replace(tampered, value=signed.value.replace(record.value, tampered.value)))
    assert not v.validate(dataclasses.replace(signed, expiration_time=signed.expiration_time + 600))
    # we cannot sign under someone else's key: the value goes out unsigned and is refused
    theirs = dht_record(progress_key("r"), subkey(PEERS[0]), make(PEERS[0]).dict())
    assert v.sign_value(theirs) == theirs.value and not v.validate(theirs)
    # a tombstone is signed like a value: nobody withdraws another peer's record
    tomb = dht_record(progress_key("r"), own, None)
    assert v.validate(dataclasses.replace(tomb, value=v.sign_value(tomb)))
    assert not v.validate(dht_record(progress_key("r"), subkey(PEERS[0]), None))


def test_owner_of_names_the_claimed_peer_and_the_signer():
    assert signing.owner_of(subkey(PEERS[0])) == (PEERS[0], PEERS[0])
    assert signing.owner_of(subkey(PEERS[0], signer=PEERS[1])) == (PEERS[0], PEERS[1])
    assert signing.owner_of(PEERS[0]) == (None, None)
    assert signing.owner_of(b"bytes") == (None, None)


def test_own_subkey_refuses_a_dht_that_signs_nothing_or_with_another_key():
    class FakeDHT:
        def __init__(self, validators):
            self._record_validator = CompositeValidator(validators)

    dht = FakeDHT([signing.RSASignatureValidator(KEYS[0])])
    assert signing.own_subkey(dht, PEERS[0]) == subkey(PEERS[0])
    with pytest.raises(ValueError, match="another key"):
        signing.own_subkey(dht, PEERS[1])
    with pytest.raises(ValueError, match="signs no records"):
        signing.own_subkey(FakeDHT([]), PEERS[0])


# ---------------------------------------------------------------- admission tokens


def test_a_token_admits_its_peer_to_its_run_until_it_expires():
    owner = KEYS[8]
    key = signing.public_key_text(owner)
    token = issue_token(owner, "r", PEERS[0], expires=NOW + 10)
    assert verify_token(token, key, "r", now=NOW) == PEERS[0]
    with pytest.raises(TokenError, match="expired"):
        verify_token(token, key, "r", now=NOW + 11)
    with pytest.raises(TokenError, match="issued for run 'r'"):
        verify_token(token, key, "other", now=NOW)
    with pytest.raises(TokenError, match="not signed by the run owner"):
        verify_token(issue_token(KEYS[7], "r", PEERS[0]), key, "r")
    body, sig = token.split(".")
    forged = issue_token(KEYS[7], "r", PEERS[1]).split(".")[0] + "." + sig  # another statement, owner's signature
    with pytest.raises(TokenError, match="not signed"):
        verify_token(forged, key, "r")
    with pytest.raises(TokenError, match="not an admission token"):
        verify_token("garbage", key, "r")


def _admission(**cfg) -> tuple[Admission, Guard]:
    guard = Guard()
    return Admission(AdmissionConfig(**cfg), "r", PEERS[0], guard), guard


def test_open_runs_admit_everyone_closed_runs_their_list_and_token_holders():
    open_, _ = _admission()
    assert open_.admits(PEERS[5])
    owner = KEYS[8]
    closed, guard = _admission(mode="closed", peers=[PEERS[1]], owner_key=signing.public_key_text(owner))
    assert closed.admits(PEERS[0]) and closed.admits(PEERS[1]) and not closed.admits(PEERS[2])
    closed.learn([(PEERS[2], issue_token(owner, "r", PEERS[2])),  # a valid token: admitted
                  (PEERS[3], issue_token(owner, "r", PEERS[4])),  # someone else's token: not
                  (PEERS[5], issue_token(KEYS[7], "r", PEERS[5]))])  # not the owner's: not
    assert closed.admits(PEERS[2]) and not closed.admits(PEERS[3]) and not closed.admits(PEERS[5])
    assert closed.filter(PEERS[:4], "a progress record") == set(PEERS[:3])
    assert guard.drain() == {PEERS[3]: ["not-admitted"], PEERS[5]: ["not-admitted"]}


def test_a_stream_from_an_unknown_peer_rereads_the_records_at_most_every_interval():
    owner = KEYS[8]
    closed, guard = _admission(mode="closed", owner_key=signing.public_key_text(owner))
    calls = []

    async def refresh():
        calls.append(1)
        closed.learn([(PEERS[2], issue_token(owner, "r", PEERS[2]))])  # its record just appeared

    closed.refresh = refresh
    assert asyncio.run(closed.check_stream(PEERS[2], "state")) is True
    assert asyncio.run(closed.check_stream(PEERS[3], "state")) is False
    # within REFRESH_INTERVAL of the last re-read the records are not read again
    assert len(calls) == 1 and guard.drain() == {PEERS[3]: ["not-admitted"]}


def test_a_node_with_a_token_for_another_peer_is_told_at_start(tmp_path):
    path = tmp_path / "token"
    path.write_text(issue_token(KEYS[8], "r", PEERS[1]))
    with pytest.raises(UserError, match=f"token_path: the token in {path} issued for another peer id"):
        _admission(mode="closed", owner_key=signing.public_key_text(KEYS[8]), token_path=str(path))
    with pytest.raises(UserError, match="cannot read"):
        _admission(mode="closed", owner_key=signing.public_key_text(KEYS[8]), token_path=str(tmp_path / "none"))


def test_a_closed_run_without_members_is_a_config_error():
    with pytest.raises(ValueError, match="closed run needs"):
        AdmissionConfig(mode="closed")


# ---------------------------------------------------------------- guard


def test_guard_logs_each_peer_and_reason_once_per_round_and_remembers_them(caplog):
    now = [0.0]
    guard = Guard(excluded_for=60, clock=lambda: now[0])
    with caplog.at_level("WARNING"):
        for _ in range(3):
            guard.reject(PEERS[1], "forged-record", "x")
        guard.reject(PEERS[2], "not-admitted", "y")
        guard.reject(PEERS[2], "not-admitted", "z")  # another thing it did: another line
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"refused peer {PEERS[1]}: forged-record (x)", f"refused peer {PEERS[2]}: not-admitted (y)",
                     f"refused peer {PEERS[2]}: not-admitted (z)"]
    guard.reject(PEERS[1], "unvouched-state", "w")
    assert guard.drain() == {PEERS[1]: ["forged-record", "unvouched-state"], PEERS[2]: ["not-admitted"]}
    assert guard.drain() is None
    now[0] = 61
    guard.reject(PEERS[2], "bad-state", "z")
    assert guard.excluded() == {PEERS[2]: "bad-state"}  # PEERS[1]'s refusal is too old
    with pytest.raises(ValueError):
        guard.reject(PEERS[1], "rude", "")


def test_a_caught_reducer_stays_distrusted_whatever_it_is_refused_for_next():
    """A swarm test saw it: x caught as a reducer in round 3 was refused "unvouched-state" just
    after, and with distrust keyed by the last reason it was back in the next group."""
    now = [0.0]
    guard = Guard(excluded_for=60, clock=lambda: now[0])
    guard.reject(PEERS[1], "reducer", "round 3: scaled its part")
    guard.reject(PEERS[2], "norm", "its contribution")
    now[0] = 30
    guard.reject(PEERS[1], "unvouched-state", "a record of a later round")
    assert guard.distrusted() == {PEERS[1]}
    assert guard.excluded()[PEERS[1]] == "unvouched-state"
    now[0] = 61
    assert guard.distrusted() == set()


def test_a_catch_up_downloads_from_a_peer_that_was_only_ahead_of_its_quorum():
    """Seen in the churn benchmark: a node catching up refused each member "unvouched-state" as
    it published a round first, and with every refusal excluding donors for 10 minutes it found
    no donor left and never came back. Only lies and closed-run refusals exclude a donor."""
    now = [0.0]
    guard = Guard(excluded_for=60, clock=lambda: now[0])
    guard.reject(PEERS[1], "unvouched-state", "one backer of round 8 while 2 back round 7")
    guard.reject(PEERS[2], "bad-state", "served another θ than it announced")
    guard.reject(PEERS[3], "norm", "its contribution")
    now[0] = 30
    guard.reject(PEERS[2], "unvouched-state", "a record of a later round")  # the lie still counts
    assert guard.no_state_from() == {PEERS[2]}
    assert set(guard.excluded()) == {PEERS[1], PEERS[2], PEERS[3]}  # all shown to operators
    now[0] = 61
    assert guard.no_state_from() == set()



def test_a_closed_run_tries_no_state_a_stranger_announces_and_names_it():
    """`SwarmSync.fetch` asks `Admission.refuses_donor` of every announcement before anything is downloaded."""
    from diloco_p2p.config import AdmissionConfig
    from diloco_p2p.swarm.trust.admission import Admission
    from diloco_p2p.swarm.trust.guard import Guard

    me, member, stranger = PEERS[:3]
    guard = Guard()
    closed = Admission(AdmissionConfig(mode="closed", peers=[member]), "r", me, guard)
    assert not closed.refuses_donor(member)
    assert closed.refuses_donor(stranger)
    assert guard.drain() == {stranger: ["not-admitted"]} and stranger in guard.no_state_from()
    assert not Admission(AdmissionConfig(), "r", me, Guard()).refuses_donor(stranger)
