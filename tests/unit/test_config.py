import pytest

from diloco_p2p.config import Config, diff_swarm_fields, load_config, parse_override
from diloco_p2p.errors import UserError


def test_precedence_defaults_file_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("outer:\n  lr: 0.5\n  inner_steps: 7\ninner:\n  batch_size: 3\n")
    cfg = load_config(f, ["outer.lr=0.25"])
    assert cfg.outer.lr == 0.25  # override beats file
    assert cfg.outer.inner_steps == 7  # file beats default
    assert cfg.outer.momentum == Config().outer.momentum  # default kept


def test_toml_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('run_id = "x"\n[sync]\ncompression = "int8"\n')
    cfg = load_config(f)
    assert (cfg.run_id, cfg.sync.compression) == ("x", "int8")


def test_override_values_are_typed():
    assert parse_override("p2p.initial_peers=['/ip4/1.2.3.4/tcp/1']") == (
        ["p2p", "initial_peers"], ["/ip4/1.2.3.4/tcp/1"])
    assert parse_override("outer.nesterov=false")[1] is False


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["outer.lrr=1"], "unknown field 'outer.lrr'"),
        (["inner.batch_size=many"], "inner.batch_size"),
        (["sync.compression=bf8"], "sync.compression"),
        (["outer.lr"], "has no '='"),
        (["sync.min_group_size=5", "sync.target_group_size=2"], "target_group_size"),
    ],
)
def test_bad_config_is_one_clear_line(overrides, needle):
    with pytest.raises(UserError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_bad_set_is_named_not_the_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("inner:\n  batch_size: 3\nsync:\n  target_group_size: 4\n")
    cases = {
        "inner.batch_size=many": "--set inner.batch_size=many: field 'inner.batch_size': ",
        "outer.lrr=1": "--set outer.lrr=1: unknown field 'outer.lrr'",
        "sync.min_group_size=5": "--set sync.min_group_size=5: field 'sync': Value error, sync.target_group_size",
    }
    for item, start in cases.items():
        with pytest.raises(UserError) as e:
            load_config(f, ["outer.lr=0.5", item, "train.max_rounds=3"])
        assert str(e.value).startswith(start) and str(f) not in str(e.value)
    f.write_text("inner:\n  batch_size: many\n")
    with pytest.raises(UserError, match=rf"^{f}: field 'inner.batch_size': "):
        load_config(f, ["inner.lr=0.1"])


def test_resume_round_is_unset_by_default_and_checked():
    assert Config().train.resume_round is None
    assert load_config(None, ["train.resume_round=3"]).train.resume_round == 3
    with pytest.raises(UserError, match="--set train.resume_round=-1: field 'train.resume_round'"):
        load_config(None, ["train.resume_round=-1"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("outer: [1, 2\n")
    with pytest.raises(UserError, match="not valid"):
        load_config(bad)


def test_target_group_size_is_a_swarm_field_that_keeps_old_hashes_at_its_default():
    """Every member must cut the same grid (`swarm.collective.hierarchy`); at the default 16 the view (and the hash of
    runs started before it was a swarm field) is unchanged."""
    base = load_config(None, [])
    assert "sync.target_group_size" not in base.swarm_view()
    other = load_config(None, ["sync.target_group_size=4"])
    assert diff_swarm_fields(base.swarm_view(), other.swarm_view()) == ["sync.target_group_size: None != 4"]


def test_swarm_hash_covers_only_swarm_fields():
    base = Config()
    assert base.swarm_hash() == load_config(None, ["inner.batch_size=3", "p2p.connect_timeout=1"]).swarm_hash()
    other = load_config(None, ["outer.lr=0.5"])
    assert other.swarm_hash() != base.swarm_hash()
    assert diff_swarm_fields(base.swarm_view(), other.swarm_view()) == ["outer.lr: 0.7 != 0.5"]


def test_every_config_file_in_repo_loads():
    from pathlib import Path

    files = sorted(Path(__file__).parents[2].joinpath("configs").glob("*.yaml"))
    assert {f.stem for f in files} >= {"tiny-cpu", "small-cpu", "35m", "150m", "1b"}
    for f in files:
        load_config(f)


def test_compression_options_are_checked_and_topk_density_joins_the_swarm_view_under_topk2():
    cfg = load_config(None, ["sync.compression=topk2", "sync.topk_density=0.03", "sync.error_feedback=false"])
    assert (cfg.sync.compression, cfg.sync.topk_density, cfg.sync.error_feedback) == ("topk2", 0.03, False)
    assert cfg.swarm_view()["sync.topk_density"] == 0.03
    other = load_config(None, ["sync.compression=topk2", "sync.topk_density=0.05"])
    assert diff_swarm_fields(cfg.swarm_view(), other.swarm_view()) == ["sync.topk_density: 0.03 != 0.05"]
    dense = load_config(None, ["sync.compression=int4", "sync.topk_density=0.05"])
    assert "sync.topk_density" not in dense.swarm_view()  # no other wire reads it; older hashes unchanged
    assert dense.swarm_hash() == load_config(None, ["sync.compression=int4"]).swarm_hash()
    assert load_config(None, []).sync.error_feedback is None  # unset: on for topk2 only (`feedback`)
    assert load_config(None, []).sync.feedback_decay == 1.0  # the plain rule
    decayed = load_config(None, ["sync.compression=topk2", "sync.feedback_decay=0.95"])
    assert decayed.sync.feedback_decay == 0.95
    # only what a node offers changes (`feedback`): members may differ, the swarm hash does not
    assert decayed.swarm_hash() == load_config(None, ["sync.compression=topk2"]).swarm_hash()
    carried = load_config(None, ["sync.compression=topk2", "sync.feedback_carry=0.25"])
    assert carried.sync.carry == 0.25 and load_config(None, []).sync.carry == 0.0
    assert carried.swarm_hash() == decayed.swarm_hash()  # where a node trains from is its own affair
    # unset: 0.5 under topk2 where rounds start from θ, else 0 (never a refusal)
    assert decayed.sync.feedback_carry is None and decayed.sync.carry == 0.5
    for elsewhere in (["sync.overlap=eager"], ["sync.fragments=2"], ["sync.error_feedback=false"]):
        assert load_config(None, ["sync.compression=topk2", *elsewhere]).sync.carry == 0.0
    assert load_config(None, ["sync.compression=int4", "sync.error_feedback=true"]).sync.carry == 0.0
    for bad in ("sync.topk_density=0", "sync.topk_density=1.5", "sync.compression=int2", "sync.feedback_decay=1.5",
                "sync.feedback_decay=-0.1", "sync.feedback_carry=1.5", "sync.feedback_carry=-0.1"):
        with pytest.raises(UserError):
            load_config(None, [bad])
    for nothing_to_carry in (["sync.compression=fp16"], ["sync.compression=topk2", "sync.error_feedback=false"],
                             ["sync.compression=int4"]):
        with pytest.raises(UserError, match="feedback_carry"):
            load_config(None, [*nothing_to_carry, "sync.feedback_carry=0.5"])
    assert load_config(None, ["sync.compression=int4", "sync.error_feedback=true", "sync.feedback_carry=1"])
    for rounds_of_their_own in ("sync.overlap=eager", "sync.fragments=2"):  # they start from weights of their own
        with pytest.raises(UserError, match="feedback_carry"):
            load_config(None, ["sync.compression=topk2", "sync.feedback_carry=0.5", rounds_of_their_own])
    with pytest.raises(UserError, match="aggregation=mean"):
        load_config(None, ["sync.compression=topk2", "sync.aggregation=trimmed_mean"])
