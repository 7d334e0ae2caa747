"""Wire format of the pseudo-gradient all-reduce: partition, compression, framing, checks.

Pure functions of bytes and tensors (no sockets, no event loop), so the precision and
validation rules are unit-tested on their own: the partition of a vector among members, the
dense codecs (``fp32``, ``fp16``, ``int8`` with per-block absmax; ``int4`` in `codecs`) applied
chunk by chunk so a part streams in bounded memory, the JSON headers, the norm frame and
trailer, the reduce of a chunk, and the checks a receiver applies at the boundary. The protocol
that moves these bytes is `allreduce`. The formats: docs/protocol/wire.md
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from diloco_p2p.config import compression as compression_codecs
from diloco_p2p.config.tree import ALLREDUCE_PROTOCOL
from diloco_p2p.swarm.collective import codecs
from diloco_p2p.swarm.transport.streams import WireError, dump_json, load_json

# The codecs are declared in `diloco_p2p.config.compression` (names, sizes, which are sparse).
COMPRESSIONS = compression_codecs.DENSE  # dense: reduce-scatter + all-gather
SPARSE = compression_codecs.SPARSE  # sparse: an all-gather of every member's contribution (`allgather`)
INT8_BLOCK = compression_codecs.INT8_BLOCK
DEFAULT_CHUNK_ELEMENTS = 1 << 16  # 256 KiB of fp32, 128 KiB of fp16, ~64 KiB of int8 per frame: the pipeline's step
MAX_CHUNK_ELEMENTS = 1 << 24
MAX_HEADER_BYTES = 1 << 16
# 2: pipelined gather (stream flag, trailer frame); 3: a scatter's norm as its last frame; 4: "opposed";
# 5: a gather's quoted samples (`samples`) and a mask's "misquoted". In the swarm view: see config.tree
PROTOCOL_VERSION = ALLREDUCE_PROTOCOL
TRAILER_OK, TRAILER_VOID = b"\x01", b"\x00"  # the last frame of a streamed gather
NORM_FRAME_BYTES = 8  # the last frame of a scatter: the sender's norm of the part, float64 (NaN: none stated)
REJECT_REASONS = ("nan", "shape", "weight", "timeout", "compression", "group", "norm", "opposed")
KINDS = ("scatter", "gather", "mask", "ping", "contrib")


# ----------------------------------------------------------------------------- partitioning


def partition(n: int, k: int) -> list[tuple[int, int]]:
    """Split range(n) into k contiguous parts whose sizes differ by at most one (larger first)."""
    if k < 1 or n < 0:
        raise ValueError(f"cannot partition {n} elements into {k} parts")
    base, extra = divmod(n, k)
    bounds, start = [], 0
    for j in range(k):
        end = start + base + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def partition_among(n: int, reducers: Sequence[bool]) -> list[tuple[int, int]]:
    """Like `partition(n, sum(reducers))`, but only members flagged True get a part (the others,
    behind NAT, an empty ``(lo, lo)``); a pure function of (n, flags), the same on every member."""
    parts = iter(partition(n, sum(bool(r) for r in reducers)))  # no reducer at all: ValueError
    bounds, end = [], 0
    for r in reducers:
        if r:
            bounds.append(next(parts))
            end = bounds[-1][1]
        else:
            bounds.append((end, end))
    return bounds


def chunk_ranges(numel: int, chunk_elements: int) -> list[tuple[int, int]]:
    """Offsets (relative to the part) of the chunks a part of `numel` elements is streamed in."""
    return [(a, min(a + chunk_elements, numel)) for a in range(0, numel, chunk_elements)]


# ----------------------------------------------------------------------------- compression


def _check_compression(compression: str) -> None:
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}; expected one of {COMPRESSIONS}")


def encoded_size(numel: int, compression: str) -> int:
    """Exact number of bytes `encode` produces for `numel` elements."""
    _check_compression(compression)
    return compression_codecs.CODECS[compression].size(numel, 1.0)


def bytes_per_element(compression: str) -> float:
    """Wire bytes per element for large vectors (what the 2(k-1)/k lower bound is measured in)."""
    _check_compression(compression)
    return compression_codecs.CODECS[compression].bytes_per_value()


def encode(x: torch.Tensor, compression: str) -> bytes:
    """Compress a 1-D float32 CPU tensor (one chunk) into bytes."""
    _check_compression(compression)
    x = x.detach().reshape(-1).to(torch.float32)
    if compression == "fp32":
        return x.numpy().astype("<f4", copy=False).tobytes()
    if compression == "fp16":
        return x.to(torch.float16).numpy().astype("<f2", copy=False).tobytes()
    if compression == "int4":
        return codecs.encode_int4(x)
    return _int8_bytes(*_int8_blocks(x), x.numel())


def _int8_bytes(scale: torch.Tensor, codes: torch.Tensor, numel: int) -> bytes:
    codes = codes.to(torch.int8).view(-1)[:numel]
    return scale.numpy().astype("<f4", copy=False).tobytes() + codes.numpy().tobytes()


def _int8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8's quantization of a flat float32 tensor, per block of `INT8_BLOCK` values (the last one
    zero-padded): each block's scale (absmax / 127) and its codes (as float32, NaN coded 0)."""
    numel = x.numel()
    blocks = math.ceil(numel / INT8_BLOCK)
    if numel == blocks * INT8_BLOCK:  # whole blocks (every chunk but a vector's last): no padded copy
        padded = x.reshape(blocks, INT8_BLOCK)
    else:
        padded = torch.zeros(blocks * INT8_BLOCK, dtype=torch.float32)
        padded[:numel] = x
        padded = padded.view(blocks, INT8_BLOCK)
    absmax = torch.maximum(padded.amax(dim=1), padded.amin(dim=1).neg_())  # no |x| copy; NaN propagates
    scale = absmax / 127.0  # NaN/inf propagate into the scale: caught on decode
    inverse = torch.where(absmax > 0, 127.0 / absmax, 0.0)
    if math.isfinite(float(scale.sum())) and math.isfinite(float(inverse.sum())):
        # x · (127 / absmax) is at most 127 · (1 + 2^-23): it rounds to 127, no clamp needed
        return scale, torch.mul(padded, inverse[:, None]).round_()
    # a block with NaN/inf, or values so small (< 4e-37) that 127 / absmax overflows: by the division.
    # Every other block as above: a block's codes never depend on its chunk (`samples.sent` re-encodes one)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    fast = (torch.isfinite(inverse) & torch.isfinite(scale))[:, None]
    codes = torch.where(fast, padded * torch.where(fast[:, 0], inverse, 0.0)[:, None], padded / safe[:, None])
    return scale, codes.round_().clamp_(-127, 127).nan_to_num_(nan=0.0)


