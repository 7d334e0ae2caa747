"""`diloco-p2p train` as a user runs it: real subprocesses, real run directories.

Commands that do not depend on each other run at once (`run_clis`): each is an interpreter
that imports torch before it does anything, and one after the other they cost a minute."""

import shutil

import pytest

from tests.harness.procs import read_records, run_cli, run_clis
from tests.harness.settings import TINY, set_args


def test_resume_gives_the_same_parameters_as_a_straight_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = set_args(TINY + ["data.order_key=fixed", "inner.total_steps=20"])
    whole, first = run_clis(["train", *common, "--run-dir", str(straight)],
                            ["train", *common, "--set", "train.max_rounds=2", "--run-dir", str(resumed)])
    assert whole.returncode == 0, whole.stderr
    assert first.returncode == 0, first.stderr
    second = run_cli(["train", *common, "--run-dir", str(resumed)])
    assert second.returncode == 0, second.stderr
    assert "resumed from checkpoint at round 2" in second.stderr
    a = {r["round"]: r["params_sha256"] for r in read_records(straight)}
    b = {r["round"]: r["params_sha256"] for r in read_records(resumed)}
    assert set(a) == {0, 1, 2, 3, 4} and a == b


def test_a_run_records_every_round_and_learns(tmp_path):
    out = run_cli(["train", *set_args(TINY + ["train.max_rounds=3"]), "--run-dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr
    records = read_records(tmp_path)
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        assert {"step", "tokens", "train_loss", "eval_loss", "tokens_per_s", "seconds", "params_sha256",
                "status", "group_size"} <= set(r)
        assert r["tokens_per_s"] > 0
    assert records[-1]["eval_loss"] < records[0]["eval_loss"] - 1.0  # from ~5.5 (uniform over 259)
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "checkpoints" / "latest.json").is_file()


BAD_INPUT = [
    (["--set", "outer.lrr=1"], "unknown field 'outer.lrr'"),
    (["--set", "inner.batch_size=big"], "inner.batch_size"),
    (["--set", "outer.lr"], "has no '='"),
    (["--set", "data.path=/nonexistent/corpus.txt"], "data.path"),
    (["--config", "/nonexistent.yaml"], "does not exist"),
]


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """Each bad input's `train`, all started at once; by its arguments."""
    root = tmp_path_factory.mktemp("bad-input")
    results = run_clis(*(["train", *set_args(TINY), *args, "--run-dir", str(root / f"r{i}")]
                         for i, (args, _) in enumerate(BAD_INPUT)))
    return {tuple(args): result for (args, _), result in zip(BAD_INPUT, results, strict=True)}


@pytest.mark.parametrize("args, needle", BAD_INPUT)
def test_bad_input_is_one_line_exit_2_and_no_traceback(bad_input_runs, args, needle):
    out = bad_input_runs[tuple(args)]
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def _files(run_dir):
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_corrupt_or_mismatched_checkpoint_is_refused_and_left_alone(tmp_path):
    """The same run directory twice (a copy): one resumed with another config, one whose
    checkpoint tensors are garbage; both refused at once, each directory left as it was."""
    run_dir, corrupt_dir = tmp_path / "r", tmp_path / "c"
    assert run_cli(["train", *set_args(TINY + ["train.max_rounds=1"]), "--run-dir", str(run_dir)]).returncode == 0
    shutil.copytree(run_dir, corrupt_dir)
    tensor_file = next((corrupt_dir / "checkpoints").glob("*.safetensors"))
    tensor_file.write_bytes(b"garbage")
    before, before_corrupt = _files(run_dir), _files(corrupt_dir)

    mismatched, corrupt = run_clis(["train", *set_args(TINY + ["outer.lr=0.1"]), "--run-dir", str(run_dir)],
                                   ["train", *set_args(TINY), "--run-dir", str(corrupt_dir)])
    assert mismatched.returncode == 2 and "outer.lr" in mismatched.stderr and "Traceback" not in mismatched.stderr
    assert corrupt.returncode == 2 and "corrupt" in corrupt.stderr and "Traceback" not in corrupt.stderr
    assert _files(run_dir) == before
    assert _files(corrupt_dir) == before_corrupt
