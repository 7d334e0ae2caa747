"""Wire format of the all-reduce: compression error bounds, partitioning, boundary checks, headers,
framing, and the reduction a reducer applies. Pure functions, no network."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diloco_p2p.swarm.collective import wire


def vector(n: int = 10_000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-3, 2, n)  # magnitudes over five decades


@pytest.mark.parametrize("compression", wire.COMPRESSIONS)
@pytest.mark.parametrize("numel", [0, 1, 1023, 1024, 1025, 5000])
def test_encoded_size_is_exact_and_roundtrip_keeps_shape(compression, numel):
    x = torch.randn(numel)
    data = wire.encode(x, compression)
    assert len(data) == wire.encoded_size(numel, compression)
    y = wire.decode(data, numel, compression)
    assert y.dtype == torch.float32 and y.shape == (numel,)


def test_fp32_is_exact():
    x = vector()
    assert torch.equal(wire.roundtrip(x, "fp32", chunk_elements=999), x)


def test_fp16_relative_error_bound():
    x = vector()
    y = wire.roundtrip(x, "fp16", chunk_elements=999)
    # round-to-nearest: relative 2^-11 in the normal range, absolute 2^-25 among subnormals (< 2^-14)
    assert bool(((y - x).abs() <= torch.maximum(2.0**-11 * x.abs(), torch.tensor(2.0**-25))).all())
    assert (y - x).abs().max() > 0


def test_int8_error_is_bounded_by_each_blocks_absmax():
    x = vector()
    x[5] = 1e4  # an outlier in block 0 must not degrade the other blocks
    y = wire.roundtrip(x, "int8", chunk_elements=4 * wire.INT8_BLOCK)
    for start in range(0, x.numel(), wire.INT8_BLOCK):
        block, approx = x[start : start + wire.INT8_BLOCK], y[start : start + wire.INT8_BLOCK]
        bound = block.abs().max() / 254 * (1 + 1e-6)
        assert (approx - block).abs().max() <= bound
    assert (y[wire.INT8_BLOCK :] - x[wire.INT8_BLOCK :]).abs().max() < 1e4 / 254 / 10


@pytest.mark.parametrize("numel", [2 * 1024, 2 * 1024 - 1, 1])
def test_int8_bytes_are_the_blockwise_absmax_code_computed_independently(numel):
    """Whole blocks (quantized in place) and a ragged last block (padded) give the bytes a plain
    numpy blockwise absmax quantizer gives: float32 scale = absmax / 127, codes = x · (127 / absmax)
    rounded half-even (at most 127 · (1 + 2^-23) before rounding: no clamp)."""
    import numpy as np

    x = vector(numel, seed=3)
    before = x.clone()
    data = wire.encode(x, "int8")
    assert torch.equal(x, before)  # the encoder leaves its input alone
    v, b = x.numpy(), wire.INT8_BLOCK
    scales, codes = [], []
    for start in range(0, numel, b):
        block = v[start : start + b]
        absmax = np.float32(np.abs(block).max())
        scale = absmax / np.float32(127)
        code = np.rint(block * (np.float32(127) / absmax if absmax > 0 else np.float32(0)))
        assert np.abs(code).max() <= 127
        codes.append(code.astype(np.int8))
        scales.append(scale)
    assert data == np.array(scales, dtype="<f4").tobytes() + np.concatenate(codes).tobytes()
    decoded = wire.decode(data, numel, "int8")
    expected = np.concatenate([c.astype(np.float32) * s for c, s in zip(codes, scales, strict=True)])
    assert decoded.numpy().tobytes() == expected.astype(np.float32).tobytes()


@pytest.mark.parametrize("magnitude", [1e-36, 1e-39, 1e30])
def test_int8_codes_blocks_of_tiny_or_huge_values_within_their_bound(magnitude):
    """127 / absmax overflows float32 for a block below ~4e-37 (1e-39 is subnormal): such a block is
    coded by the division, not the reciprocal, and keeps the per-block error bound."""
    x = vector(3 * wire.INT8_BLOCK, seed=4) / 4
    x[: wire.INT8_BLOCK] *= magnitude
    x[2 * wire.INT8_BLOCK :] = 0.0  # a zero block beside them
    y = wire.roundtrip(x, "int8")
    for start in range(0, x.numel(), wire.INT8_BLOCK):
        block, approx = x[start : start + wire.INT8_BLOCK].double(), y[start : start + wire.INT8_BLOCK].double()
        assert (approx - block).abs().max() <= block.abs().max() / 254 * (1 + 1e-5) + 1e-45
    assert torch.equal(y[2 * wire.INT8_BLOCK :], x[2 * wire.INT8_BLOCK :])


def test_int8_keeps_zero_blocks_exact():
    x = torch.zeros(3000)
    x[2500] = 1.0
    assert torch.equal(wire.roundtrip(x, "int8"), x)


@pytest.mark.parametrize("compression", wire.COMPRESSIONS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_stays_visible_after_decoding(compression, bad):
    x = torch.randn(2048)
    x[1500] = bad
    assert not wire.is_finite(wire.roundtrip(x, compression))


def test_is_finite_answers_per_value_even_when_the_sum_overflows():
    huge = torch.full((8,), 3e38)  # finite values whose float32 sum is inf
    assert wire.is_finite(huge) and wire.is_finite(-huge) and wire.is_finite(torch.zeros(0))
    for bad in ([math.inf, -math.inf], [math.nan], [1.0, math.inf], [3e38, 3e38, math.nan]):
        assert not wire.is_finite(torch.tensor(bad + [0.5] * 1000))


def test_fp16_overflow_is_non_finite():
    assert not wire.is_finite(wire.roundtrip(torch.tensor([1e5]), "fp16"))


@pytest.mark.parametrize("compression", wire.COMPRESSIONS)
def test_decode_rejects_a_wrong_length(compression):
    data = wire.encode(torch.randn(100), compression)
    with pytest.raises(wire.WireError):
        wire.decode(data, 101, compression)
    with pytest.raises(wire.WireError):
        wire.decode(data[:-1], 100, compression)


def test_unknown_compression_is_an_error():
    with pytest.raises(ValueError):
        wire.encode(torch.zeros(3), "bf16")


@pytest.mark.parametrize("n", [0, 1, 2, 3, 10, 1001, 65_537])
@pytest.mark.parametrize("k", [1, 2, 3, 7, 16])
def test_partition_covers_the_vector_in_near_equal_contiguous_parts(n, k):
    bounds = wire.partition(n, k)
    assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(bounds[j][1] == bounds[j + 1][0] for j in range(k - 1))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n


@pytest.mark.parametrize("flags", [[True, False, True, False], [False, True], [True] * 3, [False, False, True]])
def test_partition_among_gives_parts_to_public_members_only(flags):
    n = 10_001
    bounds = wire.partition_among(n, flags)
    assert len(bounds) == len(flags) and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(bounds[j][1] == bounds[j + 1][0] for j in range(len(flags) - 1))  # contiguous cover
    assert all((hi > lo) == f for (lo, hi), f in zip(bounds, flags, strict=True))
    assert [hi - lo for (lo, hi), f in zip(bounds, flags, strict=True) if f] == [
        hi - lo for lo, hi in wire.partition(n, sum(flags))]
    if all(flags):
        assert bounds == wire.partition(n, len(flags))
    with pytest.raises(ValueError):
        wire.partition_among(n, [False, False])


def test_chunk_ranges_cover_the_part():
    assert wire.chunk_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert wire.chunk_ranges(0, 4) == []


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), 0.0, -1.0, True, "1", None])
def test_weight_problem_rejects_non_positive_non_finite_non_numbers(weight):
    assert wire.weight_problem(weight, None, 64.0) == "weight"


def test_weight_problem_applies_the_ratio_to_the_reference():
    assert wire.weight_problem(64.0, 1.0, 64.0) is None
    assert wire.weight_problem(64.5, 1.0, 64.0) == "weight"
    assert wire.weight_problem(1e-9, 1.0, 64.0) is None  # a tiny weight only dilutes its own influence


def test_lower_median_is_not_set_by_one_inflated_weight():
    assert wire.lower_median([1.0, 1e12]) == 1.0
    assert wire.lower_median([3.0, 1.0, 1e12]) == 3.0
    assert wire.lower_median([5.0]) == 5.0


def contributions(xs, weights, compression="fp16", chunk=300):
    return {
        j: (w, [wire.encode(x[a:b], compression) for a, b in wire.chunk_ranges(x.numel(), chunk)])
        for j, (x, w) in enumerate(zip(xs, weights, strict=True))
    }


def test_reduce_part_is_the_weighted_mean_and_drops_an_inflated_weight():
    xs = [torch.randn(1000) for _ in range(3)]
    accepted, heavy, encoded, values = wire.reduce_part(
        contributions(xs, [1.0, 3.0, 1e9]), 64.0, 1000, 300, "fp16"
    )
    assert accepted == [0, 1] and heavy == [2]
    exact = (1.0 * xs[0].double() + 3.0 * xs[1].double()) / 4.0
    assert (values.double() - exact).abs().max() < 2 * 2.0**-11 * (xs[0].abs().max() + xs[1].abs().max())
    # what members receive decodes to exactly what the reducer keeps
    resent = torch.cat(
        [
            wire.decode(d, b - a, "fp16")
            for (a, b), d in zip(wire.chunk_ranges(1000, 300), encoded, strict=True)
        ]
    )
    assert torch.equal(resent, values)


def test_reduce_part_does_not_depend_on_arrival_order():
    xs = [torch.randn(500) for _ in range(4)]
    c = contributions(xs, [1.0, 2.0, 3.0, 4.0], "fp32")
    shuffled = {j: c[j] for j in (3, 1, 0, 2)}
    assert torch.equal(
        wire.reduce_part(c, 64.0, 500, 300, "fp32")[3], wire.reduce_part(shuffled, 64.0, 500, 300, "fp32")[3]
    )


def test_reduce_part_with_nothing_usable():
    assert wire.reduce_part({}, 64.0, 10, 4, "fp16") == ([], [], None, None)
    big = [torch.full((10,), 6e4), torch.full((10,), 6e4)]  # near the fp16 limit, the mean still fits
    assert wire.reduce_part(contributions(big, [1.0, 1.0], "fp16", chunk=4), 64.0, 10, 4, "fp16")[0] == [0, 1]
    overflow = [torch.full((10,), 3e38), torch.full((10,), 3e38)]  # the fp32 sum overflows: no update
    assert wire.reduce_part(contributions(overflow, [1.0, 1.0], "fp32", chunk=4), 64.0, 10, 4, "fp32") == (
        [],
        [],
        None,
        None,
    )


def scatter_header(**changes):
    h = {
        "kind": "scatter",
        "group": "g",
        "digest": "abc",
        "part": 0,
        "n": 10,
        "numel": 4,
        "chunk": 4,
        "comp": "fp16",
        "weight": 1.0,
        "finite": True,
    }
    h.update(changes)
    return h


def test_header_roundtrip():
    h = scatter_header()
    assert wire.parse_header(wire.pack_header(h)) == {"v": wire.PROTOCOL_VERSION, **h}


V = wire.PROTOCOL_VERSION


@pytest.mark.parametrize(
    "raw",
    [
        b"\x80\x81not json",
        b"[1, 2]",
        json.dumps({"v": 99, **scatter_header()}).encode(),
        json.dumps({"v": V, **scatter_header(kind="reboot")}).encode(),
        json.dumps({"v": V, **scatter_header(numel=-1)}).encode(),
        json.dumps({"v": V, **scatter_header(numel=4.0)}).encode(),
        json.dumps({"v": V, **scatter_header(chunk=wire.MAX_CHUNK_ELEMENTS + 1)}).encode(),
        json.dumps({"v": V, **scatter_header(comp="fp8")}).encode(),
        json.dumps({"v": V, **scatter_header(weight="1")}).encode(),
        json.dumps({"v": V, **scatter_header(finite=1)}).encode(),
        json.dumps({"v": V, **scatter_header(group="")}).encode(),
        json.dumps({"v": V, "kind": "mask", "group": "g", "digest": "d", "mask": [1, True]}).encode(),
        json.dumps({"v": V, "kind": "mask", "group": "g", "digest": "d", "mask": [1, 2]}).encode(),
        json.dumps(
            {"v": V, **scatter_header(kind="gather", empty=False, stream=True, contributors=[0], rejected={"0": "bored"})}
        ).encode(),
        json.dumps(
            {"v": V, **scatter_header(kind="gather", empty=False, stream=True, contributors=[-1], rejected={})}
        ).encode(),
        json.dumps(  # the quotes' flag (protocol 5) is a boolean
            {"v": V, **scatter_header(kind="gather", empty=False, stream=True, contributors=[0], rejected={},
                                      samples="yes")}
        ).encode(),
        # a mask's misquoted parts are part indexes of this group
        json.dumps({"v": V, "kind": "mask", "group": "g", "digest": "d", "mask": [1, 1], "misquoted": [2]}).encode(),
        json.dumps({"v": V, "kind": "mask", "group": "g", "digest": "d", "mask": [1, 1], "misquoted": "0"}).encode(),
    ],
)
def test_parse_header_rejects_malformed(raw):
    with pytest.raises(wire.WireError):
        wire.parse_header(raw)


def test_nan_weight_parses_then_fails_the_weight_check():
    h = wire.parse_header(wire.pack_header(scatter_header(weight=float("nan"))))
    assert math.isnan(h["weight"]) and wire.weight_problem(h["weight"], None, 64.0) == "weight"


def test_peers_digest_depends_on_order():
    assert wire.peers_digest(["a", "b"]) != wire.peers_digest(["b", "a"])
    assert wire.peers_digest(["a", "b"]) == wire.peers_digest(["a", "b"])


@pytest.mark.parametrize("compression", ["fp32", "fp16", "int8"])
def test_reducing_chunk_by_chunk_equals_reducing_the_part_whole(compression):
    """The pipelined reducer reduces each chunk as it lands; the fallback reduces the part whole.
    Both must give the same bits, whatever the chunking (elementwise sums in member order)."""
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(5000, generator=g) * (j + 1) for j in range(3)]
    weights = [1.0, 2.5, 7.0]
    whole = wire.reduce_part(contributions(xs, weights, compression, chunk=5000), 64.0, 5000, 5000, compression)
    pieces = []
    for a, b in wire.chunk_ranges(5000, 1024):
        chunk = [(w, wire.encode(x[a:b], compression)) for x, w in zip(xs, weights, strict=True)]
        encoded, values = wire.reduce_chunk(chunk, b - a, compression)
        assert torch.equal(wire.decode(encoded, b - a, compression), values)
        pieces.append(values)
    assert torch.equal(torch.cat(pieces), whole[3])  # int8: chunks of 1024 keep the 1024-blocks aligned


def test_accept_weights_and_a_non_finite_chunk():
    assert wire.accept_weights({2: 1.0, 0: 3.0, 1: 1e12}, 64.0) == ([0, 2], [1])
    assert wire.accept_weights({}, 64.0) == ([], [])
    assert wire.reduce_chunk([(1.0, wire.encode(torch.full((4,), 3e38), "fp32"))] * 2, 4, "fp32") is None


def test_gather_header_must_say_whether_it_is_streamed():
    fields = {"kind": "gather", "group": "g", "digest": "d", "part": 0, "n": 4, "numel": 2, "chunk": 2,
              "comp": "fp16", "empty": False, "contributors": [0], "rejected": {}}
    with pytest.raises(wire.WireError, match="stream"):
        wire.parse_header(wire.pack_header(fields))
    assert wire.parse_header(wire.pack_header({**fields, "stream": True}))["stream"] is True
