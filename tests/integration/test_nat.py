"""Volunteers behind NAT (issue #15), through real NAT: no mocks.

Six hosts in network namespaces (`tests.netns`, prefix ``nt``): a seed and two public nodes a, b
on the bridge, and three private nodes p, q, r, each behind its own home router that masquerades
its outbound connections and drops every inbound one. Nobody is told who is private: each node
asks the seed to dial it back (`swarm.transport.reach`) and learns it. One topology, one swarm, in order:

1. a, b, p, q average every round in one group of four with identical θ; the private nodes
   reduced nothing (their bytes are n each way, the public ones' twice that).
2. p is SIGKILLed mid-all-reduce (after sending its parts); a, b and q commit that round.
3. r (new) and p (restarted from its checkpoint) join mid-run, download the swarm's state from a
   public node (private nodes serve none) and average with the others.
4. b leaves: one public node and three private ones still average in one group, and every
   node's log and `status` say the swarm has too few public peers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from diloco_p2p.swarm.transport.dht import peer_id_of
from tests import netns
from tests.harness.procs import REPO, child_env, diloco, wait_until
from tests.harness.swarm import ProcessSwarm

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not netns.nat_available(), reason="needs root, iproute2 and iptables for NAT namespaces"),
]

# max_rounds: the test stops them, only a leak bound; reachability: detected, not the harness's `public`
OPTS = ["train.max_rounds=1000", "sync.matchmaking_timeout=8", "p2p.reachability=auto"]


class Topology:
    def __init__(self, hosts: netns.Hosts, swarm: ProcessSwarm):
        self.hosts, self.swarm = hosts, swarm
        self.nodes: dict = {}

    def start(self, name: str, i: int, env: dict[str, str] | None = None):
        self.nodes[name] = self.swarm.node(name, OPTS, host=self.hosts[i], env=env)
        return self.nodes[name]

    def status(self) -> list[dict]:
        """`diloco-p2p status --json`, run on the seed's host."""
        out = subprocess.run([*self.hosts[0].prefix(), sys.executable, *diloco(
            "status", "--initial-peers", self.swarm.maddr, "--run-id", "swarm-test", "--json")],
            capture_output=True, text=True, timeout=90, cwd=REPO, env=child_env())
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    with netns.Hosts(6, private=(3, 4, 5), tag="nt") as hosts:
        with ProcessSwarm(tmp_path_factory.mktemp("nat"), seed_host=hosts[0]) as swarm:
            t = Topology(hosts, swarm)
            t.start("a", 1), t.start("b", 2)
            t.start("p", 3, env={"DILOCO_P2P_FAULTS": "kill@allreduce:3"}), t.start("q", 4)
            swarm.release(*t.nodes.values())
            yield t


def committed_together(nodes, rnd: int, size: int) -> bool:
    records = [n.by_round().get(rnd) for n in nodes]
    return all(r is not None and r["status"] == "committed" and r["group_size"] == size for r in records) and len(
        {r["params_sha256"] for r in records}) == 1


def test_nodes_learn_their_reachability_and_all_four_commit_every_round(topo):
    a, b, p, q = (topo.nodes[n] for n in "abpq")
    for rnd in (1, 2):
        wait_until(lambda rnd=rnd: all(rnd in n.by_round() for n in (a, b, p, q)), 90, f"round {rnd}", a, b, p, q)
        assert committed_together((a, b, p, q), rnd, 4), [n.by_round()[rnd] for n in (a, b, p, q)]
    for node, seen in ((a, "public"), (b, "public"), (p, "private"), (q, "private")):
        assert f"reachability: {seen}" in node.output(), node.tail()
    # Private members reduce nothing: they send n values, a public one (k+P-2)/P·n = 2n here.
    sent = {n.run_dir.name: n.by_round()[2]["bytes_sent"] for n in (a, b, p, q)}
    assert all(1.8 < sent[pub] / sent[priv] < 2.2 for pub in "ab" for priv in "pq"), sent


def test_private_node_killed_mid_allreduce_the_others_commit(topo):
    a, b, p, q = (topo.nodes[n] for n in "abpq")
    wait_until(p.exited, 90, "p to die in its round-3 all-reduce", a, b, q)
    wait_until(lambda: all(3 in n.by_round() for n in (a, b, q)), 90, "round 3 without p", a, b, q)
    records = [n.by_round()[3] for n in (a, b, q)]
    assert all(r["status"] == "committed" for r in records), records
    assert len({r["params_sha256"] for r in records}) == 1
    assert all(r["parts_committed"] == r["parts"] for r in records)  # p reduced no part: nothing lost


def test_private_nodes_join_mid_run_and_catch_up(topo):
    a, b, q = (topo.nodes[n] for n in "abq")
    joined_at = max(a.by_round())
    r = topo.start("r", 5)
    p = topo.start("p", 3)  # the same run dir: resumes from its checkpoint, behind the swarm
    everyone = (a, b, q, r, p)

    def caught_up() -> bool:
        rounds = [set(n.by_round()) for n in everyone]
        return any(committed_together(everyone, rnd, 5) for rnd in set.intersection(*rounds) if rnd > joined_at)

    wait_until(caught_up, 120, "r and p to catch up and average with the swarm", *everyone)
    public = {peer_id_of(n.run_dir / "identity.key") for n in (a, b)}
    for node in (r, p):  # private nodes serve no state: the donor was public
        assert any(rec["status"] == "resynced" and rec["donor"] in public for rec in node.records()), node.records()


def test_one_public_and_three_private_nodes_average_and_say_so(topo):
    a, b, q, r, p = (topo.nodes[n] for n in "abqrp")
    b.signal(15)  # SIGTERM: b leaves cleanly (withdraws its records)
    assert b.wait(60) == 0
    left_at = max(a.by_round())
    rest = (a, q, r, p)
    wait_until(lambda: any(committed_together(rest, rnd, 4) for rnd in range(left_at + 1, max(a.by_round()) + 1)),
               120, "a, p, q, r to average as four", *rest)
    # each node says so once its records show b gone (a tombstone that may reach a node a round later)
    wait_until(lambda: all("too few public peers: 1 of 4" in n.output() for n in rest), 60,
               "every node to warn about too few public peers", *rest)
    rows = topo.status()
    reach = {row["peer_id"]: row["reachability"] for row in rows}
    assert sorted(reach.values()) == ["private", "private", "private", "public"], rows
    assert "too few public peers" in rows[0]["swarm_warning"]
