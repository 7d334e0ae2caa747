"""The node's round lines: the prefix names the round and step the line is about; every loss has
4 decimals, round 0's too."""

from __future__ import annotations

import io
import re

from diloco_p2p.config import load_config
from diloco_p2p.logs import setup_logging
from diloco_p2p.loop.node import Node

SMALL = ["model.preset=tiny", "data.max_bytes=200000", "data.eval_fraction=0.05", "inner.batch_size=2",
         "inner.seq_len=32", "inner.warmup_steps=1", "outer.inner_steps=3", "train.eval_batches=1",
         "train.num_threads=1", "train.device=cpu", "train.max_rounds=2"]


def test_round_lines_carry_their_own_round_and_step_and_round_0_is_rounded(tmp_path):
    stream = io.StringIO()
    setup_logging("INFO", stream=stream)
    Node(load_config(None, SMALL), tmp_path / "run", progress=False).run()
    lines = [line for line in stream.getvalue().splitlines() if "diloco_p2p.loop.node: round " in line]
    assert len(lines) == 3, lines
    for line in lines:
        m = re.search(r"\[peer=\S+ round=(\d+) step=(\d+)\] diloco_p2p.loop.node: round (\d+)", line)
        assert m and m.group(1) == m.group(3), line
        said = re.search(r"  step (\d+)  ", line)
        assert m.group(2) == (said.group(1) if said else "0"), line
        assert all(len(x.split(".")[1]) == 4 for x in re.findall(r"(?:loss|eval) (\d+\.\d+)", line)), line
    assert re.search(r"round 0: eval loss \d+\.\d{4} of", lines[0]), lines[0]
    assert "step=6]" in lines[-1]
