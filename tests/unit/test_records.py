"""Progress records: the strict schema, what readers drop, tombstones."""

from __future__ import annotations

import math

import pydantic.v1 as pydantic
import pytest
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from diloco_p2p.swarm.membership.records import (
    DEFAULT_TTL,
    ProgressRecord,
    _tombstone_expiration,
    parse_progress,
    progress_key,
    progress_validator,
)
from tests.unit.dht_fixtures import NOW, PEERS, dht_record, make, subkey


def wire(**overrides) -> dict:
    d = make().dict()
    d.update(overrides)
    return d


# ---------------------------------------------------------------- schema


def test_build_casts_to_strict_types_and_round_trips():
    rec = make(tokens_per_s=7, round=2)  # an int throughput is cast, not rejected
    assert isinstance(rec.tokens_per_s, float) and rec.tokens_per_s == 7.0
    assert ProgressRecord.parse_obj(rec.dict()) == rec
    assert rec.view()["outer.lr"] == 0.7


def test_build_turns_nonfinite_losses_into_none():
    rec = make(train_loss=float("nan"), eval_loss=float("inf"))
    assert rec.train_loss is None and rec.eval_loss is None


@pytest.mark.parametrize(
    "overrides",
    [
        {"round": "3"},  # wrong type: a string
        {"round": 3.0},  # wrong type: strict ints, no conversion
        {"tokens_per_s": 5},  # wrong type: strict floats (msgpack keeps int vs float)
        {"round": -1},  # negative round
        {"tokens": -5},
        {"tokens_per_s": -1.0},
        {"train_loss": math.nan},
        {"params_sha256": "xyz"},
        {"config_hash": "A" * 64},  # upper-case hex is not what sha256().hexdigest() gives
        {"status": "victorious"},
        {"peer_id": "not base58 0OIl"},
        {"surprise": 1},  # extra field
    ],
)
def test_schema_rejects_bad_values(overrides):
    with pytest.raises(pydantic.ValidationError):
        ProgressRecord.parse_obj(wire(**overrides))


@pytest.mark.parametrize("field", ["round", "params_sha256", "config_hash", "peer_id", "updated"])
def test_schema_rejects_missing_field(field):
    d = wire()
    del d[field]
    with pytest.raises(pydantic.ValidationError):
        ProgressRecord.parse_obj(d)


def test_hivemind_validator_accepts_records_and_tombstones_and_rejects_the_rest():
    v = progress_validator("r")
    own = subkey(PEERS[0])
    assert v.validate(dht_record(progress_key("r"), own, make().dict()))
    assert v.validate(dht_record(progress_key("r"), own, None))  # tombstone
    assert not v.validate(dht_record(progress_key("r"), own, wire(tokens_per_s=5)))  # needs a conversion
    assert not v.validate(dht_record(progress_key("r"), own, wire(round=-1)))
    assert not v.validate(dht_record(progress_key("r"), "not a peer id!", make().dict()))
    assert not v.validate(dht_record(progress_key("r"), PEERS[0], make().dict()))  # unsigned: no owner part
    # other keys (other runs, other components) are not ours to judge
    assert v.validate(dht_record(progress_key("other-run"), PEERS[0], {"anything": 1}))


def test_validator_does_not_touch_pydantic_global_config():
    # hivemind's SchemaValidator sets `schema.Config.extra`; without our own Config class that
    # would be pydantic.v1's global BaseConfig.
    progress_validator("r2")
    assert pydantic.BaseConfig.extra == pydantic.Extra.ignore


# ---------------------------------------------------------------- reading


def _found(entries: dict) -> ValueWithExpiration:
    return ValueWithExpiration(
        {k: ValueWithExpiration(v, exp) for k, (v, exp) in entries.items()},
        max(e for _, e in entries.values()),
    )


def test_parse_progress_drops_tombstones_expired_invalid_and_misfiled():
    refused = []
    found = _found(
        {
            subkey(PEERS[0]): (make(PEERS[0]).dict(), NOW + 60),  # good
            subkey(PEERS[1]): (None, NOW + 60),  # tombstone
            subkey(PEERS[2]): (make(PEERS[2]).dict(), NOW - 1),  # expired
            subkey(PEERS[3]): (wire(peer_id=PEERS[3], round=-2), NOW + 60),  # invalid
            subkey(PEERS[4]): (make(PEERS[5]).dict(), NOW + 60),  # 4 signs a record naming 5
            subkey(PEERS[5], signer=PEERS[7]): (make(PEERS[5]).dict(), NOW + 60),  # 7 files under 5's id
            PEERS[8]: (make(PEERS[8]).dict(), NOW + 60),  # unsigned (a storing peer without our validators)
            subkey(PEERS[6]): ("garbage", NOW + 60),
        }
    )
    assert list(parse_progress(found, now=NOW, on_reject=lambda *a: refused.append(a))) == [PEERS[0]]
    # the forgers are named: the peer whose key signed each forged entry
    assert sorted((peer, reason) for peer, reason, _ in refused) == sorted(
        [(PEERS[4], "forged-record"), (PEERS[7], "forged-record")])
    assert any(PEERS[5] in detail for _, _, detail in refused)
    assert parse_progress(None, now=NOW) == {}
    assert parse_progress(ValueWithExpiration(b"not a dict", NOW + 5), now=NOW) == {}


def test_tombstone_outlives_our_record_but_not_by_much():
    record_exp = get_dht_time() + 10_000
    exp = _tombstone_expiration(_found({subkey(PEERS[0]): (make().dict(), record_exp)}), subkey(PEERS[0]))
    assert record_exp < exp < record_exp + 1
    # our record not visible: outlive anything published with the default ttl
    exp = _tombstone_expiration(_found({subkey(PEERS[1]): (make(PEERS[1]).dict(), record_exp)}), subkey(PEERS[0]))
    assert exp >= get_dht_time() + DEFAULT_TTL - 1
