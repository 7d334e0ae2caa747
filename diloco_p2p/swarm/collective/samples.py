"""A reducer's quoted samples: the spot check that binds a part to the contributions it averaged.

After its part is reduced, a reducer quotes, at `SAMPLES` places its output's digest picks (so
they are fixed only once the output is), each contributor's weight and decoded values. Every
member recomputes the rule there from the quotes and holds the output to it within the wire
format's rounding (a scale by any factor beyond it is a proven lie), and checks its own row
against what it sent (a misquote it names in its mask). The quotes enter the part's digest, so
every member checks the same ones. The rule and its bound: docs/protocol/allreduce.md
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np
import torch

from diloco_p2p.config.compression import INT4_BLOCK, INT8_BLOCK
from diloco_p2p.swarm.collective import aggregate, wire
from diloco_p2p.swarm.transport.streams import WireError

SAMPLES = 128  # places per part: a lie on a share f of a part's values escapes with probability (1 - f)^128
LEVELS = {"int8": (INT8_BLOCK, 127.0), "int4": (INT4_BLOCK, 7.0)}  # block codecs: values per scale, top code
ACCUMULATION = 2.0**-21  # fp32 sums in another order (or fused) differ by under this x k x Σ|w·x|/W


def quoted(robust: aggregate.Robust, hooked: bool, numel: int, contributors: int) -> bool:
    """Whether a part is quoted: a coordinatewise rule, reduced here (not a hierarchy's), not empty."""
    return not (robust.whole_part or hooked) and numel > 0 and contributors > 0


def places(group: str, part: int, digest: str, numel: int) -> np.ndarray:
    """The offsets within the part that are quoted: a shake-256 stream of the output's digest."""
    count = min(SAMPLES, numel)
    stream = hashlib.shake_256(f"samples:{group}:{part}:{digest}".encode()).digest(8 * count)
    return (np.frombuffer(stream, dtype="<u8") % np.uint64(numel)).astype(np.int64)


def frame_size(contributors: int, numel: int) -> int:
    return contributors * (8 + 4 * min(SAMPLES, numel))


def pack(weights: Sequence[float], rows: torch.Tensor) -> bytes:
    """The frame: each contributor's weight (float64), then its quoted values (float32), in order."""
    return np.asarray(weights, dtype="<f8").tobytes() + rows.numpy().astype("<f4").tobytes()


def unpack(data: bytes, contributors: int, numel: int) -> tuple[list[float], torch.Tensor]:
    """(weights, rows [contributors x places]) of a frame; WireError on a size or value it cannot hold."""
    if len(data) != frame_size(contributors, numel):
        raise WireError(f"a samples frame for {contributors} contributors has {frame_size(contributors, numel)} bytes")
    weights = np.frombuffer(data, dtype="<f8", count=contributors)
    rows = np.frombuffer(data, dtype="<f4", offset=8 * contributors).reshape(contributors, -1)
    if not (np.isfinite(weights).all() and (weights > 0).all() and np.isfinite(rows).all()):
        raise WireError("a samples frame holds a weight <= 0 or a value that is not finite")
    return weights.tolist(), torch.from_numpy(rows.astype(np.float32))


def at(chunks: Sequence[bytes], numel: int, chunk: int, compression: str, offsets: np.ndarray) -> torch.Tensor:
    """The decoded values at `offsets` of a part sent as encoded `chunks`, decoding only what they need."""
    out, which = torch.empty(len(offsets), dtype=torch.float32), offsets // chunk
    for c in np.unique(which):
        mine, a = np.nonzero(which == c)[0], int(c) * chunk
        out[torch.from_numpy(mine)] = _decode_at(chunks[c], min(a + chunk, numel) - a, compression, offsets[mine] - a)
    return out


def _decode_at(data: bytes, numel: int, compression: str, offsets: np.ndarray) -> torch.Tensor:
    if len(data) != wire.encoded_size(numel, compression):
        raise WireError(f"a {compression} chunk of {numel} values has {wire.encoded_size(numel, compression)} bytes")
    if compression in ("fp32", "fp16"):
        values = np.frombuffer(data, dtype="<f4" if compression == "fp32" else "<f2")[offsets]
        return torch.from_numpy(values.astype(np.float32))
    if compression == "int8":
        blocks = math.ceil(numel / INT8_BLOCK)
        scale = np.frombuffer(data, dtype="<f4", count=blocks)[offsets // INT8_BLOCK]
        codes = np.frombuffer(data, dtype=np.int8, offset=4 * blocks)[offsets].astype(np.float32)
        return torch.from_numpy(codes * scale)
    return wire.decode(data, numel, compression)[torch.from_numpy(offsets)]


def _blocks(numel: int, chunk: int, block: int, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) of the codec block holding each offset: blocks restart at every chunk."""
    starts = offsets // chunk * chunk
    lo = starts + (offsets - starts) // block * block
    return lo, np.minimum(np.minimum(lo + block, starts + chunk), numel)


def sent(part: torch.Tensor, chunk: int, compression: str, offsets: np.ndarray) -> torch.Tensor:
    """What a reducer decoded of our `part` at `offsets`, exactly: fp32 and fp16 value by value,
    int8 and int4 block by block (a block's codes depend on that block only)."""
    x = part.detach()[torch.from_numpy(offsets)]
    if compression not in LEVELS:
        return x.half().float() if compression == "fp16" else x.float()
    values = torch.empty(len(offsets))
    for i, (a, b) in enumerate(zip(*_blocks(part.numel(), chunk, LEVELS[compression][0], offsets), strict=True)):
        values[i] = wire.decode(wire.encode(part[a:b], compression), b - a, compression)[offsets[i] - a]
    return values


def quantum(result: torch.Tensor, chunk: int, compression: str, offsets: np.ndarray) -> torch.Tensor:
    """How far an honest output may sit from the recomputed rule at `offsets`, from the part as
    decoded: fp16 a unit in the last place, fp32 a few, int8/int4 half a step of the value's block."""
    o = result[torch.from_numpy(offsets)].abs()
    if compression == "fp16":
        return o * 2.0**-10 + 2.0**-24
    if compression not in LEVELS:
        return o * 2.0**-20 + 1e-30
    block, top = LEVELS[compression]  # rounding to a code errs by half a step; the block's max is the top code
    lo, hi = _blocks(result.numel(), chunk, block, offsets)
    return torch.tensor([float(result[a:b].abs().max()) / top for a, b in zip(lo, hi, strict=True)]) * 0.501 + 1e-30


def refuted(robust: aggregate.Robust, weights: Sequence[float], rows: torch.Tensor, output: torch.Tensor,
            allowed: torch.Tensor) -> str | None:
    """Why the output at the quoted places is not the rule over the quotes (None: it is)."""
    capped = aggregate.capped_weights(dict(enumerate(weights)), robust.weight_cap)
    top = max(capped.values())  # the same mean on a scale no quoted weight can overflow in fp32
    w = [capped[i] / top for i in range(len(weights))]
    expected = aggregate.combine(robust, w, list(rows))
    spread = sum(wi * r.abs() for wi, r in zip(w, rows, strict=True)) / math.fsum(w)
    off = (output - expected).abs()
    wrong = ~(off <= allowed + ACCUMULATION * len(w) * spread)  # NaN refutes too
    if not bool(wrong.any()):
        return None
    ratio = float((output.double() @ expected.double()) / max(float(expected.double().square().sum()), 1e-300))
    return (f"is not the average of the contributions it quoted at {int(wrong.sum())} of {len(off)} places "
            f"(its values ~{ratio:.3g}x theirs)")


def misquoted(weights: Sequence[float], rows: torch.Tensor, row: int, weight: float, values: torch.Tensor) -> bool:
    """Whether contributor `row` (us) was quoted with another weight or other values than it sent."""
    return weights[row] != weight or not torch.equal(rows[row], values)


def digest(chunks_digest: str, frame: bytes | None) -> str:
    """A part's digest in the masks: its chunks' digest, extended by the quotes when there are any."""
    if frame is None:
        return chunks_digest
    return hashlib.sha256(chunks_digest.encode() + frame).hexdigest()[: aggregate.DIGEST_HEX]
