"""The pseudo-gradient codecs, declared once: name, sparse or not, exact frame size.

The config's choices (`sync.compression`), the planner's byte counts (`diloco_p2p.planner.plan`)
and the wire (`diloco_p2p.swarm.collective.wire` and `codecs`, which encode and decode) all read
`CODECS`, so a codec added or changed here reaches all three. Each declares what the others need
without encoding anything: whether it is sparse (an all-gather of contributions, not a
reduce-scatter), open to error feedback, exact on re-encoding (the grid re-encodes a column's
result in it), and its exact size for a frame of n values: pure arithmetic, so the config and the
planner import no torch, and a receiver knows each frame's length from its header. The top-k
layout's block and Elias-Fano split are here because the size is a function of them;
`tests/unit/test_codecs.py` checks every size against what the encoders write.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

INT8_BLOCK = 1024  # values per float32 scale of int8
INT4_BLOCK = 64  # values per float32 scale of int4
TOPK_BLOCK = 65536  # topk2 chooses its values per block of one frame (`swarm.collective.codecs`)
_LARGE = 1 << 24  # a frame size every block divides: what "per value" is measured on


@dataclass(frozen=True)
class Codec:
    """One wire format. `size(numel, density)` is the exact bytes of a frame of `numel` values
    (`density` is top-k's share of values kept; dense codecs ignore it)."""

    name: str
    sparse: bool  # an all-gather of every member's contribution (`allgather`), not the butterfly
    feedback: bool  # error feedback may carry what it drops (`sync.error_feedback`; fp16 rounds too little)
    exact_reencode: bool  # decode(encode(y)) == y for every y decoded from this format
    size: Callable[[int, float], int]

    def bytes_per_value(self, density: float = 1.0) -> float:
        """Bytes per value of a large frame: what the all-reduce's 2(k-1)/k lower bound is counted in."""
        return self.size(_LARGE, density) / _LARGE


def int8_size(numel: int) -> int:
    """A float32 scale per `INT8_BLOCK` values, then one byte per value."""
    return 4 * math.ceil(numel / INT8_BLOCK) + numel


def int4_size(numel: int) -> int:
    """A float32 scale per `INT4_BLOCK` values, then two 4-bit codes per byte."""
    return 4 * math.ceil(numel / INT4_BLOCK) + (numel + 1) // 2


# ----------------------------------------------------------------------------- topk2's layout


def topk_kept(m: int, density: float) -> int:
    """Values kept of a block of m elements."""
    return min(m, max(1, math.ceil(density * m)))


def topk_low_bits(m: int, k: int) -> int:
    """Elias-Fano's split of an offset in a block of m elements with k kept: the low
    floor(log2(m/k)) bits go as they are (none when at least every other value is kept)."""
    return max(0, (m // k).bit_length() - 1)


def topk_groups(numel: int, density: float) -> list[tuple[int, int, int]]:
    """(count, size m, kept k) of the blocks of a frame of `numel` elements: the full ones, then the tail."""
    full, tail = divmod(numel, TOPK_BLOCK)
    groups = [(full, TOPK_BLOCK, topk_kept(TOPK_BLOCK, density))] if full else []
    return groups + ([(1, tail, topk_kept(tail, density))] if tail else [])


def topk_bits(m: int, k: int) -> tuple[int, int]:
    """Bits of one block's high-part bit vector, and of its kept values' low bits and 2-bit codes."""
    low = topk_low_bits(m, k)
    return k + ((m - 1) >> low) + 1, k * (low + 2)


def topk_size(numel: int, density: float) -> int:
    """Two float32 levels per block, then the bit stream of every block's vector and values."""
    groups = topk_groups(numel, density)
    bits = sum(c * sum(topk_bits(m, k)) for c, m, k in groups)
    return 8 * sum(c for c, _, _ in groups) + (bits + 7) // 8


# Dense ones first, by bytes per value (most first): `recommend` tries them in this order.
CODECS: dict[str, Codec] = {c.name: c for c in (
    Codec("fp32", sparse=False, feedback=False, exact_reencode=True, size=lambda n, d=1.0: 4 * n),
    Codec("fp16", sparse=False, feedback=False, exact_reencode=True, size=lambda n, d=1.0: 2 * n),
    Codec("int8", sparse=False, feedback=True, exact_reencode=False, size=lambda n, d=1.0: int8_size(n)),
    Codec("int4", sparse=False, feedback=True, exact_reencode=False, size=lambda n, d=1.0: int4_size(n)),
    Codec("topk2", sparse=True, feedback=True, exact_reencode=False, size=topk_size),
)}
NAMES = tuple(CODECS)
DENSE = tuple(name for name, c in CODECS.items() if not c.sparse)
SPARSE = tuple(name for name, c in CODECS.items() if c.sparse)


def codec(name: str) -> Codec:
    """The codec called `name`; ValueError naming the choices otherwise."""
    if name not in CODECS:
        raise ValueError(f"unknown compression {name!r}; expected one of {', '.join(NAMES)}")
    return CODECS[name]
