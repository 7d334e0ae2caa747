"""Membership at scale (issue 17): matchmaking's DHT traffic per node and round does not grow with
the swarm, every node at a round ends in the one group, and a late node is told it is late (it
catches up by a state download) instead of forming a second group with other late nodes.

Hundreds of `Matchmaker`s run in this process on in-memory stand-ins for the DHT and p2pd
(`tests.harness.inmemory`), which count each node's DHT gets and stores.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.harness.inmemory import one_round

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def rounds():
    return {n: asyncio.run(one_round(n)) for n in (4, 16, 64)}


@pytest.mark.parametrize("n", [4, 16, 64])
def test_every_node_of_the_round_ends_in_one_group(rounds, n):
    r = rounds[n]
    assert len(r["groups"]) == 1 and r["sizes"] == [n] * n and set(r["outcomes"]) == {"group"}


def test_dht_calls_per_node_do_not_grow_with_the_swarm(rounds):
    """One registration, one read of the round's key, one withdrawal: the same at 4 and 64 nodes.
    What grows is what a read returns (one entry per registered node: a single key with subkeys)."""
    for n, r in rounds.items():
        assert r["stores"] == [2] * n, (n, r["stores"])
        assert max(r["gets"]) == 1, (n, r["gets"])
        assert max(r["entries_read"]) <= n
    assert max(rounds[64]["gets"]) + max(rounds[64]["stores"]) <= max(rounds[4]["gets"]) + max(rounds[4]["stores"])


def test_a_missing_node_costs_the_leader_bounded_reads_not_the_followers():
    """An expected node that never comes (dead, its record still live): the group waits for it
    until the timeout; only the leader re-reads the key meanwhile, every request_timeout / 2."""
    counts = {}
    for n in (4, 32):
        r = asyncio.run(one_round(n, ghosts=1, timeout=2.0))
        assert len(r["groups"]) == 1 and r["sizes"] == [n] * n
        gets = sorted(r["gets"])
        assert gets[:-1] == [1] * (n - 1)  # followers: one read
        counts[n] = gets[-1]
    assert 1 < counts[32] <= 2.0 / 0.5 + 2 and counts[32] <= counts[4] + 1


def test_late_nodes_are_late_together_never_a_second_group():
    r = asyncio.run(one_round(8, late=3))
    assert len(r["groups"]) == 1 and r["sizes"] == [8] * 8 + [1] * 3
    assert r["outcomes"] == ["group"] * 8 + ["late"] * 3