def encode_sumsq(x: torch.Tensor, compression: str) -> tuple[bytes, float]:
    """`encode(x)` and `decoded_sumsq(x)` of one chunk; int8 quantizes its blocks once for both.
    What a sender states as its norm is summed from these, chunk by chunk as its scatter stream
    leaves (the receiver sums the same from what it decodes)."""
    x = x.detach().reshape(-1).to(torch.float32)
    if compression != "int8":
        return encode(x, compression), decoded_sumsq(x, compression)
    scale, codes = _int8_blocks(x)
    data = _int8_bytes(scale, codes, x.numel())  # before the sum of squares squares the codes in place
    return data, _int8_sumsq(scale, codes)


def _int8_sumsq(scale: torch.Tensor, codes: torch.Tensor) -> float:
    per_block = codes.mul_(codes).sum(dim=1).double()  # integers below 2^24: exact in float32
    return float(scale.double().square_().mul_(per_block).sum())


def pack_norm(norm: float | None) -> bytes:
    """A scatter's last frame: the norm its sender states for the part (None: not finite, none stated)."""
    return struct.pack("<d", math.nan if norm is None else norm)


def unpack_norm(data: bytes) -> float | None:
    """The norm in a scatter's last frame; None when it states none. WireError when it is no norm."""
    if len(data) != NORM_FRAME_BYTES:
        raise WireError(f"a scatter's norm frame has {NORM_FRAME_BYTES} bytes, got {len(data)}")
    (norm,) = struct.unpack("<d", data)
    if math.isnan(norm):
        return None
    if not _is_norm(norm):
        raise WireError(f"a stated norm must be a finite number >= 0, got {norm}")
    return norm


