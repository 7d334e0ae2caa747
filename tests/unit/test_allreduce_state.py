"""The all-reduce's commit rule on one peer, without sockets: which parts commit, what is zeroed,
and when a member has agreed with nobody."""

from __future__ import annotations

import hashlib

import torch
from hivemind.p2p import PeerID

from diloco_p2p.swarm.collective import wire
from diloco_p2p.swarm.collective.allreduce_state import Session, conclude

PEERS = [PeerID(b"\x12\x20" + hashlib.sha256(bytes([i])).digest()) for i in range(3)]
N = 10  # parts of 4, 3, 3 elements


def _session(me: int = 0) -> Session:
    s = Session("g", now=0.0)
    s.start(PEERS, me, N, "fp32", 1024, t0=0.0, T=10.0)
    s.result = torch.arange(1.0, N + 1)  # the averaged values every part delivered
    for p in range(3):
        s.gathered[p] = {"contributors": [0, 1, 2], "rejected": {}}
    return s


def test_deadlines_split_the_timeout_and_parts_cover_the_vector():
    s = _session()
    assert (s.d_scatter, s.d_gather, s.d_end) == (4.0, 7.0, 10.0)
    assert s.bounds == wire.partition(N, 3) == [(0, 4), (4, 7), (7, 10)]
    assert s.pending(done=[1], only_heard=False) == [2]
    assert s.pending(done=[], only_heard=True) == []  # nobody heard yet: nobody waited for


def test_parts_every_heard_mask_holds_commit_and_the_rest_is_zero():
    s = _session()
    s.masks = {0: [1, 1, 1], 1: [1, 0, 1], 2: [1, 1, 1]}
    r = conclude(s, seconds=1.0)
    assert r.status == "partial" and r.committed_parts == [0, 2] and r.num_parts == 3
    assert r.average.tolist() == [1, 2, 3, 4, 0, 0, 0, 8, 9, 10]
    assert r.agreed_with == [p.to_base58() for p in PEERS]
    assert set(r.part_contributors) == {0, 2}


def test_a_member_excluded_for_contradicting_us_does_not_veto_parts():
    s = _session()
    s.masks = {0: [1, 1, 1], 1: [0, 0, 0], 2: [1, 1, 1]}
    s.excluded.add(1)
    r = conclude(s, seconds=1.0)
    assert r.status == "ok" and r.committed_parts == [0, 1, 2]
    assert r.average.tolist() == list(range(1, N + 1))
    assert r.agreed_with == [PEERS[0].to_base58(), PEERS[2].to_base58()]


def test_hearing_no_other_mask_is_failure_with_zeros():
    s = _session()
    s.masks = {0: [1, 1, 1]}
    r = conclude(s, seconds=1.0)
    assert r.status == "failed" and r.committed_parts == [] and not r.average.any()


def test_a_specific_rejection_reason_beats_timeout():
    s = _session()
    s.masks = {0: [1, 1, 1], 1: [1, 1, 1]}
    s.gathered[0]["rejected"] = {"2": "timeout"}
    s.gathered[1]["rejected"] = {"2": "nan"}
    s.gathered[0]["contributors"] = s.gathered[1]["contributors"] = [0, 1]
    r = conclude(s, seconds=1.0)
    assert r.rejected == {PEERS[2].to_base58(): "nan"}
    assert r.contributors == [PEERS[0].to_base58(), PEERS[1].to_base58(), PEERS[2].to_base58()]


def test_a_contribution_header_is_refused_for_its_first_problem_and_only_another_view_excludes():
    s = _session()
    shape, fmt = {"n": N, "chunk": 1024}, {"comp": "fp32"}
    good = {"n": N, "chunk": 1024, "comp": "fp32", "finite": True, "weight": 2.0}
    assert s.refuse_header(1, good, shape, fmt) is None and s.rejected == {} and s.excluded == set()
    cases = [  # (member, header, reason, excluded)
        (1, {**good, "n": N + 1, "finite": False}, "shape", True),  # shape is checked first
        (2, {"n": N, "chunk": 512}, "shape", True),  # no other field is read once the shape differs
    ]
    for j, h, reason, excluded in cases:
        assert s.refuse_header(j, h, shape, fmt) == reason
        assert s.rejected[j] == reason and (j in s.excluded) == excluded
    for h, reason, excluded in [({**good, "comp": "int8", "weight": -1.0}, "compression", True),
                                ({**good, "finite": False, "weight": -1.0}, "nan", False),
                                ({**good, "weight": float("inf")}, "weight", False),
                                ({**good, "weight": True}, "weight", False)]:
        s = _session()
        assert s.refuse_header(1, h, shape, fmt) == reason
        assert s.rejected == {1: reason} and s.excluded == ({1} if excluded else set())
