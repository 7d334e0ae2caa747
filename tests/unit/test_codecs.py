"""The lossy codecs (`swarm.collective.codecs`): int4 and topk2 error bounds computed here independently,
exact sizes, round trips, bad and truncated payloads refused with WireError, non-finite input
kept visible, and the sparse mean every member computes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diloco_p2p.config import compression
from diloco_p2p.swarm.collective import codecs, wire

DENSITY = 0.01
B = codecs.TOPK_BLOCK


def vector(n: int = 10_000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-3, 2, n)


@pytest.mark.parametrize("numel", [0, 1, 2, 63, 64, 65, 1001, 5000])
def test_int4_size_is_exact_and_error_is_bounded_by_each_blocks_absmax(numel):
    x = vector(numel)
    data = codecs.encode_int4(x)
    assert len(data) == codecs.int4_size(numel) == 4 * math.ceil(numel / 64) + math.ceil(numel / 2)
    y = codecs.decode_int4(data, numel)
    assert y.shape == (numel,) and y.dtype == torch.float32
    for start in range(0, numel, codecs.INT4_BLOCK):
        block, approx = x[start : start + 64], y[start : start + 64]
        assert (approx - block).abs().max() <= block.abs().max() / 14 * (1 + 1e-6)
        assert len(set(torch.round(approx / (block.abs().max() / 7)).tolist())) <= 15  # 4-bit codes


def test_int4_goes_through_wire_and_keeps_zero_blocks_exact():
    x = torch.zeros(300)
    x[200] = -3.0
    assert torch.equal(wire.roundtrip(x, "int4", chunk_elements=128), x)
    assert wire.bytes_per_element("int4") == 0.5625


def test_int4_refuses_a_wrong_length_and_an_unused_code():
    data = codecs.encode_int4(torch.randn(100))
    for bad, n in ((data[:-1], 100), (data + b"\x88", 100), (data, 98)):
        with pytest.raises(wire.WireError):
            codecs.decode_int4(bad, n)
    zeroed = bytearray(data)
    zeroed[-1] = 0x08  # the high nibble of the last byte is 0: not a code
    with pytest.raises(wire.WireError, match="nibble"):
        codecs.decode_int4(bytes(zeroed), 100)


def _lloyd(mag: np.ndarray, steps: int) -> tuple[float, float, np.ndarray]:
    """Two levels of `mag` by Lloyd's algorithm in float64, from the split at the lower median."""
    split = np.sort(mag)[(mag.size - 1) // 2]
    for _ in range(steps):
        up = mag >= split
        hi = mag[up].mean()
        lo = mag[~up].mean() if (~up).any() else hi
        split = (lo + hi) / 2
    return lo, hi, mag >= split


def _reference_topk(x: torch.Tensor, density: float) -> torch.Tensor:
    """What topk2 keeps, computed with numpy: per block of TOPK_BLOCK the ceil(d·m) largest
    magnitudes, each replaced by the nearer of the block's two Lloyd levels, with its sign."""
    a = x.double().numpy()
    out = np.zeros_like(a)
    for start in range(0, a.size, B):
        block = a[start : start + B]
        k = min(block.size, max(1, math.ceil(density * block.size)))
        keep = np.argsort(-np.abs(block), kind="stable")[:k]
        lo, hi, up = _lloyd(np.abs(block[keep]), codecs.LLOYD_STEPS)
        out[start + keep] = np.sign(block[keep]) * np.where(up, hi, lo)
    return torch.from_numpy(out)


@pytest.mark.parametrize("numel, density", [(1, 0.01), (100, 0.01), (B, 0.01), (B + 10_000, 0.01), (9000, 0.3)])
def test_topk2_keeps_each_blocks_largest_values_at_the_nearer_of_two_lloyd_levels(numel, density):
    x = vector(numel, seed=numel)
    data = codecs.encode_topk(x, density)
    assert len(data) == codecs.topk_size(numel, density)
    y = codecs.decode_topk(data, numel, density)
    ref = _reference_topk(x, density)
    assert torch.equal(y != 0, ref != 0)  # the same positions (the vector has no ties)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=0)
    for start in range(0, numel, B):
        kept = y[start : start + B] != 0
        got, mag = y[start : start + B][kept].abs(), x[start : start + B][kept].abs()
        levels = got.unique()
        assert len(levels) <= 2
        nearer = levels[(mag[:, None] - levels[None, :]).abs().argmin(dim=1)]
        assert torch.allclose(got, nearer, rtol=1e-6, atol=0)
        if kept.sum() > 2:  # better than levels at 1/4 and 3/4 of the kept range
            lo, hi = mag.min(), mag.max()
            fixed = torch.where(mag >= (lo + hi) / 2, lo + 0.75 * (hi - lo), lo + 0.25 * (hi - lo))
            assert (got - mag).norm() < (fixed - mag).norm()


def test_topk2_sizes_are_the_elias_fano_bound():
    """Per block: 8 bytes of its two levels, then k·(L + 2) + k + ((m-1) >> L) + 1 bits, L = floor(log2(m/k)),
    computed here from the layout; 50x fewer bytes than fp16 up to a density of 3%."""
    for numel, density in ((1, 0.01), (B, 0.01), (B, 0.03), (B + 4, 0.01), (1 << 20, 0.03), (9000, 0.6)):
        blocks = [B] * (numel // B) + ([numel % B] if numel % B else [])
        bits = 0
        for m in blocks:
            k = min(m, max(1, math.ceil(density * m)))
            low = int(math.floor(math.log2(m / k)))
            bits += k * (low + 2) + k + ((m - 1) >> low) + 1
        assert codecs.topk_size(numel, density) == 8 * len(blocks) + math.ceil(bits / 8)
    n = 1 << 20
    assert 2 * n / codecs.topk_size(n, 0.01) >= 120 and 2 * n / codecs.topk_size(n, 0.03) >= 50


def _pack(lohi: list[tuple[float, float]], offsets: list[list[int]], codes: list[list[int]], sizes: list[int]) -> bytes:
    """A topk2 frame written from the layout in the codecs docstring, for any offsets (also bad ones)."""
    bits: list[int] = []
    lows = [int(math.floor(math.log2(m / len(o)))) for m, o in zip(sizes, offsets, strict=True)]
    for m, o, low in zip(sizes, offsets, lows, strict=True):
        vector = [0] * (len(o) + ((m - 1) >> low) + 1)
        for i, off in enumerate(o):
            vector[min((off >> low) + i, len(vector) - 1)] = 1
        bits += vector
    for o, c, low in zip(offsets, codes, lows, strict=True):
        for off, code in zip(o, c, strict=True):
            bits += [(off >> j) & 1 for j in range(low)] + [code & 1, code >> 1]
    bits += [0] * (-len(bits) % 8)
    packed = bytes(sum(bit << j for j, bit in enumerate(bits[i : i + 8])) for i in range(0, len(bits), 8))
    return np.array(lohi, dtype="<f4").tobytes() + packed


def test_topk2_layout_is_the_documented_one():
    x = vector(B + 4, seed=3)  # a full block (656 kept) and a tail of 4 (1 kept)
    y = codecs.decode_topk(codecs.encode_topk(x, DENSITY), B + 4, DENSITY)
    offsets = [torch.nonzero(y[:B]).view(-1).tolist(), torch.nonzero(y[B:]).view(-1).tolist()]
    lohi, codes = [], []
    for start, o in zip((0, B), offsets, strict=True):
        got = y[start:][o]
        levels = sorted(set(got.abs().tolist()))
        lo, hi = levels[0], levels[-1]  # a block whose magnitudes all take one level: both, all upper
        lohi.append((lo, hi))
        codes.append([int(v < 0) * 2 + int(abs(v) == hi) for v in got.tolist()])
    assert codecs.encode_topk(x, DENSITY) == _pack(lohi, offsets, codes, [B, 4])


def test_topk2_refuses_truncated_padded_and_disordered_payloads():
    n = B + 904
    data = codecs.encode_topk(vector(n), DENSITY)
    for bad in (data[:-1], data + b"\x00"):
        with pytest.raises(wire.WireError, match="expected"):
            codecs.decode_topk(bad, n, DENSITY)
    with pytest.raises(wire.WireError):
        codecs.decode_topk(data, n, 0.02)  # another density: another size
    lohi = [(0.5, 1.0), (0.5, 1.0)]
    good = [list(range(0, B, 99))[:656], list(range(0, 904, 100))]  # 656 of a full block, 10 of the tail of 904
    codes = [[1] * 656, [2] * 10]
    assert torch.count_nonzero(codecs.decode_topk(_pack(lohi, good, codes, [B, 904]), n, DENSITY)) == 666
    repeated = [good[0][:20] + [good[0][19]] + good[0][21:], good[1]]  # the same offset twice
    swapped = [good[0][:5] + [8 * 64 + 20, 8 * 64 + 10] + good[0][7:], good[1]]  # one high part, low bits descending
    out_of_range = [good[0][:-1] + [B], good[1]]
    for changed in (repeated, swapped, out_of_range):
        with pytest.raises(wire.WireError, match="offsets"):
            codecs.decode_topk(_pack(lohi, changed, codes, [B, 904]), n, DENSITY)
    flipped = bytearray(data)
    flipped[8 * 2] ^= 0xFF  # eight bits of the first block's bit vector: no longer 656 ones
    with pytest.raises(wire.WireError, match="offsets"):
        codecs.decode_topk(bytes(flipped), n, DENSITY)


def test_topk2_tail_block_offsets_are_checked_against_its_own_size():
    good = _pack([(1.0, 1.0), (1.0, 1.0)], [list(range(656)), [3]], [[0] * 656, [0]], [B, 4])
    assert codecs.decode_topk(good, B + 4, DENSITY)[B + 3] == 1.0
    bad = _pack([(1.0, 1.0), (1.0, 1.0)], [list(range(656)), [4]], [[0] * 656, [0]], [B, 4])  # the tail has 0..3
    with pytest.raises(wire.WireError, match="offsets"):
        codecs.decode_topk(bad, B + 4, DENSITY)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_topk2_non_finite_input_stays_visible(bad):
    x = vector(5000)
    x[10] = bad
    assert not wire.is_finite(codecs.decode_topk(codecs.encode_topk(x, DENSITY), 5000, DENSITY))


def test_density_is_checked():
    for bad in (0, -0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError):
            codecs.check_density(bad)
    codecs.check_density(1)


def test_sparse_mean_is_the_weighted_mean_of_the_decoded_contributions_in_fp32():
    xs, weights, chunk = [vector(9000, seed=s) for s in range(3)], [1.0, 3.0, 2.0], 4000
    contribs = [(w, codecs.encode_chunks(x, chunk, DENSITY)) for w, x in zip(weights, xs, strict=True)]
    mean = codecs.sparse_mean(contribs, 9000, chunk, DENSITY)
    decoded = [codecs.decode_chunks(frames, 9000, chunk, DENSITY).double() for _, frames in contribs]
    exact = sum(w * d for w, d in zip(weights, decoded, strict=True)) / sum(weights)
    assert mean.dtype == torch.float32 and torch.allclose(mean.double(), exact, rtol=1e-6, atol=1e-9)
    assert torch.equal(mean, codecs.sparse_mean(list(contribs), 9000, chunk, DENSITY))  # deterministic


def test_contrib_headers_are_validated():
    good = {"kind": "contrib", "group": "g", "digest": "d", "n": 10, "chunk": 4, "comp": "topk2",
            "density": 0.01, "weight": 1.0, "finite": True}
    assert wire.parse_header(wire.pack_header(good))["density"] == 0.01
    for key, value in (("comp", "int8"), ("density", 0), ("density", 2), ("weight", "1"), ("finite", 1),
                       ("chunk", 0), ("n", -1)):
        with pytest.raises(wire.WireError):
            wire.parse_header(wire.pack_header({**good, key: value}))
    mask = {"kind": "mask", "group": "g", "digest": "d", "mask": [1, 0], "contrib_digests": ["ab", ""]}
    assert wire.parse_header(wire.pack_header(mask))["contrib_digests"] == ["ab", ""]


# ----------------------------------------------------------------------------- the declarations


@pytest.mark.parametrize("name", compression.NAMES)
def test_each_declared_codec_is_what_the_wire_writes_the_planner_counts_and_the_config_accepts(name):
    """`config.compression.CODECS` is the one declaration: its size is the length of the encoders'
    bytes (counted here from what they write), the planner's count, and the config takes the name."""
    from diloco_p2p.config import load_config
    from diloco_p2p.planner import plan

    declared = compression.CODECS[name]
    for numel in (1, 63, 64, 65, 1023, 1025, B, B + 1, 3 * B + 7):
        x = vector(numel, seed=numel)
        for density in (0.01, 0.034, 1.0) if declared.sparse else (1.0,):
            data = codecs.encode_topk(x, density) if declared.sparse else wire.encode(x, name)
            assert len(data) == declared.size(numel, density) == plan.payload_size(numel, name, density)
    assert (name in wire.SPARSE, name in wire.COMPRESSIONS) == (declared.sparse, not declared.sparse)
    if not declared.sparse:
        big = 4 * B
        assert wire.bytes_per_element(name) == len(wire.encode(torch.ones(big), name)) / big
        once = wire.roundtrip(vector(5000), name)
        assert torch.equal(wire.roundtrip(once, name), once) or not declared.exact_reencode  # the grid relies on it
    cfg = load_config(None, [f"sync.compression={name}", "sync.error_feedback=true"])
    assert cfg.sync.compression == name and cfg.sync.feedback_on == declared.feedback


def test_the_config_offers_exactly_the_declared_codecs():
    from typing import get_args

    from diloco_p2p.config import SyncConfig, load_config
    from diloco_p2p.errors import UserError

    assert get_args(SyncConfig.model_fields["compression"].annotation) == compression.NAMES
    assert wire.COMPRESSIONS + wire.SPARSE == compression.NAMES
    with pytest.raises(UserError, match="sync.compression"):
        load_config(None, ["sync.compression=bf16"])
    with pytest.raises(ValueError, match="unknown compression 'bf16'; expected one of fp32, fp16"):
        compression.codec("bf16")