SUMSQ_SLICE = 1 << 16  # values per fp64 norm in `sumsq`: its temporaries stay in cache
FAST_SUMSQ_RANGE = (1e-25, 1e37)  # a float32 dot inside this range neither overflowed nor lost underflowed terms


def sumsq(values: torch.Tensor, *, exact: bool = True) -> float:
    """Sum of squares in fp64, a slice at a time; ``exact=False`` (a norm checked within
    `aggregate.NORM_TOLERANCE`) takes each slice's float32 dot, summing exactly any slice outside
    `FAST_SUMSQ_RANGE`."""
    flat, (low, high) = values.detach().reshape(-1), FAST_SUMSQ_RANGE
    total = 0.0
    for a in range(0, flat.numel(), SUMSQ_SLICE):
        x = flat[a : a + SUMSQ_SLICE]
        fast = math.nan if exact or x.dtype != torch.float32 else float(torch.dot(x, x))
        total += fast if low <= fast <= high else float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2
    return total


def decoded_sumsq(x: torch.Tensor, compression: str) -> float:
    """Sum of squares of `decode(encode(x))` for one float32 chunk, without the bytes where the
    format allows (fp32, fp16 rounded; int8 as scale² · Σ code²); non-finite if a value is."""
    if compression in ("fp32", "fp16"):
        values = x.to(torch.float16).float() if compression == "fp16" else x.to(torch.float32)
        return sumsq(values, exact=False)
    if compression == "int8":
        return _int8_sumsq(*_int8_blocks(x.to(torch.float32)))
    return float(decode(encode(x, compression), x.numel(), compression).double().square().sum())


def decode(data: bytes | bytearray | memoryview, numel: int, compression: str) -> torch.Tensor:
    """Inverse of `encode`: a new float32 tensor of `numel` elements. Raises WireError on a bad length."""
    if len(data) != encoded_size(numel, compression):
        raise WireError(
            f"{compression} chunk of {numel} elements: expected {encoded_size(numel, compression)} bytes"
        )
    if compression == "fp32":
        return torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))
    if compression == "fp16":  # torch widens fp16 about 9x faster than numpy's astype (exact either way)
        return torch.from_numpy(np.frombuffer(data, dtype="<f2").copy()).float()
    if compression == "int4":
        return codecs.decode_int4(data, numel)
    blocks = math.ceil(numel / INT8_BLOCK)
    scale = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=blocks).astype(np.float32))
    codes = torch.from_numpy(np.frombuffer(data, dtype=np.int8, offset=4 * blocks).astype(np.float32))
    # a non-finite scale makes its whole block non-finite (0 * inf = nan), which the receiver rejects
    if numel == blocks * INT8_BLOCK:  # whole blocks: scale the decoded codes in place
        return codes.view(blocks, INT8_BLOCK).mul_(scale[:, None]).view(-1)
    padded = torch.zeros(blocks * INT8_BLOCK, dtype=torch.float32)
    padded[:numel] = codes
    return (padded.view(blocks, INT8_BLOCK) * scale[:, None]).view(-1)[:numel].contiguous()


def roundtrip(x: torch.Tensor, compression: str, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS):
    """What a receiver sees after `x` went through the wire (chunked exactly as the protocol does)."""
    out = torch.empty(x.numel(), dtype=torch.float32)
    for a, b in chunk_ranges(x.numel(), chunk_elements):
        out[a:b] = decode(encode(x[a:b], compression), b - a, compression)
    return out


# ----------------------------------------------------------------------------- validation


def is_finite(x: torch.Tensor) -> bool:
    """Whether every value of a CPU tensor is finite: one vectorized sum answers (NaN and inf survive
    any sum, 15x faster than torch's check); only a sum that overflowed is checked value by value."""
    x = x.detach()
    return math.isfinite(float(x.sum())) or bool(np.isfinite(x.numpy()).all())


