"""A hostile peer against real honest nodes (issue 12): it cannot fork, poison or take over a run.

The attacker (`tests.faults.hostile.HostilePeer`) is a real DHT peer in the test's process with
its own identity; the honest nodes are real `diloco-p2p train` processes. Its lies are in place
before the honest nodes' first round (start gate), so every round meets them. Each test asserts
that the honest nodes end every round committed together with identical θ, that none adopts
anything of the attacker's, and that each names it in a log line and in its round records.

- Open run: a record for a later round with a made-up θ (served, its blob's sha256 matching),
  and a record under an honest node's id.
- Closed run (`sync.admission`: one node listed, one admitted by an owner-signed token): the
  stranger's record (a later round; the quorum is 1 here, so admission alone must stop it), its
  matchmaking and all-reduce streams, and its download of θ are all refused.
- Lying members (nodes started with ``DILOCO_P2P_FAULTS`` lies, `tests.faults.injection`): a sign flip
  at the largest weight allowed, a huge norm, a reducer that scales its part up, one that scales
  it down, a reducer that sends each member other bytes, on one swarm (the in-process variants of
  each, per aggregation rule: `tests/faults/test_robust.py`).
"""

from __future__ import annotations

import json

import pytest
from hivemind.p2p import P2P

from diloco_p2p.swarm.membership.matchmaking import PROTOCOL_VERSION as MATCHMAKING_VERSION
from diloco_p2p.swarm.state.announcements import list_donors
from diloco_p2p.swarm.state.client import StateUnavailable
from tests.faults.hostile import HostilePeer
from tests.harness.procs import run_cli, wait_until
from tests.harness.swarm import ProcessSwarm

pytestmark = pytest.mark.timeout(420)

ROUNDS = 2  # committed rounds each test checks; the nodes then hold at round 3, records still live
OPTS = ["train.max_rounds=3", "sync.target_group_size={n}", "sync.matchmaking_timeout=10"]
HOLD = {"DILOCO_P2P_FAULTS": "hold@delta:3"}


def _opts(n: int, *more: str) -> list[str]:
    return [o.format(n=n) for o in OPTS] + list(more)


def _wait_records(attacker: HostilePeer, run_id: str, n: int) -> dict:
    wait_until(lambda: len(attacker.honest_records(run_id)) >= n, 60, f"{n} honest records")
    return attacker.honest_records(run_id)


def _assert_rounds_committed_together(nodes) -> None:
    for node in nodes:
        node.wait_round(ROUNDS, timeout=240)
    for round_ in range(1, ROUNDS + 1):
        records = [n.by_round()[round_] for n in nodes]
        assert {(r["status"], r["group_size"]) for r in records} == {("committed", len(nodes))}, records
        assert len({r["params_sha256"] for r in records}) == 1, records
    for node in nodes:
        assert all(r["status"] != "resynced" for r in node.records()), node.records()


def _refusals(node, peer: str) -> set[str]:
    """The reasons `node`'s round records give for refusing `peer`."""
    return {reason for r in node.records() for reason in (r.get("rejections") or {}).get(peer, [])}


@pytest.fixture
def attacker():
    with HostilePeer() as peer:
        yield peer


def test_forged_later_round_forged_state_and_a_record_under_another_id_change_nothing(tmp_path, attacker):
    run_id = "swarm-test"  # tests.harness.settings.SWARM
    with ProcessSwarm(tmp_path, seed_args=["--initial-peers", attacker.maddr]) as swarm:
        a, b, c = (swarm.node(name, _opts(3), env=HOLD) for name in "abc")
        swarm.wait_joined(a, b, c)
        honest = _wait_records(attacker, run_id, 3)
        template = next(iter(honest.values()))
        victim = sorted(honest)[0]
        # A made-up θ, served with a blob whose sha256 matches its announcement, and a record
        # claiming the last round with that θ: adopting it, a node would stop there as "done".
        forged_hash = attacker.serve_forged_state(run_id, 3, numel=16)
        attacker.publish_claim(run_id, attacker.claim(template, round=3, params_sha256=forged_hash,
                                                      status="committed", averaged_round=3))
        # The victim's row, forged: round 777 and a record naming the victim.
        attacker.forge_record_as(run_id, victim, attacker.claim(template, peer_id=victim, round=777))
        swarm.release(a, b, c)

        _assert_rounds_committed_together([a, b, c])
        assert attacker.server is not None and attacker.server.bytes_served == 0  # nobody even asked
        for node in (a, b, c):
            log = node.output()
            assert f"refused peer {attacker.peer_id}: unvouched-state" in log, node.tail()
            assert f"refused peer {attacker.peer_id}: forged-record" in log, node.tail()
            assert _refusals(node, attacker.peer_id) == {"unvouched-state", "forged-record"}

        out = run_cli(["status", "--initial-peers", swarm.maddr, "--run-id", run_id, "--json"], timeout=120)
        assert out.returncode == 0, out.stderr
        rows = {row["peer_id"]: row for row in json.loads(out.stdout)}
        assert rows[victim]["round"] == ROUNDS  # its own record, not the forged round 777
        assert rows[attacker.peer_id]["round"] == 3  # listed as what it claims, and...
        assert all(rows[n]["excluded"].get(attacker.peer_id) for n in honest)  # ...excluded by every node


