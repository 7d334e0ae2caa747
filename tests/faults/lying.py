"""A lying all-reduce member, for the fault tests only (issue 12): what an attacker inside a
group can do as a sender and as a reducer, so that the members' checks meet it on real streams.

`LyingAllreduce` is an `AllreduceService` that lies as its `lie` says (None: honest):
``understate-norm`` (its scatter streams and masks state 1e-6 of its contributions' norms),
``scale-output`` (its averaged part × 1000, the same bytes to every member), ``shrink-output``
(× 0.001, likewise), ``split-output``
(its averaged part changed for one member only, `victim`: a member index; with no victim, each
other member gets its own changed copy). A node started as ``python -m tests.faults.node``
uses it when ``DILOCO_P2P_FAULTS`` plans a lie as a reducer (``scale@reduce:R``,
``shrink@reduce:R``, ``split@reduce:R``, `tests.faults.injection`); ``name-nan`` (its gather header
says member `victim` sent a NaN), ``nan-quotes`` (a NaN among its quotes); in-process tests use it directly
(`tests/faults/hostile.py`). What the members do about each lie is
`diloco_p2p.swarm.collective.aggregate`'s docstring.
"""

from __future__ import annotations

import torch

from diloco_p2p.swarm.collective import aggregate, samples, wire
from diloco_p2p.swarm.collective.allreduce import AllreduceService
from diloco_p2p.swarm.collective.allreduce_streams import _frames

# What each scaling lie multiplies its part by. ``nudge-output`` stays within the norm checks: its quotes
# refute it; ``misquote-output`` also quotes its contributors so that they agree with it (all of them,
# or only `victim`'s row), which those contributors see (`diloco_p2p.swarm.collective.samples`).
SCALES = {"scale-output": 1000.0, "shrink-output": 0.001, "nudge-output": 0.8, "misquote-output": 0.8}
NUDGE = 0.01  # split-output: member j gets NUDGE × (1 + j) added to every value


class LyingAllreduce(AllreduceService):
    lie: str | None = None
    victim: int | None = None

    def _stated_norm(self, norm):
        stated = super()._stated_norm(norm)
        return stated * 1e-6 if stated is not None and self.lie == "understate-norm" else stated

    def _reduce_chunk(self, s, contribs, numel):
        out = super()._reduce_chunk(s, contribs, numel)
        return _scaled(out[0], numel, s.compression, SCALES[self.lie]) if out and self.lie in SCALES else out

    def _reduce_part(self, s, complete, max_ratio):
        accepted, refused, frames, values = super()._reduce_part(s, complete, max_ratio)
        if frames and self.lie in SCALES:
            pieces = [_scaled(f, b - a, s.compression, SCALES[self.lie]) for f, (a, b) in
                      zip(frames, wire.chunk_ranges(values.numel(), s.chunk), strict=True)]
            frames, values = [p[0] for p in pieces], torch.cat([p[1] for p in pieces])
        return accepted, refused, frames, values

    def _quote(self, s, contributors, contribs, chunks_digest):
        frame = super()._quote(s, contributors, contribs, chunks_digest)
        if self.lie == "nan-quotes":  # a malformed frame: what the members refuse before using any of it
            return frame[:-4] + b"\xff\xff\xff\x7f"
        if self.lie != "misquote-output":
            return frame
        lo, hi = s.bounds[s.me]
        weights, rows = samples.unpack(frame, len(contributors), hi - lo)
        if self.victim is None:
            return samples.pack(weights, rows * SCALES[self.lie])
        w = list(aggregate.capped_weights(dict(enumerate(weights)), s.robust.weight_cap).values())
        v = contributors.index(self.victim)
        ours = s.result[lo:hi][torch.from_numpy(samples.places(s.group_id, s.me, chunks_digest, hi - lo))]
        others = sum(w[i] * rows[i] for i in range(len(rows)) if i != v)
        rows[v] = (ours * sum(w) - others) / w[v]  # the victim's row absorbs the whole scale
        return samples.pack(weights, rows)

    async def _send(self, s, j, header, frames, deadline):
        if self.lie == "name-nan" and header["kind"] == "gather":  # says `victim` sent a NaN (it did not)
            header = {**header, "rejected": {**header["rejected"], str(self.victim): "nan"}}
        if self.lie == "split-output" and header["kind"] == "gather" and self.victim in (None, j):
            frames = _perturbed(frames, header["numel"], header["chunk"], s.compression, NUDGE * (1 + j))
        return await super()._send(s, j, header, frames, deadline)


def _scaled(data: bytes, numel: int, compression: str, factor: float) -> tuple[bytes, torch.Tensor]:
    encoded = wire.encode(wire.decode(data, numel, compression) * factor, compression)
    return encoded, wire.decode(encoded, numel, compression)


async def _perturbed(frames, numel: int, chunk: int, compression: str, nudge: float):
    """The gather's chunk frames with `nudge` added to every value (trailers and quotes pass as they are)."""
    sizes = iter(b - a for a, b in wire.chunk_ranges(numel, chunk))
    async for data in _frames(frames):
        size = next(sizes, None)
        if len(data) == 1 or size is None:
            yield data
        else:
            yield wire.encode(wire.decode(data, size, compression) + nudge, compression)
