"""The dial-back probe on loopback (real p2pd daemons): a node whose port accepts connections is
public, one whose port does not is private. Through real NAT: `tests/integration/test_nat.py`."""

from __future__ import annotations

import socket

import pytest

from diloco_p2p.config import P2PConfig
from diloco_p2p.swarm.transport.reach import PUBLIC, ReachServer, ask, detect, resolve
from tests.harness.loopback import LoopbackPeers

pytestmark = pytest.mark.timeout(60)


def closed_port() -> int:
    with socket.socket() as s:  # bound and closed again: nothing listens there now
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_dials_us_back():
    with LoopbackPeers(2) as peers:
        server = ReachServer(peers.p2ps[0], dial_timeout=2.0)
        peers.loop.run(server.start(), timeout=10)
        helper, me = peers.p2ps[0].peer_id, peers.p2ps[1]
        assert peers.loop.run(detect(me, [helper]), timeout=30) == PUBLIC
        assert peers.loop.run(ask(me, helper, [closed_port()], timeout=10), timeout=30) is False
        # the whole start-up path: a short-lived p2pd of our own asks the initial peer
        assert resolve(P2PConfig(initial_peers=[peers.maddrs[0]], host_maddrs=["/ip4/127.0.0.1/tcp/0"])) == (
            PUBLIC, "an initial peer dialled this node back")
