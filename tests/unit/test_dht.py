"""Multiaddr validation and identity files: the user's mistakes get one clear line."""

from __future__ import annotations

import pytest

from diloco_p2p.errors import UserError
from diloco_p2p.swarm.transport.dht import load_or_create_identity, peer_id_of, validate_maddrs

PEER = "12D3KooWC4q976Zm5JjybT8mVZbxWcxPhFvciyNvRHJvNAbsoa1k"


def test_valid_maddrs_come_back_as_strings():
    addrs = [
        "/ip4/127.0.0.1/tcp/0",
        f"/ip4/203.0.113.5/tcp/31337/p2p/{PEER}",
        "/dns4/seed.example.org/tcp/31337",
    ]
    assert validate_maddrs(addrs, "--host-maddrs") == addrs


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("127.0.0.1:31337", "unknown protocol"),
        ("/ip4/1.2.3/tcp/1", "not IPv4"),
        ("/ip4/1.2.3.4/tcp/70000", "not in range"),
        ("/ip4/1.2.3.4/tcp/1/p2p/notapeerid", "Invalid"),
    ],
)
def test_malformed_maddr_is_one_clear_line(bad, reason):
    with pytest.raises(UserError) as e:
        validate_maddrs([bad], "--initial-peers")
    msg = str(e.value)
    assert msg.startswith(f"--initial-peers: {bad!r} is not a valid multiaddr (expected e.g. /ip4/")
    assert reason in msg and "\n" not in msg


def test_initial_peer_without_peer_id_is_refused():
    with pytest.raises(UserError, match=r"has no /p2p/<peer id> part"):
        validate_maddrs(["/ip4/127.0.0.1/tcp/31337"], "--initial-peers", require_peer_id=True)


def test_identity_is_created_once_and_reused(tmp_path):
    path = tmp_path / "state" / "seed.key"  # the directory is created too
    assert load_or_create_identity(path) == path
    first = peer_id_of(path)
    content = path.read_bytes()
    load_or_create_identity(path)
    assert path.read_bytes() == content and peer_id_of(path) == first
    assert first.startswith(("Qm", "12D3KooW"))


def test_corrupt_identity_is_refused_not_replaced(tmp_path):
    path = tmp_path / "seed.key"
    path.write_bytes(b"this is not a key")
    with pytest.raises(UserError) as e:
        load_or_create_identity(path)
    assert str(path) in str(e.value) and "restore it from a backup, or delete it" in str(e.value)
    assert path.read_bytes() == b"this is not a key"


def test_unreadable_identity_names_the_file(tmp_path):
    path = tmp_path / "seed.key"
    path.mkdir()  # unreadable as a key file even for root (chmod 0 is not)
    with pytest.raises(UserError, match=rf"identity file {path} cannot be read \(Is a directory\)"):
        load_or_create_identity(path)
