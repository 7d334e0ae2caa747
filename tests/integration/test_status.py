"""`status` against real DHT nodes on loopback: what it lists, and how it fails."""

from __future__ import annotations

import io
import json
import socket

import pytest
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from diloco_p2p.config import Config, P2PConfig
from diloco_p2p.logs import short_peer
from diloco_p2p.ops.status import run_status
from diloco_p2p.swarm.membership.records import (
    ProgressRecord,
    progress_key,
    progress_validator,
    publish_progress,
    read_progress,
    withdraw_progress,
)
from diloco_p2p.swarm.transport.dht import peer_id_of, start_dht, visible_maddrs
from diloco_p2p.swarm.trust.signing import own_subkey

RUN = "status-test"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _record(peer: str, round: int, params: str, train_loss: float | None = 3.5) -> ProgressRecord:
    cfg = Config(run_id=RUN)
    return ProgressRecord.build(
        peer_id=peer,
        round=round,
        step=round * 10,
        tokens=round * 1280,
        tokens_per_s=100.0 + round,
        params_sha256=params * 64,
        config_hash=cfg.swarm_hash(),
        config_view=cfg.swarm_view(),
        status="committed",
        train_loss=train_loss,
        group_size=2,
    )


@pytest.fixture(scope="module")
def swarm():
    """Two DHT nodes A and B publish their records; C publishes one that disagrees at round 5
    and leaves (its record lingers), D publishes one and withdraws it. B also stores a record
    of its own signed under A's peer id (a forgery: every reader refuses it, naming B), and
    claims in its record that it excludes C."""
    validators = [progress_validator(RUN)]
    a = start_dht(P2PConfig(host_maddrs=LOOPBACK), None, record_validators=validators)
    joined = P2PConfig(initial_peers=visible_maddrs(a), host_maddrs=LOOPBACK)
    b, c, d = (start_dht(joined, None, record_validators=validators) for _ in range(3))
    try:
        pa, pb, pc, pd = (x.peer_id.to_base58() for x in (a, b, c, d))
        assert publish_progress(a, RUN, _record(pa, 5, "a"), ttl=120)
        excludes_c = ProgressRecord.build(**{**_record(pb, 5, "a", train_loss=None).dict(), "excluded": {pc: "bad-state"}})
        assert publish_progress(b, RUN, excludes_c, ttl=120)
        assert publish_progress(c, RUN, _record(pc, 5, "b"), ttl=120)  # disagrees at round 5
        assert publish_progress(d, RUN, _record(pd, 4, "c"), ttl=120)
        assert withdraw_progress(d, RUN, pd)
        # B's key, A's id: hivemind's validator takes B's signature, our readers refuse the entry
        forged = b.store(progress_key(RUN), _record(pa, 9, "f").dict(), get_dht_time() + 120,
                         subkey=own_subkey(b, pb).replace(pb, pa, 1))
        assert forged  # storing peers only check the signature; the binding to the peer id is the readers'
        refused = []
        assert set(read_progress(b, RUN, timeout=10, on_reject=lambda *x: refused.append(x))) == {pa, pb, pc}
        assert [(peer, reason) for peer, reason, _ in refused] == [(pb, "forged-record")]
        assert read_progress(b, RUN, timeout=10)[pa].round == 5  # A's own record is untouched
        yield visible_maddrs(a), pa, pb, pc
    finally:
        for x in (d, c, b, a):
            x.shutdown()


def _status(peers, run_id=RUN, as_json=True, timeout=10.0) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = run_status(peers, run_id, as_json=as_json, timeout=timeout, out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def test_status_json_lists_every_node_with_its_round_and_agreement(swarm):
    maddrs, pa, pb, pc = swarm
    rc, out, err = _status(maddrs)
    assert rc == 0, err
    listed = json.loads(out)
    rows = {row["peer_id"]: row for row in listed}
    assert set(rows) == {pa, pb, pc}  # the withdrawn record is not listed, the forged one neither
    assert {p: r["round"] for p, r in rows.items()} == {pa: 5, pb: 5, pc: 5}
    assert {p: r["hash_agrees"] for p, r in rows.items()} == {pa: True, pb: True, pc: False}
    assert rows[pb]["excluded"] == {pc: "bad-state"} and rows[pa]["excluded"] == {}
    assert listed[0]["status_saw_forged"] == {pb: "forged-record"}
    assert rows[pa]["tokens_per_s"] == 105.0 and rows[pa]["train_loss"] == 3.5
    assert rows[pb]["train_loss"] is None
    assert all(0 <= r["last_seen_s"] < 60 for r in rows.values())


def test_status_table_has_one_row_per_node(swarm):
    maddrs, pa, pb, pc = swarm
    rc, out, err = _status(maddrs, as_json=False)
    assert rc == 0, err
    table, excluded = out.strip().split("\n\nEXCLUDED PEERS\n")
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["PEER", "ROUND", "TOKENS/S"]
    by_peer = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(by_peer) == {short_peer(pa), short_peer(pb), short_peer(pc)}
    assert by_peer[short_peer(pa)][1] == "5" and by_peer[short_peer(pa)][6] == "yes"
    assert by_peer[short_peer(pc)][6] == "no"
    assert by_peer[short_peer(pb)][3] == "-"  # no train loss yet
    assert set(excluded.splitlines()) == {f"  {pb}  forged-record  (by 1 node)", f"  {pc}  bad-state  (by 1 node)"}


def test_status_for_a_run_without_records_fails_with_one_line(swarm):
    maddrs, *_ = swarm
    rc, out, err = _status(maddrs, run_id="nobody-runs-this")
    assert rc == 2 and out == ""
    assert err.startswith("error: no progress records for run id 'nobody-runs-this'") and err.count("\n") == 1


def test_status_against_an_unreachable_dht_fails_with_one_line(tmp_path):
    key = tmp_path / "k"
    P2P.generate_identity(str(key))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, out, err = _status([f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id_of(key)}"], timeout=5.0)
    assert rc == 2 and out == ""
    assert err.startswith("error: could not reach any initial peer") and err.count("\n") == 1


def test_status_with_a_malformed_or_missing_address_fails_with_one_line():
    rc, _, err = _status(["seed.example.org:31337"])
    assert rc == 2 and err.startswith(
        "error: p2p.initial_peers: 'seed.example.org:31337' is not a valid multiaddr"
    )
    rc, _, err = _status([])
    assert rc == 2 and err.startswith("error: status needs --initial-peers")


def test_async_records_api_runs_on_the_event_loop(swarm):
    """The coroutine variants await hivemind's futures on our loop (what swarm components use)."""
    from diloco_p2p.swarm.membership.records import (
        publish_progress_async,
        read_progress_async,
        withdraw_progress_async,
    )
    from diloco_p2p.swarm.transport.runner import BackgroundLoop

    maddrs, pa, *_ = swarm
    c = start_dht(P2PConfig(initial_peers=maddrs, host_maddrs=LOOPBACK), None)  # before the loop's thread
    loop = BackgroundLoop()
    try:
        pc = c.peer_id.to_base58()
        assert loop.run(publish_progress_async(c, RUN, _record(pc, 6, "d"), ttl=60, timeout=10), timeout=15)
        seen = loop.run(read_progress_async(c, RUN, timeout=10), timeout=15)
        assert seen[pc].round == 6 and pa in seen
        assert loop.run(withdraw_progress_async(c, RUN, pc, timeout=10), timeout=25)
        assert pc not in loop.run(read_progress_async(c, RUN, timeout=10), timeout=15)
    finally:
        loop.close()
        c.shutdown()
