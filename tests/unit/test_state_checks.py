"""A downloaded state is checked as a whole before anything of it is allocated or adopted: its
layout against this model's (names, dtypes, shapes, size), every value finite, and every tensor,
not only θ, hashing to the state the swarm vouches for."""

from __future__ import annotations

import json
import tracemalloc

import pytest
import torch

from diloco_p2p.hashing import tensor_sha256
from diloco_p2p.swarm.state.codec import (
    THETA,
    Layout,
    StateCheck,
    StateError,
    pack_state,
    state_sha256,
    unpack_state,
)

N = 1000


def _state(numel: int = N, **override: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {THETA: torch.randn(numel, generator=g), "outer.momentum": torch.randn(numel, generator=g)}
    return {**state, **override}


LAYOUT = Layout.of(_state(), {"overlap.average": torch.zeros(N), "overlap.average_round": torch.zeros(1, dtype=torch.int64)},
                   bounded=("overlap.average",))
META = {"round": 4, "averaged_round": 4}


@pytest.mark.parametrize(("tensors", "why"), [
    (_state(**{THETA: torch.zeros(16)}), "its outer.theta is F32 [16], this model's is F32 [1000]"),
    (_state(**{"outer.momentum": torch.zeros(N + 1)}), "its outer.momentum is F32 [1001], this model's is F32 [1000]"),
    (_state(**{"outer.momentum": torch.zeros(N, dtype=torch.float16)}), "its outer.momentum is F16 [1000]"),
    (_state(**{"outer.momentum": torch.zeros(10, 100)}), "its outer.momentum is F32 [10, 100]"),
    ({THETA: torch.zeros(N)}, "it lacks outer.momentum"),
    (_state(**{"inner.exp_avg": torch.zeros(N)}), "it holds tensors this model has not (inner.exp_avg)"),
    (_state(**{"overlap.average": torch.zeros(N + 5)}), "its overlap.average is F32 [1005]"),
    (_state(**{"overlap.average": torch.zeros(2, 3)}), "its overlap.average is F32 [2, 3]"),
])
def test_a_state_of_another_layout_is_refused_naming_the_tensor(tensors, why):
    with pytest.raises(StateError, match="state is not one of this model") as e:
        unpack_state(pack_state(tensors, META), LAYOUT)
    assert why in str(e.value)


def test_a_fragment_average_up_to_thetas_size_fits():
    tensors, _ = unpack_state(pack_state(_state(**{"overlap.average": torch.zeros(N // 4)}), META), LAYOUT)
    assert tensors["overlap.average"].shape == (N // 4,)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_state_with_a_non_finite_value_is_refused(bad):
    momentum = torch.zeros(N)
    momentum[7] = bad
    with pytest.raises(StateError, match="outer.momentum holds NaN or Inf"):
        unpack_state(pack_state(_state(**{"outer.momentum": momentum}), META), LAYOUT)


def test_a_header_declaring_a_huge_tensor_is_refused_before_anything_is_allocated():
    """A blob whose header claims a θ of 2**40 values: refused on the header, no tensor allocated."""
    blob = bytearray(pack_state(_state(), META))
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    header[THETA]["shape"] = [2 ** 40]
    text = json.dumps(header).encode()
    forged = len(text).to_bytes(8, "little") + text + bytes(blob[8 + n:])
    tracemalloc.start()
    with pytest.raises(StateError, match=r"its outer.theta is F32 \[1099511627776\]"):
        unpack_state(forged, LAYOUT)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 10 * len(forged)


def test_the_size_cap_is_what_this_models_state_can_take():
    most = pack_state({**_state(), "overlap.average": torch.zeros(N),
                       "overlap.average_round": torch.zeros(1, dtype=torch.int64)}, META)
    assert len(most) <= LAYOUT.max_size() < len(most) + (1 << 17)


def test_the_whole_state_hash_covers_every_tensor_and_the_rounds():
    state = _state()
    base = state_sha256(state, 4, 4)
    assert base == state_sha256(dict(reversed(list(state.items()))), 4, 4)  # order of names: none
    assert base == state_sha256(state, 4, 4, known={THETA: tensor_sha256(state[THETA])})
    momentum = state["outer.momentum"].clone()
    momentum[0] += 1e-3
    assert state_sha256({**state, "outer.momentum": momentum}, 4, 4) != base
    assert state_sha256({**state, "overlap.average": torch.zeros(3)}, 4, 4) != base
    assert state_sha256(state, 5, 4) != base and state_sha256(state, 4, 3) != base


def test_a_donor_serving_the_vouched_theta_with_another_momentum_is_refused_as_a_liar():
    honest = _state()
    vouched = state_sha256(honest, 4, 4)
    forged = _state(**{"outer.momentum": torch.full((N,), 3.0)})
    check = StateCheck(4, tensor_sha256(honest[THETA]), None, layout=LAYOUT, state_hash=lambda r, h: vouched)
    why, lied = check(pack_state(forged, {**META, "params_sha256": "x"}))
    assert lied and "another momentum or buffer than the swarm's" in why and check.unpacked is None
    assert check(pack_state(honest, META)) is None and check.unpacked is not None


@pytest.mark.parametrize("averaged", [5, -1, "4", True])
def test_a_state_claiming_an_impossible_averaged_round_is_refused(averaged):
    """A joiner takes the state's averaged_round as its own: one past the state's round would make
    its records supersede every honest one (`resync.reference_records`)."""
    state = _state()
    check = StateCheck(4, tensor_sha256(state[THETA]), None, layout=LAYOUT)
    refused = check(pack_state(state, {"round": 4, "averaged_round": averaged}))
    assert refused is not None and refused[1] and "averaged in round" in refused[0]


@pytest.mark.parametrize("cut", [0, 7, 100, -1])
def test_a_truncated_state_is_refused_with_the_layout_too(cut):
    blob = pack_state(_state(), META)
    with pytest.raises(StateError):
        unpack_state(blob[:cut] if cut >= 0 else blob[:-1], LAYOUT)
