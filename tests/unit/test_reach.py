"""Reachability's pure parts: which ports a probe asks for, what a swarm with too few public nodes
is told (log and `status`), and the status row. The probe itself runs on loopback in
`tests/integration/test_reach.py` and through real NAT in `tests/integration/test_nat.py`."""

from __future__ import annotations

from diloco_p2p.config import P2PConfig
from diloco_p2p.ops.status import format_warning, status_rows
from diloco_p2p.swarm.membership.records import ProgressRecord
from diloco_p2p.swarm.transport.reach import PRIVATE, PUBLIC, observed_host, resolve, shortage, tcp_ports

PEER = "QmZXf19uXjuRJiLLUV1ipad3YtYm8BVkt5VNp8pia8fUGr"


def test_probe_ports_and_observed_host():
    maddrs = ["/ip4/10.0.0.1/tcp/31337/p2p/" + PEER, "/ip4/10.0.0.2/tcp/31337", "/ip4/1.2.3.4/udp/9/quic",
              "/ip6/::1/tcp/40000"]
    assert tcp_ports(maddrs) == [31337, 40000]
    assert observed_host("/ip4/203.0.113.5/tcp/5555") == "203.0.113.5"
    assert observed_host("/ip6/::1/tcp/1") == "::1" and observed_host("garbage") is None


def test_forced_or_first_node_needs_no_probe():
    assert resolve(P2PConfig(reachability="private"))[0] == PRIVATE
    assert resolve(P2PConfig(reachability="public", initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/" + PEER]))[0] == PUBLIC
    assert resolve(P2PConfig())[0] == PUBLIC  # no initial peer: the first node of a swarm


def test_too_few_public_peers_is_reported():
    assert shortage(2, 2) is None and shortage(3, 0) is None
    assert "too few public peers: 1 of 4" in shortage(1, 3)
    assert "no public peer" in shortage(0, 2)


def _record(peer: str, reachability: str | None) -> ProgressRecord:
    return ProgressRecord.build(peer_id=peer, round=1, step=5, tokens=10, tokens_per_s=1.0, params_sha256="a" * 64,
                                config_hash="b" * 64, config_view={}, reachability=reachability)


def test_status_shows_reachability_and_the_warning():
    peers = [PEER[:-1] + c for c in "ABCD"]
    records = {peers[0]: _record(peers[0], None), **{p: _record(p, "private") for p in peers[1:]}}
    rows = status_rows(records, now=0.0)
    assert sorted(r["reachability"] for r in rows) == ["private", "private", "private", "public"]
    assert "WARNING: too few public peers: 1 of 4" in format_warning(rows)
    records[peers[1]] = _record(peers[1], "public")
    records[peers[2]] = _record(peers[2], "public")
    assert format_warning(status_rows(records, now=0.0)) == ""