def _identity(run_dir) -> str:
    run_dir.mkdir(parents=True)
    P2P.generate_identity(str(run_dir / "identity.key"))  # the node's default identity path
    from diloco_p2p.swarm.transport.dht import peer_id_of

    return peer_id_of(run_dir / "identity.key")


def test_a_closed_run_refuses_a_strangers_records_streams_and_downloads(tmp_path, attacker):
    from diloco_p2p.swarm.collective.allreduce import AllreduceService
    from diloco_p2p.swarm.trust.admission import issue_token
    from diloco_p2p.swarm.trust.signing import load_private_key, public_key_text

    run_id = "closed-test"
    owner_path = tmp_path / "owner.key"
    P2P.generate_identity(str(owner_path))
    owner = load_private_key(owner_path)
    with ProcessSwarm(tmp_path, seed_args=["--initial-peers", attacker.maddr]) as swarm:
        listed, holder = _identity(tmp_path / "a"), _identity(tmp_path / "b")
        (tmp_path / "b.token").write_text(issue_token(owner, run_id, holder))
        closed = _opts(2, f"run_id={run_id}", "sync.resync_quorum=1", "sync.admission.mode=closed",
                       f"sync.admission.peers=['{listed}']", f"sync.admission.owner_key='{public_key_text(owner)}'")
        a = swarm.node("a", closed, env=HOLD)
        b = swarm.node("b", [*closed, f"sync.admission.token_path={tmp_path / 'b.token'}"], env=HOLD)
        swarm.wait_joined(a, b)
        template = next(iter(_wait_records(attacker, run_id, 2).values()))
        # with quorum 1 an open run would follow this record to round 3 (test_resync shows it)
        attacker.publish_claim(run_id, attacker.claim(template, round=3, params_sha256="f" * 64, averaged_round=3))
        swarm.release(a, b)

        wait_until(lambda: 1 in a.by_round() and 1 in b.by_round(), 240, "round 1", a, b)
        # A node announces its state just after it records the round: wait until the stranger
        # sees an announcement, so its download really asks a donor.
        wait_until(lambda: bool(attacker.loop.run(list_donors(attacker.dht, run_id), timeout=15)), 60,
                   "a state announcement", a, b)
        fetched = attacker.fetch(run_id)
        assert isinstance(fetched, StateUnavailable), fetched
        assert attacker.knock(listed, f"/diloco-p2p/{run_id}/matchmaking/{MATCHMAKING_VERSION}") == b""
        assert attacker.knock(listed, AllreduceService(attacker.p2p, prefix=run_id).handler_name) == b""

        _assert_rounds_committed_together([a, b])  # the token holder is in every group
        log = a.output()
        for what in ("a progress record", "a stream (matchmaking)", "a stream (all-reduce)"):
            assert f"refused peer {attacker.peer_id}: not-admitted ({what} from a peer" in log, (what, a.tail())
        # The stranger's download asked the donors it found in its own order: which of the two
        # refused it (or both) depends on that order.
        state = f"refused peer {attacker.peer_id}: not-admitted (a stream (state) from a peer"
        assert any(state in node.output() for node in (a, b)), (a.tail(), b.tail())
        assert _refusals(a, attacker.peer_id) == {"not-admitted"}
        assert _refusals(b, attacker.peer_id) == {"not-admitted"}


