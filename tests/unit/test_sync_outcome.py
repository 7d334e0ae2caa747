"""How `SwarmSync.average` turns a round's events into the outcome the outer step applies."""

from __future__ import annotations

import pytest
import torch

from diloco_p2p.swarm.collective.allreduce_state import AllreduceResult
from diloco_p2p.swarm.collective.outcome import round_outcome

AGREE = {"params_agree": True, "config_agree": True}


def _result(status: str, average: torch.Tensor) -> AllreduceResult:
    return AllreduceResult(average=average, status=status, committed_parts=[0, 1] if status != "failed" else [],
                           num_parts=3, contributors=["a", "b"], rejected={"c": "nan"}, bytes_sent=100,
                           bytes_received=200, seconds=0.25)


@pytest.mark.parametrize("status", ["ok", "partial"])
def test_a_group_that_reduced_commits_its_average(status):
    delta, average = torch.ones(4), torch.full((4,), 0.5)
    out = round_outcome(delta, _result(status, average), 3, "apply", AGREE)
    assert out.status == "committed" and out.average is average and out.group_size == 3
    assert (out.contributors, out.dropped_peers, out.rejected) == (2, 1, {"c": "nan"})
    assert (out.parts_committed, out.parts, out.bytes_sent, out.bytes_received) == (2, 3, 100, 200)
    assert out.allreduce_seconds == 0.25 and out.params_agree is True


@pytest.mark.parametrize("policy, applied", [("apply", True), ("skip", False)])
def test_no_group_ends_alone_and_follows_the_alone_policy(policy, applied):
    delta = torch.ones(4)
    out = round_outcome(delta, None, 1, policy, AGREE)
    assert out.status == "alone" and out.group_size == 1 and out.contributors is None
    assert (out.average is delta) is applied


def test_an_interrupted_wait_is_a_failed_round():
    out = round_outcome(torch.ones(4), None, 1, "apply", AGREE, interrupted=True)
    assert out.status == "failed" and out.average is not None


def test_a_failed_allreduce_keeps_its_numbers_and_applies_only_our_own_delta():
    delta = torch.ones(4)
    out = round_outcome(delta, _result("failed", torch.zeros(4)), 3, "apply", AGREE)
    assert out.status == "failed" and out.average is delta and out.group_size == 3
    assert out.bytes_sent == 100 and out.parts_committed == 0


def test_a_non_finite_delta_is_never_applied_alone():
    delta = torch.tensor([1.0, float("nan")])
    assert round_outcome(delta, None, 1, "apply", AGREE).average is None


def test_malformed_senders_are_refused_by_name_and_kept_out_of_our_groups(caplog):
    """NaN or Inf, another length or wire format: each sender is named once, counted as
    ``malformed`` and kept out of our next groups; timeouts blame nobody, nor our own refusal."""
    from diloco_p2p.swarm.collective.outcome import blame
    from diloco_p2p.swarm.trust.guard import Guard

    result = _result("ok", torch.zeros(4))
    result.rejected = {"c": "nan", "d": "shape", "e": "compression", "f": "timeout", "g": "weight", "me": "nan",
                       "h": "nan"}
    result.proven_malformed = ["c", "d", "e", "me"]  # "h": one part's reducer said so, which a liar can
    guard = Guard()
    with caplog.at_level("WARNING"):
        blame(guard, 3, result, me="me")
    assert guard.drain() == {"c": ["malformed"], "d": ["malformed"], "e": ["malformed"], "g": ["weight"],
                             "h": ["malformed"]}
    assert guard.distrusted() == {"c", "d", "e"}
    assert "refused peer c: malformed (round 3: NaN or Inf in its contribution)" in caplog.text
    assert "refused peer d: malformed (round 3: a contribution of another length)" in caplog.text
    assert "refused peer h: malformed (round 3: NaN or Inf in its contribution (said by one part's reducer only" \
        in caplog.text


def test_an_opposed_sender_is_named_with_most_parts_evidence_and_never_kept_out(caplog):
    """`opposed` from one reducer names the sender; `AllreduceResult.opposed` (most parts named it)
    names it with that evidence, whatever reason `rejected` kept for it. Neither keeps it out of our
    groups: an honest Δ at a small H can point against the others'."""
    from diloco_p2p.swarm.collective.outcome import blame
    from diloco_p2p.swarm.trust.guard import Guard

    result = _result("ok", torch.zeros(4))
    result.rejected = {"one": "opposed", "most": "norm", "me": "opposed"}
    result.opposed = {"most": "3 of 3 parts", "me": "3 of 3 parts"}
    guard = Guard()
    with caplog.at_level("WARNING"):
        blame(guard, 5, result, me="me")
    assert guard.drain() == {"one": ["opposed"], "most": ["norm", "opposed"]}
    assert guard.distrusted() == set()
    assert "refused peer most: opposed (round 5: its contribution points against the others' (left out of 3 of 3 parts))" \
        in caplog.text


def test_one_lying_reducer_cannot_make_an_opposed_or_malformed_sender_proven():
    """Four members: reducer 3 names member 0 `opposed` in its part's header; the other reducers
    took member 0's contribution. Not enough to keep member 0 out; a flip that reducers 0, 1, 2
    all name (member 3, part 3 its own) is."""
    from types import SimpleNamespace

    from diloco_p2p.swarm.collective.allreduce_state import MALFORMED_REASONS, _named_by_most

    def _opposed_by_most(s, committed):
        return _named_by_most(s, committed, ("opposed",))

    def part(contributors, rejected):
        return {"contributors": contributors, "rejected": rejected}

    lying = SimpleNamespace(k=4, names=list("abcd"), gathered={
        0: part([0, 1, 2, 3], {}), 1: part([0, 1, 2, 3], {}), 2: part([0, 1, 2, 3], {}), 3: part([1, 2, 3], {"0": "opposed"})})
    assert _opposed_by_most(lying, [0, 1, 2, 3]) == {}
    flip = SimpleNamespace(k=4, names=list("abcd"), gathered={
        p: part([0, 1, 2], {"3": "opposed"}) for p in range(4)})
    assert _opposed_by_most(flip, [0, 1, 2, 3]) == {"d": "3 of 3 parts"}
    assert _opposed_by_most(flip, [0, 3]) == {}  # one other committed part: not "several"
    # the same rule for a NaN, another length or format: one lying reducer's "nan" keeps nobody out
    nan = SimpleNamespace(k=4, names=list("abcd"), gathered={**lying.gathered, 3: part([1, 2, 3], {"0": "nan"})})
    assert _named_by_most(nan, [0, 1, 2, 3], MALFORMED_REASONS) == {}
    real = SimpleNamespace(k=4, names=list("abcd"), gathered={p: part([0, 1, 2], {"3": "nan"}) for p in range(4)})
    assert _named_by_most(real, [0, 1, 2, 3], MALFORMED_REASONS) == {"d": "3 of 3 parts"}
