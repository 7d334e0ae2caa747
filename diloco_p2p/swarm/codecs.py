"""Lossy codecs for pseudo-gradients beyond int8: blockwise 4-bit and sparse top-k with 2-bit
values. Pure functions of tensors and bytes, like `wire` (which dispatches ``int4`` here); the
protocol that moves them is `allreduce` (``int4``, a dense reduce-scatter) and `allgather`
(``topk2``, sparse). What a node did not send is carried to its next round by
`diloco_p2p.feedback` (error feedback).

``int4`` (dense): per-block absmax scaling as ``int8`` (blocks of `INT4_BLOCK` elements, one
float32 scale = absmax/7 per block), codes -7..7 stored as the nibble ``code + 8`` (1..15; 0 is
refused), two per byte, the even element in the low nibble. Error per element
<= absmax(block)/14. 0.5 bytes per element plus 4 bytes per 64 elements (0.5625 in all, 3.6x
fewer than fp16). Blockwise absmax as in Dettmers et al. 2022 (8-bit optimizers / LLM.int8) and
the 4-bit outer gradients of Streaming DiLoCo (Douillard et al. 2025).

``topk2`` (sparse): the chunked top-k of SparseLoCo (Sarfi et al. 2025, "SparseLoCo:
Communication-efficient LLM training", used for Covenant-72B): the vector is cut into blocks of
`TOPK_BLOCK` elements and each block keeps its ``ceil(density * m)`` largest values by
magnitude; each kept value is sent as 2 bits (sign, and which of two magnitude levels) with a
per-block pair (lo, hi) = (smallest, largest kept magnitude): the levels are
``lo + (hi - lo)/4`` and ``lo + 3(hi - lo)/4``, so the error per kept value is <= (hi - lo)/4
and every value not kept is dropped (error = the value). The error feedback of the sender
(`diloco_p2p.feedback`) sends what was dropped in later rounds, as in SparseLoCo and Deep
Gradient Compression (Lin et al. 2018). Layout of one chunk (a frame): float32 lo, hi per
block; then uint16 offsets of the kept values within their block, ascending; then the 2-bit
codes, four per byte, the first in the low bits. With blocks of 4096 and density d, a block
costs 8 bytes + 2.25 bytes per kept value: 0.0245 bytes per element at d = 1% (82x fewer than
fp16). The size is a function of (numel, density) alone, so a receiver knows each frame's
exact length from the header, and `decode_topk` refuses offsets out of range or not strictly
ascending (a repeated offset would make the scatter order matter).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from diloco_p2p.swarm.streams import WireError

INT4_BLOCK = 64
TOPK_BLOCK = 4096  # offsets fit uint16; SparseLoCo's chunked top-k works on blocks of this order


def _ranges(numel: int, chunk: int) -> list[tuple[int, int]]:
    """`wire.chunk_ranges` (repeated: wire imports this module)."""
    return [(a, min(a + chunk, numel)) for a in range(0, numel, chunk)]


# ----------------------------------------------------------------------------- int4


def int4_size(numel: int) -> int:
    """Exact bytes of `encode_int4` for `numel` elements."""
    return 4 * math.ceil(numel / INT4_BLOCK) + (numel + 1) // 2


def encode_int4(x: torch.Tensor) -> bytes:
    """Blockwise absmax 4-bit codes of a flat float32 tensor (see the module docstring)."""
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


def _kept(m: int, density: float) -> int:
    """Values kept of a block of m elements."""
    return min(m, max(1, math.ceil(density * m)))


def _blocks(numel: int, density: float) -> list[tuple[int, int]]:
    """(size, kept) of each block of a chunk of `numel` elements."""
    full, tail = divmod(numel, TOPK_BLOCK)
    sizes = [TOPK_BLOCK] * full + ([tail] if tail else [])
    return [(m, _kept(m, density)) for m in sizes]


def topk_size(numel: int, density: float) -> int:
    """Exact bytes of `encode_topk` for `numel` elements at `density`."""
    blocks = _blocks(numel, density)
    kept = sum(k for _, k in blocks)
    return 8 * len(blocks) + 2 * kept + (kept + 3) // 4


def _select(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: ascending offsets of the k largest magnitudes, lo, hi, and 2-bit codes."""
    idx = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    v = rows.gather(1, idx)
    a = v.abs()
    lo, hi = a.amin(dim=1), a.amax(dim=1)
    upper = a >= ((lo + hi) / 2)[:, None]
    codes = (v < 0).to(torch.uint8) * 2 + upper.to(torch.uint8)  # bit 1: sign, bit 0: upper level
    return idx, lo, hi, codes