def lower_median(values: Sequence[float]) -> float:
    """The lower median: with two values it is the smaller one, so one inflated weight cannot set it."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def weight_problem(weight: Any, reference: float | None, max_ratio: float) -> str | None:
    """None if `weight` is a finite number > 0 and at most `max_ratio` × `reference` (the lower
    median of the part's weights), else the rejection reason ("weight")."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        return "weight"
    if not math.isfinite(weight) or weight <= 0:
        return "weight"
    if reference is not None and weight > max_ratio * reference:
        return "weight"
    return None


def peers_digest(peer_ids: Sequence[str]) -> str:
    """Short digest of the ordered member list: messages from a peer with another view are dropped."""
    return hashlib.sha256("\n".join(peer_ids).encode()).hexdigest()[:16]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_norm(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0


def _check_part_lists(h: dict[str, Any], k: int) -> None:
    """A mask's optional per-part lists (`diloco_p2p.swarm.collective.aggregate`): the sha256 of each part
    gathered ("part_digests", None where not held) and our contribution's norm ("norms")."""
    digests, norms, relayed = h.get("part_digests"), h.get("norms"), h.get("relayed_norms")
    # A public member relays the private members' norms it heard ("relayed_norms": member index ->
    # its norms), so that private members, who cannot hear each other, run the same norm check.
    if relayed is not None and not (
        isinstance(relayed, dict) and len(relayed) <= k
        and all(isinstance(j, str) and j.isdigit() and int(j) < k and isinstance(v, list) and len(v) == k
                and all(n is None or _is_norm(n) for n in v) for j, v in relayed.items())
    ):
        raise WireError("relayed_norms must map member indexes to one norm (or null) per part")
    if digests is not None and not (
        isinstance(digests, list) and len(digests) == k
        and all(d is None or (isinstance(d, str) and len(d) == 32) for d in digests)
    ):
        raise WireError("part_digests must list one 32-digit hex digest (or null) per part")
    if norms is not None and not (
        isinstance(norms, list) and len(norms) == k and all(n is None or _is_norm(n) for n in norms)
    ):
        raise WireError("norms must list one finite number >= 0 (or null) per part")
    misquoted = h.get("misquoted", [])  # parts whose reducer quoted our contribution otherwise (`samples`)
    if not (isinstance(misquoted, list) and len(misquoted) <= k and all(_is_int(p) and 0 <= p < k for p in misquoted)):
        raise WireError("misquoted must list part indexes")


def pack_header(header: dict[str, Any]) -> bytes:
    data = dump_json(header, version=PROTOCOL_VERSION)
    if len(data) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    return data


def parse_header(raw: bytes) -> dict[str, Any]:
    """Decode and type-check a message header (types and ranges; the session checks the values
    against its view). Raises WireError on anything malformed."""
    h = load_json(raw, version=PROTOCOL_VERSION)
    kind = h.get("kind")
    if kind not in KINDS:
        raise WireError(f"unknown message kind {kind!r}")
    group, digest = h.get("group"), h.get("digest")
    if not (
        isinstance(group, str) and 0 < len(group) <= 512 and isinstance(digest, str) and len(digest) <= 64
    ):
        raise WireError("bad group or digest")
    if kind == "ping":
        return h
    if kind == "mask":
        mask = h.get("mask")
        if not isinstance(mask, list) or not all(_is_int(m) and m in (0, 1) for m in mask):
            raise WireError("mask must be a list of 0/1")
        _check_part_lists(h, len(mask))
        digests = h.get("contrib_digests", [])  # sparse all-gather (`allgather`): each contribution held, or ""
        if not (isinstance(digests, list) and len(digests) in (0, len(mask))
                and all(isinstance(d, str) and len(d) <= 64 for d in digests)):
            raise WireError("contrib_digests must list one short digest (or \"\") per member")
        return h
    if kind == "contrib":
        return _check_contrib(h)
    for key in ("part", "n", "numel", "chunk"):
        if not _is_int(h.get(key)) or h[key] < 0:
            raise WireError(f"{key} must be a non-negative integer")
    if not 0 < h["chunk"] <= MAX_CHUNK_ELEMENTS:
        raise WireError("chunk size out of range")
    if h.get("comp") not in COMPRESSIONS:
        raise WireError("unknown compression")
    if kind == "scatter":
        if isinstance(h.get("weight"), bool) or not isinstance(h.get("weight"), (int, float)):
            raise WireError("weight must be a number")
        if not isinstance(h.get("finite"), bool):
            raise WireError("finite must be a boolean")
        return h
    contributors, rejected = h.get("contributors"), h.get("rejected")
    if not (
        isinstance(h.get("empty"), bool)
        and isinstance(h.get("stream"), bool)
        and isinstance(contributors, list)
        and isinstance(rejected, dict)
        and isinstance(h.get("samples", False), bool)
    ):
        raise WireError("gather header needs empty, stream, contributors, rejected (and a boolean samples)")
    if not all(_is_int(c) and c >= 0 for c in contributors):
        raise WireError("contributors must be member indices")
    if not all(isinstance(p, str) and p.isdigit() and r in REJECT_REASONS for p, r in rejected.items()):
        raise WireError("rejected must map member indices to known reasons")
    return h


def _check_contrib(h: dict[str, Any]) -> dict[str, Any]:
    """A sparse contribution's header (`allgather`): the sender's whole vector, chunked."""
    for key in ("n", "chunk"):
        if not _is_int(h.get(key)) or h[key] < 0:
            raise WireError(f"{key} must be a non-negative integer")
    if not 0 < h["chunk"] <= MAX_CHUNK_ELEMENTS:
        raise WireError("chunk size out of range")
    if h.get("comp") not in SPARSE:
        raise WireError("unknown compression")
    density = h.get("density")
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise WireError("density must be a number in (0, 1]")
    if isinstance(h.get("weight"), bool) or not isinstance(h.get("weight"), (int, float)):
        raise WireError("weight must be a number")
    if not isinstance(h.get("finite"), bool):
        raise WireError("finite must be a boolean")
    return h


# ----------------------------------------------------------------------------- reduction


def accept_weights(weights: dict[int, float], max_ratio: float) -> tuple[list[int], list[int]]:
    """(accepted, rejected for weight) members, each sorted: a weight above `max_ratio` times the
    lower median of the weights offered for the part is refused (docs/protocol/allreduce.md)."""
    if not weights:
        return [], []
    reference = lower_median(list(weights.values()))
    accepted = [j for j in sorted(weights) if weight_problem(weights[j], reference, max_ratio) is None]
    return accepted, [j for j in sorted(weights) if j not in accepted]


def reduce_chunk(
    contribs: Sequence[tuple[float, bytes]], numel: int, compression: str
) -> tuple[bytes, torch.Tensor] | None:
    """Weighted mean of one chunk, (weight, encoded chunk) in member order -> (encoded, decoded), or
    None when not finite: fp32 sums in order then one divide, so chunk by chunk equals whole."""
    acc, total = torch.zeros(numel, dtype=torch.float32), 0.0
    for weight, data in contribs:
        total += weight
        acc.add_(decode(data, numel, compression), alpha=weight)
    acc.div_(total)
    encoded = encode(acc, compression)
    values = decode(encoded, numel, compression)
    return (encoded, values) if is_finite(values) else None


def reduce_part(
    contribs: dict[int, tuple[float, list[bytes]]], max_ratio: float, numel: int, chunk: int, compression: str
) -> tuple[list[int], list[int], list[bytes] | None, torch.Tensor | None]:
    """Weighted mean of complete contributions (member -> (weight, encoded chunks)), chunk by chunk
    in member order: (accepted, rejected_for_weight, encoded average, decoded), None when none is left."""
    accepted, heavy = accept_weights({j: w for j, (w, _) in contribs.items()}, max_ratio)
    if not accepted:
        return [], heavy, None, None
    encoded, values = [], torch.zeros(numel, dtype=torch.float32)
    for c, (a, b) in enumerate(chunk_ranges(numel, chunk)):
        out = reduce_chunk([(contribs[j][0], contribs[j][1][c]) for j in accepted], b - a, compression)
        if out is None:
            return [], heavy, None, None
        encoded.append(out[0])
        values[a:b] = out[1]
    return accepted, heavy, encoded, values
