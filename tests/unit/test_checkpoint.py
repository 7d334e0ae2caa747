import json
import os
import resource
import subprocess
import sys

import pytest
import torch

from diloco_p2p.errors import UserError
from diloco_p2p.loop.checkpoint import (
    Checkpoint,
    join_tensors,
    load_checkpoint,
    save_checkpoint,
    split_tensors,
)


def _ckpt(round_: int) -> Checkpoint:
    return Checkpoint(round=round_, step=10 * round_, tokens=5, tensors={"outer.theta": torch.arange(4.0)},
                      meta={"swarm_view": {"outer.lr": 0.7}})


def test_optimizer_state_round_trips_without_pickle():
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.AdamW([p], betas=(0.9, 0.95))
    p.grad = torch.ones_like(p)
    opt.step()
    tensors: dict[str, torch.Tensor] = {}
    skeleton = split_tensors(opt.state_dict(), tensors, "inner")
    restored = join_tensors(json.loads(json.dumps(skeleton)), tensors)
    opt2 = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())])
    opt2.load_state_dict(restored)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)
    assert torch.equal(opt2.state[opt2.param_groups[0]["params"][0]]["exp_avg"], opt.state[p]["exp_avg"])


def test_latest_wins_and_old_ones_are_pruned(tmp_path):
    for r in (1, 2, 3):
        save_checkpoint(tmp_path, _ckpt(r))
    assert load_checkpoint(tmp_path).round == 3
    assert sorted(f.name for f in tmp_path.glob("round-*.json")) == ["round-000002.json", "round-000003.json"]


def test_corrupt_tensor_file_is_refused(tmp_path):
    save_checkpoint(tmp_path, _ckpt(1))
    f = next(tmp_path.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:-3] + b"xyz")
    with pytest.raises(UserError, match="corrupt"):
        load_checkpoint(tmp_path)


def test_unreadable_pointer_and_mismatched_config(tmp_path):
    save_checkpoint(tmp_path, _ckpt(1))
    with pytest.raises(UserError, match=r"outer.lr: 0.5 != 0.7"):
        load_checkpoint(tmp_path, swarm_view={"outer.lr": 0.5})
    # written before the all-reduce's protocol joined the view: the config is what must match
    assert load_checkpoint(tmp_path, swarm_view={"outer.lr": 0.7, "protocol": 5}).round == 1
    (tmp_path / "latest.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        load_checkpoint(tmp_path)


def test_no_checkpoint_is_none(tmp_path):
    assert load_checkpoint(tmp_path) is None


def _ckpt_of(round_: int, values: int, pad: int = 0) -> Checkpoint:
    return Checkpoint(round=round_, step=round_, tokens=0, tensors={"outer.theta": torch.zeros(values)},
                      meta={"swarm_view": {}, "pad": "x" * pad})


def test_a_corrupt_latest_names_the_intact_older_one_and_how_to_resume_from_it(tmp_path):
    for r in (1, 2):
        save_checkpoint(tmp_path, _ckpt(r))
    (tmp_path / "round-000002.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError) as e:
        load_checkpoint(tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {tmp_path / 'round-000002.safetensors'} is corrupt (sha256 mismatch)")
    assert "older checkpoint of round 1 beside it is intact" in msg and "--set train.resume_round=1" in msg
    assert load_checkpoint(tmp_path, round=1).round == 1
    with pytest.raises(UserError, match=r"train.resume_round=5: .* has no checkpoint of round 5 \(it has rounds \[1, 2\]\)"):
        load_checkpoint(tmp_path, round=5)


def test_with_no_intact_older_one_it_says_restore(tmp_path):
    for r in (1, 2):
        save_checkpoint(tmp_path, _ckpt(r))
    (tmp_path / "round-000001.json").write_text("{")
    (tmp_path / "round-000002.json").unlink()
    with pytest.raises(UserError) as e:
        load_checkpoint(tmp_path)
    assert "round-000002.json is unreadable (FileNotFoundError" in str(e.value)
    assert str(e.value).endswith("restore it or start with a new --run-dir")


@pytest.mark.parametrize("failing, values, pad", [("safetensors", 100_000, 0), ("json", 10, 20_000)])
def test_a_failed_write_leaves_the_previous_checkpoint_as_latest_and_no_file_of_its_round(
        tmp_path, failing, values, pad):
    save_checkpoint(tmp_path, _ckpt_of(1, 10))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))  # Python ignores SIGXFSZ: writes fail with EFBIG
    try:
        with pytest.raises(UserError) as e:
            save_checkpoint(tmp_path, _ckpt_of(2, values, pad))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(e.value).startswith(f"cannot write checkpoint {tmp_path / f'round-000002.{failing}'} (File too large)")
    assert sorted(os.listdir(tmp_path)) == ["latest.json", "round-000001.json", "round-000001.safetensors"]
    assert load_checkpoint(tmp_path).round == 1


# Writes round 1, then a round 2 too big for the disk; prints the error, then what loads.
FILL_THE_DISK = """
import os, sys, torch
from diloco_p2p.loop.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from diloco_p2p.errors import UserError
d = __import__("pathlib").Path(sys.argv[1]) / "checkpoints"
save_checkpoint(d, Checkpoint(round=1, step=1, tokens=0, tensors={"t": torch.zeros(10)}))
try:
    save_checkpoint(d, Checkpoint(round=2, step=2, tokens=0, tensors={"t": torch.zeros(1_000_000)}))
except UserError as e:
    print(e)
print(load_checkpoint(d).round, sorted(os.listdir(d)))
"""


def test_disk_full_is_one_line_naming_the_file(tmp_path):
    """A real ENOSPC: a 256 kB tmpfs (a mount namespace of its own; skipped where that is refused)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = 'mount -t tmpfs -o size=256k tmpfs "$0" && exec "$@"'
    out = subprocess.run(["unshare", *(["-m"] if os.geteuid() == 0 else ["-rm"]), "sh", "-c", mount, str(disk),
                          sys.executable, "-c", FILL_THE_DISK, str(disk)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "Traceback" not in out.stderr:
        pytest.skip(f"cannot mount a small tmpfs here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    error, loaded = out.stdout.splitlines()
    assert error.startswith(f"cannot write checkpoint {disk / 'checkpoints' / 'round-000002.safetensors'} "
                            "(No space left on device); free space there or choose another --run-dir")
    assert loaded == "1 ['latest.json', 'round-000001.json', 'round-000001.safetensors']"