def encode_topk(x: torch.Tensor, density: float) -> bytes:
    """Chunked top-k with 2-bit values of a flat float32 tensor (see the module docstring)."""
    x = x.detach().reshape(-1).to(torch.float32)
    numel = x.numel()
    full = numel // TOPK_BLOCK
    parts = []
    if full:
        parts.append(_select(x[: full * TOPK_BLOCK].view(full, TOPK_BLOCK), _kept(TOPK_BLOCK, density)))
    if numel % TOPK_BLOCK:
        tail = x[full * TOPK_BLOCK :].view(1, -1)
        parts.append(_select(tail, _kept(tail.shape[1], density)))
    if not parts:
        return b""
    lohi = torch.cat([torch.stack([lo, hi], dim=1).view(-1) for _, lo, hi, _ in parts])
    idx = torch.cat([i.reshape(-1) for i, *_ in parts]).to(torch.int32).numpy().astype("<u2")
    codes = torch.cat([c.reshape(-1) for *_, c in parts]).numpy()
    codes = np.concatenate([codes, np.zeros(-codes.size % 4, dtype=np.uint8)]).reshape(-1, 4)
    packed = codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)
    return lohi.numpy().astype("<f4", copy=False).tobytes() + idx.tobytes() + packed.astype(np.uint8).tobytes()


def decode_topk(data: bytes | bytearray | memoryview, numel: int, density: float) -> torch.Tensor:
    """Inverse of `encode_topk`: a dense float32 tensor, zero where nothing was kept. Raises
    WireError on a bad length or offsets out of range or not strictly ascending in a block."""
    size = topk_size(numel, density)
    if len(data) != size:
        raise WireError(f"topk2 chunk of {numel} elements at density {density}: expected {size} bytes")
    blocks = _blocks(numel, density)
    out = torch.zeros(numel, dtype=torch.float32)
    if not blocks:
        return out
    nb, kept = len(blocks), sum(k for _, k in blocks)
    lohi = np.frombuffer(data, dtype="<f4", count=2 * nb).astype(np.float32).reshape(nb, 2)
    idx = np.frombuffer(data, dtype="<u2", count=kept, offset=8 * nb).astype(np.int64)
    packed = np.frombuffer(data, dtype=np.uint8, offset=8 * nb + 2 * kept)
    codes = np.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)[:kept]
    sizes = np.repeat([m for m, _ in blocks], [k for _, k in blocks])
    block_of = np.repeat(np.arange(nb), [k for _, k in blocks])
    first = np.zeros(kept, dtype=bool)  # the first kept value of each block
    first[np.cumsum([0] + [k for _, k in blocks])[:-1]] = True
    ascending = np.ones(kept, dtype=bool)
    ascending[1:] = idx[1:] > idx[:-1]
    if (idx >= sizes).any() or not (ascending | first).all():
        raise WireError("topk2 offsets out of range or not strictly ascending within a block")
    lo = torch.from_numpy(lohi[block_of, 0])
    width = torch.from_numpy(lohi[block_of, 1]) - lo
    level = torch.from_numpy(np.where(codes & 1, 0.75, 0.25).astype(np.float32))
    magnitude = lo + width * level  # a non-finite lo/hi makes the values non-finite: the receiver rejects them
    values = torch.where(torch.from_numpy(codes & 2 > 0), -magnitude, magnitude)
    out[torch.from_numpy(block_of * TOPK_BLOCK + idx)] = values
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
