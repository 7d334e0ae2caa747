"""Lossy codecs for pseudo-gradients beyond int8: blockwise 4-bit and sparse top-k with 2-bit values.

Pure functions of tensors and bytes, like `wire` (which dispatches ``int4`` here). ``int4`` is
per-block absmax scaling with 4-bit codes (0.5625 bytes per value); ``topk2`` is SparseLoCo's
chunked top-k (Sarfi et al. 2025): per frame, the largest values by magnitude as a sign and one
of two Lloyd-Max levels, their offsets Elias-Fano coded. A frame's size is a function of
(numel, density) alone (declared with every codec: `diloco_p2p.config.compression`), and
`decode_topk` refuses a frame that breaks the layout. The protocol that moves them is `allreduce`
(``int4``) and `allgather` (``topk2``); what a node did not send is carried to its next round by
`diloco_p2p.loop.error_feedback`.
The formats, their measurements and layouts: docs/protocol/wire.md
"""

from __future__ import annotations

import math

import numpy as np
import torch

# The sizes and the top-k layout are declared with the codecs (`diloco_p2p.config.compression`).
from diloco_p2p.config.compression import INT4_BLOCK as INT4_BLOCK
from diloco_p2p.config.compression import TOPK_BLOCK as TOPK_BLOCK
from diloco_p2p.config.compression import int4_size as int4_size
from diloco_p2p.config.compression import topk_bits, topk_groups, topk_low_bits
from diloco_p2p.config.compression import topk_size as topk_size
from diloco_p2p.swarm.transport.streams import WireError

LLOYD_STEPS = 4  # of the 2-level quantizer of kept magnitudes (`_levels`)


def _ranges(numel: int, chunk: int) -> list[tuple[int, int]]:
    """`wire.chunk_ranges` (repeated: wire imports this module)."""
    return [(a, min(a + chunk, numel)) for a in range(0, numel, chunk)]


# ----------------------------------------------------------------------------- int4


def encode_int4(x: torch.Tensor) -> bytes:
    """Blockwise absmax 4-bit codes of a flat float32 tensor (docs/protocol/wire.md)."""
    x = x.detach().reshape(-1).to(torch.float32)
    numel = x.numel()
    blocks = math.ceil(numel / INT4_BLOCK)
    padded = torch.zeros(blocks * INT4_BLOCK, dtype=torch.float32)
    padded[:numel] = x
    padded = padded.view(blocks, INT4_BLOCK)
    scale = padded.abs().amax(dim=1) / 7.0  # NaN/inf propagate into the scale: caught on decode
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(padded / safe[:, None]).clamp_(-7, 7)
    nibbles = (torch.nan_to_num(codes, nan=0.0) + 8).to(torch.uint8).view(-1)[:numel]
    if numel % 2:
        nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8)])
    pairs = nibbles.view(-1, 2)
    packed = pairs[:, 0] | (pairs[:, 1] << 4)
    return scale.numpy().astype("<f4", copy=False).tobytes() + packed.numpy().tobytes()


def decode_int4(data: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
    """Inverse of `encode_int4`. Raises WireError on a bad length or a nibble outside 1..15."""
    if len(data) != int4_size(numel):
        raise WireError(f"int4 chunk of {numel} elements: expected {int4_size(numel)} bytes")
    blocks = math.ceil(numel / INT4_BLOCK)
    scale = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=blocks).astype(np.float32))
    packed = np.frombuffer(data, dtype=np.uint8, offset=4 * blocks)
    nibbles = np.empty(2 * packed.size, dtype=np.uint8)
    nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
    nibbles = nibbles[:numel]
    if (nibbles == 0).any():
        raise WireError("int4 code out of range (nibble 0)")
    padded = torch.zeros(blocks * INT4_BLOCK, dtype=torch.float32)
    padded[:numel] = torch.from_numpy(nibbles.astype(np.float32) - 8.0)
    return (padded.view(blocks, INT4_BLOCK) * scale[:, None]).view(-1)[:numel].contiguous()


# ----------------------------------------------------------------------------- top-k + 2 bit


def check_density(density: float) -> None:
    if not (isinstance(density, (int, float)) and not isinstance(density, bool) and 0 < density <= 1):
        raise ValueError(f"top-k density must be in (0, 1], got {density!r}")


