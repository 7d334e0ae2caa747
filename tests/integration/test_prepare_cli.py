"""`diloco-p2p prepare`, then `diloco-p2p train` on the shards, as a user runs them: real
subprocesses, real directories."""

import json
import re

from tests.harness.procs import read_records, run_cli
from tests.harness.settings import TINY, set_args


def test_prepare_then_train_on_the_shards_and_a_corrupt_shard_is_one_line(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 400)
    (corpus / "more.jsonl").write_text("\n".join(json.dumps({"text": f"line {i} " * 50}) for i in range(40)))
    out = tmp_path / "prepared"
    prep = run_cli(["prepare", str(corpus), "--out", str(out), "--shard-tokens", "50000"])
    assert prep.returncode == 0, prep.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert f"dataset {manifest['id']}" in prep.stdout and len(manifest["shards"]) >= 3
    assert re.search(r"prepare: 100%.*[0-9.]+ ?[kMG]?B/s", prep.stderr)  # the progress bar, its rate (unit by speed)

    args = set_args(TINY + ["train.max_rounds=1", f"data.path={out}"])
    run = run_cli(["train", *args, "--run-dir", str(tmp_path / "run")])
    assert run.returncode == 0, run.stderr
    assert [r["round"] for r in read_records(tmp_path / "run")] == [0, 1]
    assert f"dataset_id: {manifest['id']}" in (tmp_path / "run" / "config.yaml").read_text()

    shard = out / manifest["shards"][1]["name"]
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = run_cli(["train", *args, "--run-dir", str(tmp_path / "run2")])
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {shard} is corrupt: its sha256 is not the manifest's; copy it again or run "
                      "`diloco-p2p prepare` again"]
