"""The pure robust-aggregation rules and reducer checks (`diloco_p2p.swarm.collective.aggregate`), against
values the tests compute on their own (plain Python / float64), and their determinism."""

from __future__ import annotations

import math
import random
import statistics
import struct

import pytest
import torch

from diloco_p2p.config import SyncConfig
from diloco_p2p.swarm.collective import aggregate, wire
from diloco_p2p.swarm.collective.aggregate import Robust
from diloco_p2p.swarm.transport.streams import WireError


def vectors(m: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(m)]


def _mean_around_median(column: list[float], b: int) -> float:
    """Independent reference: the len - b values nearest the median (ties: lower index first)."""
    ordered = sorted(column)
    m = len(column)
    median = (ordered[(m - 1) // 2] + ordered[m // 2]) / 2
    kept = sorted(range(m), key=lambda i: (abs(column[i] - median), i))[: m - b]
    return sum(column[i] for i in kept) / (m - b)


@pytest.mark.parametrize("m", [4, 5, 8])
def test_trimmed_mean_drops_the_values_farthest_from_the_median(m):
    xs = vectors(m, 40, m)
    got = aggregate.trimmed_mean(xs, 0.25)  # b = floor(0.25 * m): 1, 1, 2 dropped per coordinate
    for i in range(40):
        column = [float(x[i]) for x in xs]
        assert math.isclose(float(got[i]), _mean_around_median(column, m // 4), rel_tol=1e-5, abs_tol=1e-6)
    assert torch.allclose(aggregate.trimmed_mean(xs, 0.0), torch.stack(xs).sum(0) / m, atol=1e-6)
    # trimming never empties the set nor passes the median: with 2 values and 0.49, both stay
    two = vectors(2, 8, 2)
    assert torch.allclose(aggregate.trimmed_mean(two, 0.49), (two[0] + two[1]) / 2)


def test_trimmed_mean_ignores_one_outlier_entirely():
    xs = [torch.full((6,), v) for v in (1.0, 2.0, 3.0)] + [torch.full((6,), 1e9)]
    assert torch.equal(aggregate.trimmed_mean(xs, 0.25), torch.full((6,), 2.0))


def test_trimmed_mean_of_four_with_a_sign_flip_is_the_honest_mean():
    """The benchmark's case: 3 honest values that agree in sign and a 4th at minus their mean.
    The two-sided trim (Yin et al.) would keep the 2 honest values nearest the attacker; this
    keeps all 3 honest ones."""
    g = torch.Generator().manual_seed(9)
    base = torch.rand(64, generator=g) + 1.0
    honest = [base * (1 + 0.1 * k) for k in range(3)]
    attacker = -(honest[0] + honest[1] + honest[2]) / 3
    got = aggregate.trimmed_mean([honest[0], attacker, honest[1], honest[2]], 0.25)
    assert torch.allclose(got, (honest[0] + honest[1] + honest[2]) / 3, rtol=1e-6)


def test_trimmed_mean_breaks_equal_distances_by_member_index():
    # median 0: -1 and +1 are equally far; the lower index (here -1, index 0) is kept
    xs = [torch.tensor([-1.0]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([1.0])]
    assert torch.equal(aggregate.trimmed_mean(xs, 0.25), torch.tensor([-1.0 / 3]))


def test_centered_clip_matches_the_formula():
    """v = c + (1/m) Σ (x_i - c) min(1, τ/||x_i - c||), c the coordinatewise lower median,
    τ = radius × the lower median of the distances (Karimireddy et al. 2021, eq. 2)."""
    xs = vectors(4, 30, 3)
    xs[3] = xs[3] * 50  # an outlier, clipped
    rows = [[float(v) for v in x] for x in xs]
    center = [sorted(col)[(len(col) - 1) // 2] for col in zip(*rows, strict=True)]
    dists = [math.sqrt(sum((a - c) ** 2 for a, c in zip(r, center, strict=True))) for r in rows]
    tau = 0.7 * sorted(dists)[(len(dists) - 1) // 2]
    expected = [c + sum((r[i] - c) * min(1.0, tau / d) for r, d in zip(rows, dists, strict=True)) / 4
                for i, c in enumerate(center)]
    got = aggregate.centered_clip(xs, 0.7)
    assert max(abs(float(g) - e) for g, e in zip(got, expected, strict=True)) < 1e-5
    # the outlier moves the result by at most tau / m
    honest = aggregate.centered_clip(xs[:3] + [torch.tensor(center)], 0.7)
    assert float((got - honest).norm()) <= 2 * tau / 4 + 1e-4


def test_radial_keeps_the_weighted_mean_norm_in_the_weighted_mean_direction():
    """r = (Σ w_i ||x_i|| / Σ w_i) · u / ||u||, u = Σ w_i x_i / ||x_i||, against plain float64 Python."""
    xs = vectors(3, 40, 11)
    xs[1] = xs[1] * 4
    weights = [1.0, 2.0, 0.5]
    rows = [[float(v) for v in x] for x in xs]
    norms = [math.sqrt(sum(v * v for v in r)) for r in rows]
    radius = sum(w * n for w, n in zip(weights, norms, strict=True)) / sum(weights)
    u = [sum(w * r[i] / n for w, r, n in zip(weights, rows, norms, strict=True)) for i in range(40)]
    length = math.sqrt(sum(v * v for v in u))
    got = aggregate.radial(weights, xs)
    assert max(abs(float(g) - radius * v / length) for g, v in zip(got, u, strict=True)) < 1e-5
    # members in the same order get the same bits; a zero contribution adds no direction
    assert torch.equal(got, aggregate.radial(weights, [x.clone() for x in xs]))
    with_zero = aggregate.radial([*weights, 1.0], [*xs, torch.zeros(40)])
    assert float(torch.nn.functional.cosine_similarity(with_zero, got, dim=0)) > 1 - 1e-6
    assert torch.equal(aggregate.radial([1.0], [torch.zeros(5)]), torch.zeros(5))
    # directions that cancel give zero, not their rounding noise blown up to the mean norm
    for n in (50, 5000):
        x = vectors(1, n, 12)[0]
        assert torch.equal(aggregate.radial([1.0, 1.0], [x, -x]), torch.zeros(n))


@pytest.mark.parametrize("m", [2, 8, 32])
def test_radial_does_not_shrink_as_more_directions_cancel(m):
    """M updates sharing one direction under independent noise: the mean's norm falls towards the shared
    part's as M grows; the radial average keeps the updates' own norm, and the mean's direction."""
    g = torch.Generator().manual_seed(m)
    shared = torch.randn(4000, generator=g)
    xs = [shared + 2 * torch.randn(4000, generator=g) for _ in range(m)]
    weights = [1.0] * m
    mean = aggregate.combine(Robust(), weights, xs)
    got = aggregate.combine(Robust("radial"), weights, xs)
    own = statistics.fmean(float(x.norm()) for x in xs)
    assert float(got.norm()) == pytest.approx(own, rel=1e-5)
    # E||mean||² = n (1 + 4/m) against E||x||² = n (1 + 4): the mean shrinks with m, radial does not
    assert float(mean.norm()) / own == pytest.approx(math.sqrt((1 + 4 / m) / 5), rel=0.05)
    assert float(torch.nn.functional.cosine_similarity(got, mean, dim=0)) > 0.99


def test_norm_bound_uses_the_lower_median():
    assert aggregate.accept_norms({0: 1.0, 1: 1.2, 2: 9.7}, 8.0) == ([0, 1], [2])  # 9.7 > 8 × 1.2
    assert aggregate.accept_norms({0: 1.0, 1: 1.2, 2: 9.5}, 8.0) == ([0, 1, 2], [])
    # two huge claims cannot raise the reference past the honest ones' with 4 members (lower median)
    assert aggregate.accept_norms({0: 1.0, 1: 1.1, 2: 1e6, 3: 1e6}, 8.0) == ([0, 1], [2, 3])
    assert aggregate.accept_norms({0: 1.0, 1: None}, 8.0) == ([0], [1])  # stating nothing is refused
    assert aggregate.accept_norms({0: 1.0, 1: None}, None) == ([0, 1], [])


def test_weight_cap():
    assert aggregate.capped_weights({0: 100.0, 1: 120.0, 2: 5000.0}, 4.0) == {0: 100.0, 1: 120.0, 2: 480.0}
    assert aggregate.capped_weights({0: 1.0, 1: 9.0}, None) == {0: 1.0, 1: 9.0}


def test_sumsq_of_a_whole_part_is_the_plain_fp64_sum_of_squares():
    x = torch.randn(3 * wire.SUMSQ_SLICE + 123, generator=torch.Generator().manual_seed(5)) * 40
    plain = math.fsum(v * v for v in x.double().tolist())
    assert math.isclose(aggregate.sumsq(x), plain, rel_tol=1e-12)
    assert math.isclose(aggregate.sumsq(x, exact=False), plain, rel_tol=1e-6)  # well inside NORM_TOLERANCE
    assert aggregate.sumsq(torch.zeros(0)) == 0.0 and aggregate.sumsq(torch.zeros(5), exact=False) == 0.0
    x[wire.SUMSQ_SLICE + 7] = math.nan
    assert math.isnan(aggregate.sumsq(x)) and math.isnan(aggregate.sumsq(x, exact=False))


@pytest.mark.parametrize("chunk", [1000, wire.SUMSQ_SLICE, 3 * wire.SUMSQ_SLICE // 2])
def test_a_parts_sum_of_squares_is_the_same_summed_as_chunks_land_or_whole(chunk):
    """The reducer check's Σx² of a part: a member that received it in streamed chunks (summing each
    chunk as it landed) and one that holds it whole get the same float, and it is the part's."""
    x = torch.randn(2 * wire.SUMSQ_SLICE + 4321, generator=torch.Generator().manual_seed(9)) * 3
    landed = 0.0
    for a, b in wire.chunk_ranges(x.numel(), chunk):
        landed += aggregate.sumsq(x[a:b].clone())  # a chunk as decoded from its own frame
    assert aggregate.part_sumsq(x, chunk) == landed
    assert math.isclose(landed, math.fsum(v * v for v in x.double().tolist()), rel_tol=1e-12)
    assert aggregate.part_sumsq(torch.zeros(0), chunk) == 0.0


@pytest.mark.parametrize("scale", [1e20, 1e-22, 3e38])
def test_the_fast_sumsq_is_exact_where_float32_squares_overflow_or_underflow(scale):
    """1e20² overflows float32 and 1e-22² underflows it: those slices take the fp64 sum, so a claim
    about them is still checked against their true norm (3e38 is finite, its square is not)."""
    x = torch.linspace(-1, 1, 1000) * scale
    exact = math.fsum(v * v for v in x.double().tolist())
    assert math.isfinite(exact) and math.isclose(aggregate.sumsq(x, exact=False), exact, rel_tol=1e-12)


def test_claimed_norm_is_checked_against_the_data():
    x = vectors(1, 5000, 4)[0]
    norm = aggregate.encoded_norm(x, 1024, "fp16")
    squares = sum(aggregate.sumsq(wire.decode(wire.encode(x[a:b], "fp16"), b - a, "fp16"))
                  for a, b in wire.chunk_ranges(5000, 1024))
    assert aggregate.norm_matches(norm, squares)
    assert not aggregate.norm_matches(norm * 0.999, squares)
    assert not aggregate.norm_matches(norm * 1e-6, squares)
    assert aggregate.norm_matches(None, squares)
    assert math.isclose(norm, float(x.double().norm()), rel_tol=1e-3)


def _norm_of_the_bytes(x: torch.Tensor, chunk: int, compression: str) -> float:
    """The definition: encode chunk by chunk, decode, sum squares in float64 (plain Python)."""
    total = 0.0
    for a, b in wire.chunk_ranges(x.numel(), chunk):
        total += sum(v * v for v in wire.decode(wire.encode(x[a:b], compression), b - a, compression).double().tolist())
    return math.sqrt(total) if math.isfinite(total) else math.inf


@pytest.mark.parametrize("compression", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("chunk", [2048, 1000])  # whole int8 blocks, and chunks that end in a part-block
def test_a_stated_norm_is_the_norm_of_what_the_receiver_decodes(compression, chunk):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5000, generator=g) * torch.logspace(-6, 2, 5000)  # 8 decades: int8 blocks differ in scale
    x[1234] = 0.0
    norm, defined = aggregate.encoded_norm(x, chunk, compression), _norm_of_the_bytes(x, chunk, compression)
    assert math.isclose(norm, defined, rel_tol=1e-6)  # a claim is checked to 1e-4
    assert aggregate.norm_matches(aggregate.stated(norm), defined**2)
    sent = [wire.encode_sumsq(x[a:b], compression) for a, b in wire.chunk_ranges(x.numel(), chunk)]
    assert [data for data, _ in sent] == [wire.encode(x[a:b], compression) for a, b in wire.chunk_ranges(5000, chunk)]
    assert math.isclose(math.sqrt(sum(sq for _, sq in sent)), defined, rel_tol=1e-6)  # what a scatter states
    assert aggregate.encoded_norm(torch.zeros(3000), chunk, compression) == 0.0
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[4321] = bad
        assert aggregate.encoded_norm(y, chunk, compression) == math.inf
    if compression == "fp16":  # finite here, infinite on the wire: the receiver would refuse it
        assert aggregate.encoded_norm(torch.full((10,), 1e5), chunk, compression) == math.inf


def contributions(xs, weights, compression, chunk):
    ranges = wire.chunk_ranges(xs[0].numel(), chunk)
    return {i: (w, [wire.encode(x[a:b], compression) for a, b in ranges])
            for i, (x, w) in enumerate(zip(xs, weights, strict=True))}


@pytest.mark.parametrize("aggregation", aggregate.AGGREGATIONS)
def test_reduce_part_is_deterministic_and_chunking_does_not_matter(aggregation):
    xs, weights = vectors(5, 3000, 5), [1.0, 2.0, 1.5, 1.0, 3.0]
    robust = Robust(aggregation, max_norm_ratio=8.0, weight_cap=2.0)
    norms = {i: aggregate.encoded_norm(x, 700, "fp16") for i, x in enumerate(xs)}
    contribs = contributions(xs, weights, "fp16", 700)
    first = aggregate.reduce_part(robust, contribs, norms, 16.0, 3000, 700, "fp16")
    shuffled = dict(random.Random(0).sample(list(contribs.items()), len(contribs)))
    again = aggregate.reduce_part(robust, shuffled, norms, 16.0, 3000, 700, "fp16")
    assert first[0] == again[0] == [0, 1, 2, 3, 4] and first[2] == again[2]
    assert torch.equal(first[3], again[3])
    if aggregation != "mean":  # coordinatewise or whole-part: the same values in one chunk as in many
        whole = aggregate.reduce_part(robust, contributions(xs, weights, "fp32", 3000),
                                      norms, 16.0, 3000, 3000, "fp32")[3]
        assert torch.allclose(first[3], whole, atol=2e-3)


def test_mean_is_the_wire_reduce_bit_for_bit():
    xs, weights = vectors(3, 2000, 6), [1.0, 3.0, 2.0]
    contribs = contributions(xs, weights, "fp16", 512)
    ours = aggregate.reduce_part(aggregate.MEAN, contribs, {}, 64.0, 2000, 512, "fp16")
    theirs = wire.reduce_part(contribs, 64.0, 2000, 512, "fp16")
    assert ours[2] == theirs[2] and torch.equal(ours[3], theirs[3])


def test_reduce_part_refuses_by_weight_then_norm_and_caps_the_rest():
    xs = vectors(4, 100, 7)
    xs[3] = xs[3] * 100
    norms = {i: aggregate.encoded_norm(x, 100, "fp32") for i, x in enumerate(xs)}
    contribs = contributions(xs, [1.0, 1.0, 1e6, 3.0], "fp32", 100)
    accepted, refused, _, values = aggregate.reduce_part(Robust(max_norm_ratio=8.0, weight_cap=2.0), contribs, norms,
                                                         16.0, 100, 100, "fp32")
    assert accepted == [0, 1] and refused == {2: "weight", 3: "norm"}
    assert torch.allclose(values, (xs[0] + xs[1]) / 2)
    capped = aggregate.reduce_part(Robust(weight_cap=2.0), contributions(xs[:3], [1.0, 1.0, 3.0], "fp32", 100),
                                   {}, 16.0, 100, 100, "fp32")[3]
    assert torch.allclose(capped, (xs[0] + xs[1] + 2 * xs[2]) / 4)  # 3.0 capped at 2 × 1.0


def test_suspect_parts_catches_split_digests_and_oversized_averages():
    a, b = "a" * 64, "b" * 64
    digests = {0: [a, a], 1: [a, a], 2: [b, a]}
    norms = {0: [1.0, 2.0], 1: [1.0, 2.0], 2: [1.0, 2.0]}
    contributors = {0: [0, 1, 2], 1: [0, 1, 2]}
    ok = {0: math.sqrt(3) * 0.99, 1: 2.0}
    caught = aggregate.suspect_parts([0, 1], digests, norms, contributors, ok, None, "fp32")
    assert list(caught) == [0] and "different bytes" in caught[0].why
    big = {0: 1.0, 1: math.sqrt(12) * 1.01}  # sqrt(3 × 2²) is the most part 1's average can be
    caught = aggregate.suspect_parts([1], digests, norms, contributors, big, None, "fp32")
    assert list(caught) == [1] and "norm" in caught[1].why
    assert aggregate.suspect_parts([1], digests, norms, contributors, {1: math.sqrt(12) * 0.99}, None, "fp32") == {}
    # a contributor whose mask was not heard: part not checked by norm (no bound known)
    assert aggregate.suspect_parts([1], digests, {0: [1.0, 2.0]}, contributors, big, None, "fp32") == {}
    # a contributor stating a huge norm is capped by the norm bound (3 members: lower median 2)
    lying = {0: [1.0, 2.0], 1: [1.0, 2.0], 2: [1.0, 1e6]}
    assert aggregate.norm_bound([2.0, 2.0, 1e6], 8.0, "fp32") < 17.0
    assert list(aggregate.suspect_parts([1], digests, lying, contributors, {1: 100.0}, 8.0, "fp32")) == [1]


def test_one_lying_mask_drops_a_part_but_cannot_frame_its_reducer():
    """Member 3 states another digest of part 0 than its reducer (member 0) and the others: the
    part is dropped (it might be a reducer that sent member 3 other bytes), but its reducer is not
    blamed; two members of three stating so prove it. Likewise an understated norm."""
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    one = {0: [a], 1: [a], 2: [a], 3: [b]}
    assert aggregate.suspect_parts([0], one, {}, {}, {0: 1.0}, 8.0, "fp16") == {0: (
        "sent different bytes of part 0 to different members (2 digests)", False)}
    two = {0: [a], 1: [a], 2: [c], 3: [b]}
    assert aggregate.suspect_parts([0], two, {}, {}, {0: 1.0}, 8.0, "fp16")[0].proven
    unheard_reducer = {1: [b], 2: [c], 3: [b]}
    assert not aggregate.suspect_parts([0], unheard_reducer, {}, {}, {0: 1.0}, 8.0, "fp16")[0].proven
    # norms: 4 contributors of norm 1 (average at most 2); member 3 states 1e-6 instead
    same = {j: [a] for j in range(4)}
    understated = {0: [1.0], 1: [1.0], 2: [1.0], 3: [1e-6]}
    contributors = {0: [0, 1, 2, 3]}
    framed = aggregate.suspect_parts([0], same, understated, contributors, {0: 1.9}, 8.0, "fp32")
    assert framed[0].why.startswith("its average of part 0 has norm 1.9") and not framed[0].proven
    # a reducer that scaled its part x1000 is proven all the same
    assert aggregate.suspect_parts([0], same, understated, contributors, {0: 1000.0}, 8.0, "fp32")[0].proven


def test_the_norm_check_holds_for_every_rule():
    """The bound sqrt(Σ ||x_c||²) holds for the mean, the trimmed mean and centered clipping."""
    for seed in range(20):
        xs = [x * (1 + 3 * i) for i, x in enumerate(vectors(4, 50, 100 + seed))]
        bound = math.sqrt(sum(float(x.double().norm()) ** 2 for x in xs))
        for out in (aggregate.combine(aggregate.MEAN, [1, 5, 1, 2], xs), aggregate.trimmed_mean(xs, 0.25),
                    aggregate.centered_clip(xs, 1.0), aggregate.centered_clip(xs, 5.0)):
            assert float(out.double().norm()) <= bound * (1 + 1e-6)


def test_scatter_norm_frames_and_masks_carry_norms_and_part_digests():
    assert wire.unpack_norm(wire.pack_norm(1.5)) == 1.5
    assert wire.unpack_norm(wire.pack_norm(0.0)) == 0.0
    assert wire.unpack_norm(wire.pack_norm(None)) is None  # a sender whose part is not finite states none
    assert len(wire.pack_norm(2.0)) == wire.NORM_FRAME_BYTES
    for bad in (struct.pack("<d", -1.0), struct.pack("<d", math.inf), b"\x00" * 7, b"\x00" * 9):
        with pytest.raises(WireError, match="norm"):
            wire.unpack_norm(bad)
    base = {"group": "g", "digest": "d"}
    mask = {**base, "kind": "mask", "mask": [1, 0], "part_digests": ["f" * 32, None], "norms": [0.5, None]}
    assert wire.parse_header(wire.pack_header(mask))["norms"] == [0.5, None]
    with pytest.raises(WireError, match="part_digests"):
        wire.parse_header(wire.pack_header({**mask, "part_digests": ["f" * 32]}))
    with pytest.raises(WireError, match="norms"):
        wire.parse_header(wire.pack_header({**mask, "norms": [0.5, -2]}))
    assert wire.parse_header(wire.pack_header({**mask, "relayed_norms": {"1": [0.5, None]}}))["relayed_norms"]
    for bad in ({"2": [0.5, None]}, {"x": [0.5, None]}, {"1": [0.5]}, {"1": [-1.0, None]}, [[0.5, None]]):
        with pytest.raises(WireError, match="relayed_norms"):
            wire.parse_header(wire.pack_header({**mask, "relayed_norms": bad}))
    assert "norm" in wire.REJECT_REASONS


def test_config_options_and_their_bounds():
    cfg = SyncConfig(aggregation="centered_clip", clip_radius=2.0, max_norm_ratio=None, opposed_cosine=-0.5,
                     min_part_ratio=0.2)
    assert aggregate.robust_of(cfg) == Robust("centered_clip", 0.25, 2.0, None, 4.0, -0.5, 0.2)
    assert aggregate.robust_of(SyncConfig(opposed_cosine=None, min_part_ratio=None)).opposed_cosine is None
    assert aggregate.robust_of(SyncConfig()).aggregation == "mean"
    for bad in ({"aggregation": "median"}, {"trim_fraction": 0.5}, {"clip_radius": 0}, {"max_norm_ratio": 0.5},
                {"weight_cap": 0.9}, {"opposed_cosine": -1}, {"opposed_cosine": 1}, {"min_part_ratio": 0},
                {"min_part_ratio": 1}):
        with pytest.raises(ValueError):
            SyncConfig(**bad)
    with pytest.raises(ValueError):
        Robust("median")
    assert statistics.median([SyncConfig().max_weight_ratio]) <= 16  # one peer no longer carries ~20x


# ----------------------------------------------------------------------------- directions and scale


def correlated(m: int, n: int, cosine: float, seed: int) -> list[torch.Tensor]:
    """m honest pseudo-gradients whose pairwise cosines are about `cosine`: a shared direction
    plus each member's own, with norms differing by up to 1.5x."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g)
    return [(math.sqrt(cosine) * base + math.sqrt(1 - cosine) * torch.randn(n, generator=g)) * (1 + 0.5 * i / m)
            for i in range(m)]


OPPOSED = SyncConfig().opposed_cosine


@pytest.mark.parametrize("m", [3, 4, 8])
def test_a_sign_flipped_sender_is_left_out_named_and_the_rest_reduced_as_without_it(m):
    """The flipper sends -Δ (its honest Δ, norm 7.9x the lower median) with the largest weight the
    bound lets through: `opposed` leaves it out, and the part is bit for bit the honest members'."""
    xs = correlated(m, 3000, 0.3, seed=m)
    xs[-1] = -xs[-1] * 7.9 * statistics.median_low([x.norm().item() for x in xs]) / xs[-1].norm()
    weights = [1.0 + 0.1 * i for i in range(m - 1)] + [15.9]
    robust = Robust(max_norm_ratio=8.0, weight_cap=4.0, opposed_cosine=OPPOSED)
    norms = {i: aggregate.encoded_norm(x, 700, "fp16") for i, x in enumerate(xs)}
    accepted, refused, frames, values = aggregate.reduce_part(robust, contributions(xs, weights, "fp16", 700), norms,
                                                              16.0, 3000, 700, "fp16")
    assert accepted == list(range(m - 1)) and refused == {m - 1: "opposed"}
    honest = aggregate.reduce_part(robust, contributions(xs[:-1], weights[:-1], "fp16", 700), norms, 16.0, 3000, 700,
                                   "fp16")
    assert honest[1] == {} and frames == honest[2] and torch.equal(values, honest[3])
    off = aggregate.reduce_part(Robust(max_norm_ratio=8.0, weight_cap=4.0), contributions(xs, weights, "fp16", 700),
                                norms, 16.0, 3000, 700, "fp16")
    assert off[1] == {} and torch.dot(off[3], honest[3]) < 0  # without the check the flip wins the part


@pytest.mark.parametrize("m", [3, 4, 5, 8, 16])
def test_an_honest_group_is_never_left_out_even_with_little_agreement(m):
    """Honest members agreeing as little as the benchmark's worst pair of senders (pairwise cosine
    0.12, benchmarks/swarm/blame.py) score above the threshold over many draws: nobody is left out."""
    for seed in range(20):
        xs = correlated(m, 4000, 0.12, seed=100 * m + seed)
        g = aggregate.gram(xs)
        assert min(aggregate.direction_scores(g, range(m)).values()) > OPPOSED + 0.08
        assert aggregate.opposed(g, range(m), OPPOSED) == []


def test_direction_scores_are_cosines_with_the_others_mean_direction():
    xs = correlated(4, 500, 0.3, 11)
    xs[2] = torch.zeros(500)  # a zero vector has no direction: it scores 0 and adds nothing
    scores = aggregate.direction_scores(aggregate.gram(xs), range(4))
    units = [x / x.norm() if x.norm() > 0 else x for x in xs]
    for i in (0, 1, 3):
        reference = sum(u.double() for j, u in enumerate(units) if j != i)
        expected = torch.nn.functional.cosine_similarity(units[i].double(), reference, dim=0)
        assert scores[i] == pytest.approx(float(expected), abs=1e-5)
    assert scores[2] == 0.0
    # others that cancel each other (member 2 sends member 1's -Δ, a little towards -x0): x0's small
    # agreement is scored against a reference as long as orthogonal others', not the tiny remainder
    a, b = vectors(2, 500, 12)
    cancel = aggregate.direction_scores(aggregate.gram([a, b, -b - 0.1 * a]), range(3))
    assert -0.2 < cancel[0] < 0 and cancel[2] < cancel[0]
    # chunk by chunk (as the stream sums it) is the whole part's Gram matrix
    ranges = wire.chunk_ranges(500, 128)
    chunks = {i: [wire.encode(x[a:b], "fp32") for a, b in ranges] for i, x in enumerate(xs)}
    assert torch.allclose(aggregate.part_gram(range(4), chunks, ranges, "fp32"), aggregate.gram(xs), rtol=1e-5)


def test_two_flippers_of_eight_are_left_out_one_at_a_time():
    xs = correlated(8, 3000, 0.3, seed=3)
    xs[5], xs[6] = -xs[5], -xs[6] * 3
    assert aggregate.opposed(aggregate.gram(xs), range(8), OPPOSED) == [5, 6]
    assert aggregate.opposed(aggregate.gram(xs), range(8), None) == []
    assert aggregate.opposed(aggregate.gram(xs[:2] + [-xs[2]])[:2, :2], range(2), OPPOSED) == []  # M = 2: no check


MIN_PART = SyncConfig().min_part_ratio


def _round_of_parts(k: int, seed: int) -> tuple[dict, dict, dict]:
    """One honest round of k parts: each member's stated norm per part and each part's average norm
    (random directions with pairwise cosine 0.3, norms varying by part and member)."""
    g = torch.Generator().manual_seed(seed)
    norms, averages = {j: [] for j in range(k)}, {}
    for p in range(k):
        xs = [x * (1 + float(torch.rand(1, generator=g))) for x in correlated(k, 2000, 0.3, seed=seed * 100 + p)]
        for j, x in enumerate(xs):
            norms[j].append(aggregate.stated(x.norm().item()))
        averages[p] = (sum(xs) / k).norm().item()
    return norms, {p: list(range(k)) for p in range(k)}, averages


@pytest.mark.parametrize("k", [3, 4, 8])
def test_a_part_shrunk_by_its_reducer_is_dropped_and_the_reducer_proven(k):
    for seed in range(10):
        norms, contributors, averages = _round_of_parts(k, seed)
        assert aggregate.small_parts(list(range(k)), norms, contributors, averages, MIN_PART) == {}
        for factor in (1e-3, 0.05):  # x0.05 is dropped; proving it would need the norms' spread (up to 3x here) too
            caught = aggregate.small_parts(list(range(k)), norms, contributors, {**averages, 1: averages[1] * factor},
                                           MIN_PART)
            assert list(caught) == [1] and "scale of the round's other parts" in caught[1].why
            assert caught[1].proven or factor > 0.01
    # through `suspect_parts`, as the members call it
    caught = aggregate.suspect_parts(list(range(k)), {}, norms, contributors, {**averages, 0: 0.0}, 8.0, "fp16",
                                     MIN_PART)
    assert list(caught) == [0] and caught[0].proven


def test_a_lying_member_cannot_get_an_honest_part_dropped_nor_its_reducer_blamed():
    """Member 3 of 4 states 1000x (or 1/1000 of) its norms, for one part or for all: the lower
    medians keep every part's scale within its honest contributors' norms."""
    norms, contributors, averages = _round_of_parts(4, 7)
    for factor in (1e3, 1e-3):
        for parts in ([0], [1, 2, 3], [0, 1, 2, 3]):
            lying = {**norms, 3: [n * factor if p in parts else n for p, n in enumerate(norms[3])]}
            assert aggregate.small_parts(list(range(4)), lying, contributors, averages, MIN_PART) == {}


def test_two_parts_can_drop_a_shrunk_part_but_not_prove_it():
    """With one other part, that part's reducer alone would set the scale: the part is dropped on
    every member, its reducer not blamed. A part with an unstated norm is not judged."""
    norms = {0: [1.0, 1.0], 1: [1.0, 1.0]}
    contributors = {0: [0, 1], 1: [0, 1]}
    caught = aggregate.small_parts([0, 1], norms, contributors, {0: 0.7, 1: 0.7e-3}, MIN_PART)
    assert list(caught) == [1] and not caught[1].proven
    assert aggregate.small_parts([0, 1], {0: [1.0, None], 1: [1.0, 1.0]}, contributors, {0: 0.7, 1: 0.7e-3},
                                 MIN_PART) == {}
    assert aggregate.small_parts([0, 1], norms, contributors, {0: 0.7, 1: 0.7e-3}, None) == {}
