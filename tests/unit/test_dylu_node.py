"""The loop under outer.dynamic_local_updates: a node at half the speed of its group runs H/2 steps."""

from __future__ import annotations

from diloco_p2p.config import load_config
from diloco_p2p.contract import SoloSync
from diloco_p2p.loop.node import Node

SMALL = ["model.preset=tiny", "data.max_bytes=200000", "data.eval_fraction=0.05", "inner.batch_size=2",
         "inner.seq_len=32", "inner.warmup_steps=1", "outer.inner_steps=4", "train.eval_batches=0",
         "train.num_threads=1", "train.device=cpu", "train.max_rounds=2"]


class GroupOfTwo(SoloSync):
    """Alone, but as if the last group measured us at half the speed of its fastest member."""

    def __init__(self, peer_id: str):
        super().__init__(peer_id)
        self.speeds = {"me": 50.0, "fast": 100.0}


def test_a_node_at_half_the_group_speed_runs_half_the_inner_steps(tmp_path):
    on = Node(load_config(None, [*SMALL, "outer.dynamic_local_updates=true"]), tmp_path / "on", GroupOfTwo("me"),
              progress=False).run()
    off = Node(load_config(None, SMALL), tmp_path / "off", GroupOfTwo("me"), progress=False).run()
    assert [r.step for r in on[1:]] == [2, 4]
    assert [r.step for r in off[1:]] == [4, 8]
    assert on[1].tokens * 2 == off[1].tokens  # the round's weight (tokens) says so to the average