def _levels(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of magnitudes: two levels and which values take the upper one, by `LLOYD_STEPS` of
    Lloyd's algorithm from the (lower) median split; a row all in one group gets its mean twice."""
    split = a.median(dim=1).values
    for _ in range(LLOYD_STEPS):
        upper = a >= split[:, None]
        n_up = upper.sum(dim=1)
        hi = torch.where(upper, a, 0.0).sum(dim=1) / n_up.clamp(min=1)
        lo = torch.where(upper, 0.0, a).sum(dim=1) / (a.shape[1] - n_up).clamp(min=1)
        lo = torch.where(n_up == a.shape[1], hi, lo)
        split = (lo + hi) / 2
    return lo, hi, a >= split[:, None]


def _select(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: ascending offsets of the k largest magnitudes, the two levels, and 2-bit codes."""
    idx = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    v = rows.gather(1, idx)
    lo, hi, upper = _levels(v.abs())
    codes = (v < 0).to(torch.uint8) * 2 + upper.to(torch.uint8)  # bit 1: sign, bit 0: upper level
    return idx, lo, hi, codes


def _as_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Each value's `width` low bits, least significant first: shape (values, width), 0/1."""
    return ((values.reshape(-1, 1) >> np.arange(width)) & 1).astype(np.uint8)


def _from_bits(bits: np.ndarray) -> np.ndarray:
    """Inverse of `_as_bits`."""
    return (bits.astype(np.int64) << np.arange(bits.shape[1])).sum(axis=1)


def encode_topk(x: torch.Tensor, density: float) -> bytes:
    """Chunked top-k with 2-bit values of a flat float32 tensor (docs/protocol/wire.md)."""
    x = x.detach().reshape(-1).to(torch.float32)
    block_levels, vectors, values, start = [], [], [], 0
    for count, m, k in topk_groups(x.numel(), density):
        idx, lo, hi, codes = _select(x[start : start + count * m].view(count, m), k)
        start += count * m
        idx, low = idx.numpy().astype(np.int64), topk_low_bits(m, k)
        vector = np.zeros((count, topk_bits(m, k)[0]), dtype=np.uint8)
        np.put_along_axis(vector, (idx >> low) + np.arange(k), 1, axis=1)  # the i-th one at high(i) + i
        block_levels.append(torch.stack([lo, hi], dim=1).view(-1))
        vectors.append(vector.reshape(-1))
        values.append(np.concatenate([_as_bits(idx & ((1 << low) - 1), low),
                                      _as_bits(codes.numpy().astype(np.int64), 2)], axis=1).reshape(-1))
    if not block_levels:
        return b""
    bits = np.packbits(np.concatenate(vectors + values), bitorder="little")
    return torch.cat(block_levels).numpy().astype("<f4", copy=False).tobytes() + bits.tobytes()


def decode_topk(data: bytes | bytearray | memoryview, numel: int, density: float) -> torch.Tensor:
    """Inverse of `encode_topk`: a dense float32 tensor, zero where nothing was kept. Raises
    WireError on a bad length, a block's bit vector not holding exactly its k offsets, or offsets
    out of range or not strictly ascending within a block."""
    size = topk_size(numel, density)
    if len(data) != size:
        raise WireError(f"topk2 chunk of {numel} elements at density {density}: expected {size} bytes")
    groups = topk_groups(numel, density)
    out = torch.zeros(numel, dtype=torch.float32)
    if not groups:
        return out
    blocks = sum(c for c, _, _ in groups)
    block_levels = np.frombuffer(data, dtype="<f4", count=2 * blocks).astype(np.float32).reshape(blocks, 2)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8, offset=8 * blocks), bitorder="little")
    at_vector, at_value = 0, sum(c * topk_bits(m, k)[0] for c, m, k in groups)  # the values follow every bit vector
    block = start = 0
    for count, m, k in groups:
        width, rest = topk_bits(m, k)
        vectors = bits[at_vector : at_vector + count * width].reshape(count, width)
        pairs = bits[at_value : at_value + count * rest].reshape(count * k, rest // k)
        at_vector, at_value = at_vector + count * width, at_value + count * rest
        if (vectors.sum(axis=1) != k).any():
            raise WireError(f"topk2 offsets: a block's bit vector does not hold exactly its {k} offsets")
        low = topk_low_bits(m, k)
        high = np.nonzero(vectors)[1].reshape(count, k) - np.arange(k)
        idx = (high << low) | _from_bits(pairs[:, :low]).reshape(count, k)
        if (idx >= m).any() or (np.diff(idx, axis=1) <= 0).any():
            raise WireError("topk2 offsets out of range or not strictly ascending within a block")
        codes = _from_bits(pairs[:, low:])
        levels = torch.from_numpy(np.repeat(block_levels[block : block + count], k, axis=0))  # (lower, upper) per value
        magnitude = levels.gather(1, torch.from_numpy(codes & 1).view(-1, 1)).view(-1)  # non-finite: the receiver rejects it
        signed = torch.where(torch.from_numpy(codes & 2 > 0), -magnitude, magnitude)
        out[torch.from_numpy(start + (np.arange(count)[:, None] * m + idx).reshape(-1))] = signed
        block, start = block + count, start + count * m
    return out


# ----------------------------------------------------------------------------- whole sparse vectors


def encode_chunks(x: torch.Tensor, chunk: int, density: float) -> list[bytes]:
    """A sparse contribution: `x` top-k encoded chunk by chunk (one frame each)."""
    return [encode_topk(x[a:b], density) for a, b in _ranges(x.numel(), chunk)]


def decode_chunks(frames: list[bytes], n: int, chunk: int, density: float) -> torch.Tensor:
    """A sparse contribution as every member decodes it (what its sender's error feedback subtracts)."""
    out = torch.empty(n, dtype=torch.float32)
    for (a, b), data in zip(_ranges(n, chunk), frames, strict=True):
        out[a:b] = decode_topk(data, b - a, density)
    return out


def sparse_mean(contribs: list[tuple[float, list[bytes]]], n: int, chunk: int, density: float) -> torch.Tensor:
    """Weighted mean of complete sparse contributions (weight, frames), in the given order: fp32,
    weight·value as a multiply then an add (no fused multiply-add, whose rounding differs between
    CPUs), one divide by the total weight. The same bytes in the same order give the same bits."""
    acc, total = torch.zeros(n, dtype=torch.float32), 0.0
    for weight, frames in contribs:
        total += weight
        for (a, b), data in zip(_ranges(n, chunk), frames, strict=True):
            acc[a:b] += decode_topk(data, b - a, density) * weight
    return acc.div_(total) if contribs else acc
