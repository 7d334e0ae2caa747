"""`diloco-p2p train` as a user runs it: real subprocesses, real run directories."""


import pytest

from tests.harness.procs import read_records, run_cli
from tests.harness.settings import TINY, set_args


def test_resume_gives_the_same_parameters_as_a_straight_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = set_args(TINY + ["data.order_key=fixed", "inner.total_steps=20"])
    assert run_cli(["train", *common, "--run-dir", str(straight)]).returncode == 0
    first = run_cli(["train", *common, "--set", "train.max_rounds=2", "--run-dir", str(resumed)])
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


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "outer.lrr=1"], "unknown field 'outer.lrr'"),
        (["--set", "inner.batch_size=big"], "inner.batch_size"),
        (["--set", "outer.lr"], "has no '='"),
        (["--set", "data.path=/nonexistent/corpus.txt"], "data.path"),
        (["--config", "/nonexistent.yaml"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_traceback(tmp_path, args, needle):
    out = run_cli(["train", *set_args(TINY), *args, "--run-dir", str(tmp_path / "r")])
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_corrupt_or_mismatched_checkpoint_is_refused_and_left_alone(tmp_path):
    run_dir = tmp_path / "r"
    assert run_cli(["train", *set_args(TINY + ["train.max_rounds=1"]), "--run-dir", str(run_dir)]).returncode == 0
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    mismatched = run_cli(["train", *set_args(TINY + ["outer.lr=0.1"]), "--run-dir", str(run_dir)])
    assert mismatched.returncode == 2 and "outer.lr" in mismatched.stderr and "Traceback" not in mismatched.stderr

    tensor_file = next((run_dir / "checkpoints").glob("*.safetensors"))
    tensor_file.write_bytes(b"garbage")
    before[tensor_file] = b"garbage"
    corrupt = run_cli(["train", *set_args(TINY), "--run-dir", str(run_dir)])
    assert corrupt.returncode == 2 and "corrupt" in corrupt.stderr and "Traceback" not in corrupt.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