def _kept(node, round_: int) -> dict:
    """The Δ a node sent and the average it got in `round_` (``keep@average``)."""
    from safetensors.torch import load_file

    return load_file(str(node.run_dir / "deltas" / f"round-{round_:06d}.safetensors"))


def _cosine(u, v) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(u.double(), v.double(), dim=0))


def test_lying_members_and_reducers_in_a_real_swarm_are_left_out_or_dropped_and_named(tmp_path):
    """Five real nodes under the default `sync.aggregation: mean`, three of them planned to lie
    (`tests.faults.injection`). Round 1: x sends -Δ at the largest weight the bound lets through and
    reduces its part × 1000, y sends Δ × 1000, z sends each member its own altered copy of its part.
    Round 2 (x and z, caught in round 1, are out of the honest nodes' groups): y reduces its part ×
    0.8, inside the norm and scale checks (its quoted samples refute it). Every round ends with the members' θ identical; the flip is left out by every honest
    reducer (the direction check), so round 1 averages what the honest senders sent; every liar is
    named in a log line and counted in the round records of everyone else."""
    keep = "keep@average"
    opts = _opts(5, "train.max_rounds=2", "sync.matchmaking_timeout=6")
    with ProcessSwarm(tmp_path) as swarm:
        a, b = (swarm.node(name, opts, env={"DILOCO_P2P_FAULTS": keep}) for name in "ab")
        x = swarm.node("x", opts, env={"DILOCO_P2P_FAULTS": f"{keep},flip@delta:1,scale@reduce:1"})
        y = swarm.node("y", opts, env={"DILOCO_P2P_FAULTS": f"{keep},scale@delta:1,nudge@reduce:2"})
        z = swarm.node("z", opts, env={"DILOCO_P2P_FAULTS": f"{keep},split@reduce:1"})
        swarm.release(a, b, x, y, z)
        for node in (a, b, x, y, z):
            node.wait_round(2, timeout=240)
        from diloco_p2p.swarm.transport.dht import peer_id_of

        nodes = {"a": a, "b": b, "x": x, "y": y, "z": z}
        ids = {n: peer_id_of(node.run_dir / "identity.key") for n, node in nodes.items()}
        rounds = {n: node.by_round() for n, node in nodes.items()}

        def members(round_: int, names: str) -> dict[str, dict]:
            records = {n: rounds[n][round_] for n in names}
            assert {(r["status"], r["group_size"]) for r in records.values()} == {("committed", len(names))}, records
            assert len({r["params_sha256"] for r in records.values()}) == 1, records
            return records

        def refused(record: dict, who: str) -> list[str]:
            return (record["rejections"] or {}).get(ids[who], [])

        # Round 1: x's and z's parts are dropped; the three others hold the mean of a, b and z's Δ
        # (y refused by its norm, x left out as opposed): without the check x's flip, its weight
        # capped at 4x, would have carried 4/7 of each part against the update.
        for n, record in members(1, "abxyz").items():
            if n in "ab":
                assert "opposed" in refused(record, "x") and "reducer" in refused(record, "x"), record
                assert "norm" in refused(record, "y") and "reducer" in refused(record, "z"), record
        kept = {n: _kept(node, 1) for n, node in nodes.items()}
        held = kept["a"]["average"] != 0
        honest = (kept["a"]["delta"] + kept["b"]["delta"] + kept["z"]["delta"])[held] / 3
        assert 0.25 < held.float().mean() < 0.75  # 3 of 5 parts
        assert _cosine(kept["a"]["average"][held], honest) > 0.99
        # Round 2: x and z are out of the honest nodes' group; y scaled its part by 0.8, which is dropped.
        for n, record in members(2, "aby").items():
            if n != "y":
                assert "reducer" in refused(record, "y"), (n, record)
        assert {rounds["x"][2]["status"], rounds["z"][2]["status"]} == {"alone"}, (rounds["x"][2], rounds["z"][2])
        for node in (a, b):
            log = node.output()
            for who, reason in (("x", "opposed"), ("x", "reducer"), ("y", "norm"), ("y", "reducer"), ("z", "reducer")):
                assert f"refused peer {ids[who]}: {reason}" in log, (who, reason, node.tail())
