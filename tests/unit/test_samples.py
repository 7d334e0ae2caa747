"""A reducer's quoted samples (`swarm.collective.samples`): honest parts always pass, in every dense
wire format and under both coordinatewise rules; a part scaled by a small factor is refuted; a
contributor sees its own values or weight misquoted; malformed frames are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_p2p.swarm.collective import aggregate, samples, wire
from diloco_p2p.swarm.transport.streams import WireError

CHUNK = 1000  # not a multiple of the int8 block: blocks restart at every chunk


def contributions(seed: int, k: int, numel: int) -> tuple[list[torch.Tensor], list[float]]:
    """Heavy-tailed pseudo-gradients sharing a direction, and uneven weights."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g) * torch.exp(2 * torch.randn(numel, generator=g))
    xs = [base + torch.randn(numel, generator=g) * base.abs().mean() for _ in range(k)]
    return xs, [float(w) for w in 500 + 1000 * torch.rand(k, generator=g)]


def reduced(xs, weights, robust, compression, numel):
    """(encoded contributions, decoded output) of one part, as a reducer makes it."""
    ranges = wire.chunk_ranges(numel, CHUNK)
    contribs = {j: (w, [wire.encode(x[a:b], compression) for a, b in ranges]) for j, (x, w) in enumerate(zip(xs, weights, strict=True))}
    norms = {j: aggregate.encoded_norm(x, CHUNK, compression) for j, x in enumerate(xs)}
    out = aggregate.reduce_part(robust, contribs, norms, 64.0, numel, CHUNK, compression)[3]
    return contribs, out


def quote_and_check(contribs, output, robust, compression, numel, digest="d" * 32):
    offsets = samples.places("g", 1, digest, numel)
    rows = torch.stack([samples.at(contribs[j][1], numel, CHUNK, compression, offsets) for j in sorted(contribs)])
    frame = samples.pack([contribs[j][0] for j in sorted(contribs)], rows)
    weights, rows = samples.unpack(frame, len(contribs), numel)
    allowed = samples.quantum(output, CHUNK, compression, offsets)
    return samples.refuted(robust, weights, rows, output[torch.from_numpy(offsets)], allowed), offsets, weights, rows


@pytest.mark.parametrize("compression", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("aggregation", ["mean", "trimmed_mean"])
def test_honest_parts_are_never_refuted_and_small_scales_are(compression, aggregation):
    robust = aggregate.Robust(aggregation, weight_cap=4.0)
    smallest = {"fp32": 1.001, "fp16": 1.01, "int8": 1.05, "int4": 1.3}[compression]
    for seed in range(12):
        numel = 3000 + 517 * seed
        xs, weights = contributions(seed, 3 + seed % 6, numel)
        contribs, out = reduced(xs, weights, robust, compression, numel)
        assert quote_and_check(contribs, out, robust, compression, numel, digest=f"{seed:032d}")[0] is None
        for factor in (smallest, 1 / smallest, 0.6, 2.0):
            lied = wire.roundtrip(out * factor, compression, CHUNK)
            assert quote_and_check(contribs, lied, robust, compression, numel)[0] is not None, (seed, factor)


@pytest.mark.parametrize("compression", ["fp32", "fp16", "int8", "int4"])
def test_a_contributor_checks_its_own_quoted_values_and_weight(compression):
    numel = 5003
    xs, weights = contributions(3, 4, numel)
    contribs, out = reduced(xs, weights, aggregate.MEAN, compression, numel)
    _, offsets, quoted, rows = quote_and_check(contribs, out, aggregate.MEAN, compression, numel)
    for j, x in enumerate(xs):
        values = samples.sent(x, CHUNK, compression, offsets)
        assert not samples.misquoted(quoted, rows, j, weights[j], values)
        bent = rows.clone()
        bent[j] *= 1.001
        assert samples.misquoted(quoted, bent, j, weights[j], values)
        assert samples.misquoted(quoted, rows, j, weights[j] * (1 + 1e-12), values)


def test_places_follow_the_digest_and_stay_inside_the_part():
    a, b = samples.places("g", 2, "a" * 32, 10_000), samples.places("g", 2, "b" * 32, 10_000)
    assert len(a) == samples.SAMPLES and a.min() >= 0 and a.max() < 10_000 and not np.array_equal(a, b)
    assert np.array_equal(a, samples.places("g", 2, "a" * 32, 10_000))
    assert len(samples.places("g", 2, "a" * 32, 5)) == 5 and samples.places("g", 2, "a" * 32, 5).max() < 5


def test_malformed_frames_are_refused():
    rows = torch.ones(2, samples.SAMPLES)
    good = samples.pack([1.0, 2.0], rows)
    assert samples.unpack(good, 2, 10_000)[0] == [1.0, 2.0]
    for bad in (good[:-1], good + b"\0", samples.pack([1.0, 0.0], rows), samples.pack([1.0, float("nan")], rows),
                samples.pack([1.0, 2.0], rows * float("inf"))):
        with pytest.raises(WireError):
            samples.unpack(bad, 2, 10_000)


def test_the_quotes_extend_the_part_digest():
    assert samples.digest("c" * 32, None) == "c" * 32
    assert samples.digest("c" * 32, b"x") != samples.digest("c" * 32, b"y") != "c" * 32


def test_an_int8_block_encodes_alike_alone_and_in_its_chunk():
    """A block of values too small for the fast path (127 / absmax overflows) leaves the chunk's
    other blocks as they would be alone, so a contributor can re-encode one block (`samples.sent`)."""
    x = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    x[1024:2048] *= 1e-39
    whole = wire.decode(wire.encode(x, "int8"), 3000, "int8")
    for a, b in ((0, 1024), (1024, 2048), (2048, 3000)):
        assert torch.equal(whole[a:b], wire.decode(wire.encode(x[a:b], "int8"), b - a, "int8"))


def test_quoted_weights_near_the_float_limit_are_judged_like_any_others():
    """Without a weight cap, quoted weights near the float limit would overflow an fp32 sum: the
    recomputation neither raises nor lets the part pass unchecked."""
    rows, output = torch.ones(3, 8), torch.ones(8)
    robust = aggregate.Robust(weight_cap=None)
    for weights in ([1.0, 1.0, 1.0], [1e308, 1e308, 1e308], [1e308, 1e308, 1.0]):
        assert samples.refuted(robust, weights, rows, output, torch.zeros(8)) is None
        assert samples.refuted(robust, weights, rows, 2 * output, torch.zeros(8)) is not None
