"""Pure pieces of the local-rank launcher and of the per-shard swarm config."""

import os
import subprocess
import sys

import pytest

from diloco_p2p.config import load_config
from diloco_p2p.contract import view_hash
from diloco_p2p.errors import UserError
from diloco_p2p.local.launch import _describe, split_nproc_arg
from diloco_p2p.swarm.multirank import node_swarm_view, rank_p2p, shard_run_id
from tests.harness.procs import REPO


@pytest.mark.parametrize(
    "argv, rest, n",
    [
        (["--nproc-per-node", "4", "--set", "a.b=1"], ["--set", "a.b=1"], 4),
        (["--set", "a.b=1", "--nproc-per-node=2"], ["--set", "a.b=1"], 2),
        (["--nproc_per_node", "3"], [], 3),
        (["--run-dir", "x"], ["--run-dir", "x"], None),
    ],
)
def test_nproc_flag_is_taken_out_of_the_ranks_argv(argv, rest, n):
    assert split_nproc_arg(argv) == (rest, n)


@pytest.mark.parametrize("argv", [["--nproc-per-node", "two"], ["--nproc-per-node=0"], ["--nproc-per-node"]])
def test_bad_nproc_is_a_user_error(argv):
    with pytest.raises(UserError, match="--nproc-per-node"):
        split_nproc_arg(argv)


def test_exit_codes_are_described_for_humans():
    assert _describe(3) == "exited with code 3"
    assert _describe(-9) == "was killed by SIGKILL"


def test_the_ranks_run_the_entry_the_launcher_was_started_as(tmp_path):
    """`python -m tests.faults.node train --nproc-per-node 2` spawns ranks with the same faults."""
    (tmp_path / "entry.py").write_text("from diloco_p2p.local.launch import entry_module; print(entry_module())")

    def entry(*argv: str) -> str:
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), check=True).stdout.strip()

    assert entry("-m", "entry") == "entry"
    assert entry("entry.py") == "diloco_p2p"  # a script, as the `diloco-p2p` command is


def test_each_rank_gets_its_shard_namespace_identity_and_port():
    config = load_config(None, ["run_id=r", "p2p.identity_path=/k/id.key",
                                "p2p.host_maddrs=['/ip4/0.0.0.0/tcp/31340','/ip4/0.0.0.0/tcp/0']",
                                "p2p.announce_maddrs=['/ip4/1.2.3.4/tcp/31340']"])
    zero, one = rank_p2p(config.p2p, 0), rank_p2p(config.p2p, 1)
    assert (shard_run_id("r", 0, 2), shard_run_id("r", 1, 2)) == ("r.shard0of2", "r.shard1of2")
    assert (zero.identity_path, one.identity_path) == ("/k/id.key", "/k/id.key.rank1")
    assert one.host_maddrs == ["/ip4/0.0.0.0/tcp/31341", "/ip4/0.0.0.0/tcp/0"]
    assert one.announce_maddrs == ["/ip4/1.2.3.4/tcp/31341"]
    assert config.run_id == "r" and config.p2p.host_maddrs[0].endswith("31340")  # the node's config is untouched


def test_the_node_config_hash_covers_the_local_world_size():
    config = load_config(None, [])
    two, four = node_swarm_view(config, 2), node_swarm_view(config, 4)
    assert two["local_world_size"] == 2 and view_hash(two) != view_hash(four)
    assert {k: v for k, v in two.items() if k != "local_world_size"} == config.swarm_view()
