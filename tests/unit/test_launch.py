"""Pure pieces of the local-rank launcher and of the per-shard swarm config."""

import pytest

from diloco_p2p.config import load_config
from diloco_p2p.errors import UserError
from diloco_p2p.fsdp_swarm import node_swarm_view, shard_config, view_hash
from diloco_p2p.launch import _describe, split_nproc_arg


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


def test_each_rank_gets_its_shard_namespace_identity_and_port():
    config = load_config(None, ["run_id=r", "p2p.identity_path=/k/id.key",
                                "p2p.host_maddrs=['/ip4/0.0.0.0/tcp/31340','/ip4/0.0.0.0/tcp/0']",
                                "p2p.announce_maddrs=['/ip4/1.2.3.4/tcp/31340']"])
    zero, one = shard_config(config, 0, 2), shard_config(config, 1, 2)
    assert (zero.run_id, one.run_id) == ("r.shard0of2", "r.shard1of2")
    assert (zero.p2p.identity_path, one.p2p.identity_path) == ("/k/id.key", "/k/id.key.rank1")
    assert one.p2p.host_maddrs == ["/ip4/0.0.0.0/tcp/31341", "/ip4/0.0.0.0/tcp/0"]
    assert one.p2p.announce_maddrs == ["/ip4/1.2.3.4/tcp/31341"]
    assert config.run_id == "r" and config.p2p.host_maddrs[0].endswith("31340")  # the node's config is untouched


def test_the_node_config_hash_covers_the_local_world_size():
    config = load_config(None, [])
    two, four = node_swarm_view(config, 2), node_swarm_view(config, 4)
    assert two["local_world_size"] == 2 and view_hash(two) != view_hash(four)
    assert {k: v for k, v in two.items() if k != "local_world_size"} == config.swarm_view()
