"""Progress records: the strict schema, what readers drop, config refusal, the swarm's round."""

from __future__ import annotations

import math

import pydantic.v1 as pydantic
import pytest
from hivemind.dht.crypto import DHTRecord
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from diloco_p2p.config import Config
from diloco_p2p.errors import UserError
from diloco_p2p.swarm.records import (
    DEFAULT_TTL,
    ProgressRecord,
    _tombstone_expiration,
    check_config,
    majority,
    parse_progress,
    progress_key,
    progress_validator,
    reference_records,
    resync_target,
    round_majorities,
)

PEERS = [f"12D3KooW{c * 44}" for c in "ABCDEFG"]
NOW = 1_000_000.0


def make(peer: str = PEERS[0], cfg: Config | None = None, **kw) -> ProgressRecord:
    cfg = cfg or Config(run_id="r")
    fields = dict(
        peer_id=peer,
        round=3,
        step=30,
        tokens=3840,
        tokens_per_s=12.5,
        params_sha256="a" * 64,
        config_hash=cfg.swarm_hash(),
        config_view=cfg.swarm_view(),
        status="committed",
        train_loss=4.25,
        eval_loss=4.5,
        group_size=3,
        updated=NOW,
    )
    fields.update(kw)
    return ProgressRecord.build(**fields)


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


def _dht_record(run_id: str, subkey: str, value) -> DHTRecord:
    ser = DHTProtocol.serializer
    return DHTRecord(
        key=DHTID.generate(source=progress_key(run_id)).to_bytes(),
        subkey=ser.dumps(subkey),
        value=ser.dumps(value),
        expiration_time=NOW + 60,
    )


def test_hivemind_validator_accepts_records_and_tombstones_and_rejects_the_rest():
    v = progress_validator("r")
    assert v.validate(_dht_record("r", PEERS[0], make().dict()))
    assert v.validate(_dht_record("r", PEERS[0], None))  # tombstone
    assert not v.validate(_dht_record("r", PEERS[0], wire(tokens_per_s=5)))  # needs a conversion
    assert not v.validate(_dht_record("r", PEERS[0], wire(round=-1)))
    assert not v.validate(_dht_record("r", "not a peer id!", make().dict()))
    # other keys (other runs, other components) are not ours to judge
    assert v.validate(_dht_record("other-run", PEERS[0], {"anything": 1}))


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
    found = _found(
        {
            PEERS[0]: (make(PEERS[0]).dict(), NOW + 60),  # good
            PEERS[1]: (None, NOW + 60),  # tombstone
            PEERS[2]: (make(PEERS[2]).dict(), NOW - 1),  # expired
            PEERS[3]: (wire(peer_id=PEERS[3], round=-2), NOW + 60),  # invalid
            PEERS[4]: (make(PEERS[5]).dict(), NOW + 60),  # claims another peer's subkey
            PEERS[6]: ("garbage", NOW + 60),
        }
    )
    assert list(parse_progress(found, now=NOW)) == [PEERS[0]]
    assert parse_progress(None, now=NOW) == {}
    assert parse_progress(ValueWithExpiration(b"not a dict", NOW + 5), now=NOW) == {}


def test_tombstone_outlives_our_record_but_not_by_much():
    record_exp = get_dht_time() + 10_000
    exp = _tombstone_expiration(_found({PEERS[0]: (make().dict(), record_exp)}), PEERS[0])
    assert record_exp < exp < record_exp + 1
    # our record not visible: outlive anything published with the default ttl
    exp = _tombstone_expiration(_found({PEERS[1]: (make(PEERS[1]).dict(), record_exp)}), PEERS[0])
    assert exp >= get_dht_time() + DEFAULT_TTL - 1


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
    # one against one: ties go to the smaller hash, so exactly one of the two moves
    one = {PEERS[0]: make(PEERS[0], round=3, params_sha256=H["c"])}
    assert resync_target(one, 3, H["b"]) is None
    assert resync_target({PEERS[1]: make(PEERS[1], round=3, params_sha256=H["b"])}, 3, H["c"]) is not None


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
