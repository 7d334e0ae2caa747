"""Issue 50's walk: a `--set` field travels from the CLI to the round climbing back up at most 5 times
(`tests.integration.walk` says how a walk is taken and counted)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.harness.procs import REPO, child_env
from tests.integration.walk import FIELDS, walk

CLIMBS_AT_MOST = 5


def test_a_walk_counts_a_call_into_a_higher_layer_as_a_climb_and_a_second_visit_as_a_return():
    down = walk(["diloco_p2p.cli", "diloco_p2p.commands.train", "diloco_p2p.loop.node", "diloco_p2p.loop.node",
                 "diloco_p2p.swarm.sync", "diloco_p2p.swarm.collective.allreduce", "diloco_p2p.config.tree"])
    assert (down.climbs, down.returns) == (0, 0)
    assert len(down.rooms) == 6  # one module's consecutive frames are one room
    # the loop handing the swarm a callback of the command's: swarm -> commands climbs, loop.node returns
    back = walk(["diloco_p2p.cli", "diloco_p2p.commands.train", "diloco_p2p.loop.node", "diloco_p2p.swarm.sync",
                 "diloco_p2p.commands.train", "diloco_p2p.loop.node"])
    assert (back.climbs, back.returns) == (1, 2)
    # inside the swarm, a sub-package below (transport) calling one above (collective) climbs
    inner = walk(["diloco_p2p.swarm.transport.runner", "diloco_p2p.swarm.collective.allreduce"])
    assert inner.climbs == 1


def test_every_set_field_reaches_the_averaged_round_climbing_back_at_most_5_times(tmp_path):
    out = tmp_path / "walks.json"
    proc = subprocess.run([sys.executable, "-m", "tests.integration.walk", "--json", str(out)], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["record"]["status"] == "committed" and result["record"]["group_size"] == 2
    walks = result["walks"]
    assert sorted(walks) == sorted(FIELDS), "a watched field was never read: the walk missed its path"
    worst = max((w for ws in walks.values() for w in ws), key=lambda w: w["climbs"])
    assert worst["climbs"] <= CLIMBS_AT_MOST, worst["rooms"]
    from_cli = [w for ws in walks.values() for w in ws if w["rooms"][0] == "diloco_p2p.cli"]
    assert any("diloco_p2p.swarm" in room for w in from_cli for room in w["rooms"]), "no read on the way to the swarm"
