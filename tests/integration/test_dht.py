"""start_dht against real p2pd daemons on loopback: clear errors, bounded waits, nothing left over."""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

import pytest
from hivemind.p2p import P2P

from diloco_p2p.config import P2PConfig
from diloco_p2p.errors import UserError
from diloco_p2p.swarm.transport.dht import peer_id_of, start_dht, visible_maddrs
from tests.harness import reaping

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _random_peer_id(tmp_path: Path) -> str:
    key = tmp_path / f"{uuid.uuid4().hex}.key"
    P2P.generate_identity(str(key))
    return peer_id_of(key)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_gone(marker: str, deadline_s: float) -> list[int]:
    deadline = time.monotonic() + deadline_s
    # our DHT and its p2pd inherit the marker; torch's shared-memory manager is not ours to judge
    while (left := reaping.marked(marker, "1")) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_malformed_initial_peer_fails_before_starting_anything():
    cfg = P2PConfig(initial_peers=["/ip4/127.0.0.1/tcp/31337/p2p/nonsense"], host_maddrs=LOOPBACK)
    with pytest.raises(UserError, match=r"p2p.initial_peers: .* is not a valid multiaddr \(expected e.g."):
        start_dht(cfg, None)
    with pytest.raises(UserError, match=r"p2p.host_maddrs: 'localhost:0' is not a valid multiaddr"):
        start_dht(P2PConfig(host_maddrs=["localhost:0"]), None)
    with pytest.raises(UserError, match=r"port 0"):
        start_dht(P2PConfig(host_maddrs=LOOPBACK, announce_maddrs=["/ip4/203.0.113.5/tcp/0"]), None)


def test_unreachable_peer_is_a_clear_error_within_the_timeout(tmp_path, monkeypatch):
    marker = f"DILOCO_TEST_{uuid.uuid4().hex}"
    monkeypatch.setenv(marker, "1")
    peer = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{_random_peer_id(tmp_path)}"
    cfg = P2PConfig(initial_peers=[peer], host_maddrs=LOOPBACK, connect_timeout=3.0)
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        start_dht(cfg, tmp_path / "id.key")
    assert time.monotonic() - t0 < cfg.connect_timeout + 2.0
    assert str(e.value).startswith("could not reach any initial peer (/ip4/127.0.0.1/tcp/")
    assert _wait_gone(marker, 5.0) == []


def test_silent_peer_hits_connect_timeout_and_the_dht_is_killed(tmp_path, monkeypatch):
    """A peer that accepts TCP and never answers (a black hole on the internet behaves alike):
    p2pd alone would wait ~5 s; our deadline fires first and leaves no process behind."""
    marker = f"DILOCO_TEST_{uuid.uuid4().hex}"
    monkeypatch.setenv(marker, "1")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        peer = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/{_random_peer_id(tmp_path)}"
        cfg = P2PConfig(initial_peers=[peer], host_maddrs=LOOPBACK, connect_timeout=1.5)
        t0 = time.monotonic()
        with pytest.raises(UserError) as e:
            start_dht(cfg, None)
        elapsed = time.monotonic() - t0
    assert elapsed < cfg.connect_timeout + 2.5
    assert "within 1.5 s (p2p.connect_timeout)" in str(e.value)
    assert _wait_gone(marker, 5.0) == []


def test_two_nodes_join_and_the_peer_id_follows_the_identity(tmp_path):
    key = tmp_path / "a.key"
    a = start_dht(P2PConfig(host_maddrs=LOOPBACK), key)
    try:
        addrs = visible_maddrs(a)
        assert addrs and all(m.endswith(f"/p2p/{peer_id_of(key)}") for m in addrs)
        b = start_dht(P2PConfig(initial_peers=addrs, host_maddrs=LOOPBACK, connect_timeout=20), None)
        try:
            assert a.peer_id.to_base58() == peer_id_of(key)
            assert b.peer_id != a.peer_id
        finally:
            b.shutdown()
    finally:
        a.shutdown()


def test_an_identity_in_use_is_refused_with_one_line(tmp_path):
    key = tmp_path / "shared.key"
    a = start_dht(P2PConfig(host_maddrs=LOOPBACK), key)
    try:
        cfg = P2PConfig(initial_peers=visible_maddrs(a), host_maddrs=LOOPBACK, connect_timeout=20)
        with pytest.raises(UserError, match=rf"identity {key} is already used by a running peer"):
            start_dht(cfg, key)
    finally:
        a.shutdown()


def test_failed_starts_do_not_wedge_later_dhts_of_this_process(tmp_path):
    """Regression: terminating a DHT process right after it reported its error could kill it
    while it held hivemind's process-shared MPFuture lock; every later DHT of this process then
    hung. Measured with that code: the 13th refused start wedged the next DHT."""
    bad = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{_random_peer_id(tmp_path)}"
    a = start_dht(P2PConfig(host_maddrs=LOOPBACK), None)
    try:
        for _ in range(8):
            with pytest.raises(UserError, match="could not reach any initial peer"):
                start_dht(P2PConfig(initial_peers=[bad], host_maddrs=LOOPBACK), None)
        b = start_dht(
            P2PConfig(initial_peers=visible_maddrs(a), host_maddrs=LOOPBACK, connect_timeout=20), None
        )
        b.shutdown()
    finally:
        a.shutdown()
