import json

import pytest
import torch

from diloco_p2p.checkpoint import Checkpoint, join_tensors, load_checkpoint, save_checkpoint, split_tensors
from diloco_p2p.errors import UserError


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
    (tmp_path / "latest.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        load_checkpoint(tmp_path)


def test_no_checkpoint_is_none(tmp_path):
    assert load_checkpoint(tmp_path) is None
