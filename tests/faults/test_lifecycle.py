"""A node's helpers die with it: after a `kill -9` of its main process alone (what the OOM killer
does) its forked DHT process and that process's p2pd exit by themselves, and running the same
command again resumes from the node's checkpoint instead of finding its identity "already used
by a running peer"."""

from __future__ import annotations

import signal

from diloco_p2p.loop.checkpoint import load_checkpoint
from tests.harness.procs import read_records, wait_until
from tests.harness.reaping import alive, descendants
from tests.harness.swarm import ProcessSwarm

# A lone node: each round ends alone after the matchmaking timeout, so keep it short.
ALONE = ["sync.matchmaking_timeout=2"]


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "(gone)"


def test_kill_9_of_the_main_process_takes_dht_and_p2pd_along_and_a_restart_resumes(tmp_path):
    with ProcessSwarm(tmp_path) as swarm:
        node = swarm.node("n", [*ALONE, "train.max_rounds=1000"])
        swarm.release(node)
        checkpoints = node.run_dir / "checkpoints"
        wait_until(lambda: (checkpoints / "latest.json").exists(), 120, "the first checkpoint", node)
        helpers = descendants(node.pid)
        # The DHT process (forked: it keeps the node's name, `python` or `python3`) and its p2pd.
        assert sorted(_comm(p) for p in helpers) == sorted(["p2pd", _comm(node.pid)]), helpers

        node.signal(signal.SIGKILL)
        wait_until(lambda: not any(alive(p) for p in helpers), 10,
                   f"the DHT process and p2pd ({', '.join(f'{p} {_comm(p)}' for p in helpers)}) to exit")

        ckpt = load_checkpoint(checkpoints)
        assert ckpt is not None and ckpt.round >= 1
        before = len(read_records(node.run_dir))
        again = swarm.node("n", [*ALONE, f"train.max_rounds={ckpt.round + 1}"])
        assert again.wait(120) == 0, again.tail()
        assert f"resumed from checkpoint at round {ckpt.round}" in again.output()
        assert [r["round"] for r in read_records(node.run_dir)[before:]] == [ckpt.round + 1]
