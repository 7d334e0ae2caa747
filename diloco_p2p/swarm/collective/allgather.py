"""Sparse all-gather of pseudo-gradients (``sync.compression: topk2``) on the all-reduce's streams.

A top-k mean holds the union of the members' indices, so it does not shrink in a
reduce-scatter: with ``topk2`` every member sends its whole sparse contribution to every other
member, and each reduces all of them itself, in member order, in fp32, with no fused
multiply-add, so the same bytes give the same bits on every member without a reducer. Faults
are handled on the butterfly's `Session`: a contribution enters the mean only if every mask
heard holds it with the same digest. Worth it for small groups and low densities.
The protocol and its costs: docs/protocol/allreduce.md
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch

from diloco_p2p.swarm.collective import codecs, wire
from diloco_p2p.swarm.collective.allreduce_state import AllreduceResult, Session
from diloco_p2p.swarm.transport import streams

NO_GO, GO = b"\x00", b"\x01"


def contribution_digest(weight: float, frames: list[bytes]) -> str:
    """What members compare in their masks: the weight and every byte of the contribution."""
    h = hashlib.sha256(repr(float(weight)).encode())
    for data in frames:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:32]


def check_args(compression: str, density: float, part_hook: Any, aggregation: str = "mean") -> None:
    """`AllreduceService.allreduce`'s checks of its wire arguments (ValueError)."""
    if compression not in wire.COMPRESSIONS + wire.SPARSE:
        raise ValueError(f"compression must be one of {wire.COMPRESSIONS + wire.SPARSE}, got {compression!r}")
    codecs.check_density(density)
    if compression in wire.SPARSE and part_hook is not None:
        raise ValueError("a sparse all-gather has no parts to hand to a part_hook")
    if compression in wire.SPARSE and aggregation != "mean":
        raise ValueError("a sparse all-gather averages with the mean only (robust rules run on the reducers)")


async def run(service: Any, s: Session, tensor: torch.Tensor, weight: float, density: float, max_ratio: float,
              on_phase: Callable | None, on_scattered: Callable | None) -> AllreduceResult:
    """The sparse all-gather on a started session `s` of `service` (an `AllreduceService`); like
    the butterfly it finishes the session, and cancels its sends unless it ends cleanly."""
    loop, started, tasks = asyncio.get_running_loop(), time.perf_counter(), []
    try:
        result = await _run(service, s, tensor.detach(), weight, density, max_ratio, on_phase, on_scattered, started,
                            tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    finally:
        s.finish(loop.time())
    return result


async def _run(service: Any, s: Session, tensor: torch.Tensor, weight: float, density: float, max_ratio: float,
               on_phase: Callable | None, on_scattered: Callable | None, started: float,
               tasks: list[asyncio.Task]) -> AllreduceResult:
    s.density, s.digests = density, {}
    finite = wire.is_finite(tensor)
    own = codecs.encode_chunks(tensor, s.chunk, density)
    header = s.header("contrib", n=s.n, chunk=s.chunk, comp=s.compression, density=density, weight=weight,
                      finite=finite)
    sends = [service._spawn(service._send(s, j, header, own, s.d_gather)) for j in s.others]
    tasks += sends
    if s.accept_own(weight, own, finite, lambda: [codecs.decode_chunks(own, s.n, s.chunk, density)]):
        s.digests[s.me] = contribution_digest(weight, own)
    if on_phase is not None or on_scattered is not None:
        await asyncio.wait(sends, timeout=max(s.d_gather - asyncio.get_running_loop().time(), 0.0))
        await _phase(on_phase, "scattered")
        if on_scattered is not None:
            on_scattered()
    await service._wait(s, lambda: s.pending(s.complete | s.rejected.keys() | s.failed.keys(), False), s.d_gather)
    s.mark("gathered", started)
    await _phase(on_phase, "gathered")
    s.mask_fixed = True
    s.masks[s.me] = [int(j in s.complete) for j in range(s.k)]
    s.mask_digests[s.me] = [s.digests.get(j, "") for j in range(s.k)]
    mask = s.header("mask", mask=s.masks[s.me], contrib_digests=s.mask_digests[s.me])
    tasks += [service._spawn(service._send(s, j, mask, [], s.d_end)) for j in set(s.others) - s.gone]
    await service._wait(s, lambda: s.pending(s.masks, only_heard=True), s.d_end)
    return await asyncio.to_thread(conclude, s, max_ratio, started)


def conclude(s: Session, max_ratio: float, started: float) -> AllreduceResult:
    """The mean of the contributions every heard mask holds with the same digest."""
    masks = {j: m for j, m in s.masks.items() if j not in s.excluded and len(s.mask_digests.get(j, [])) == s.k}
    committed = [c for c in range(s.k) if all(m[c] for m in masks.values())
                 and len({s.mask_digests[j][c] for j in masks}) == 1]
    accepted, heavy = wire.accept_weights({c: s.contribs[c][0] for c in committed}, max_ratio)
    status = "ok" if len(masks) >= 2 and accepted else "failed"
    average = (codecs.sparse_mean([s.contribs[c] for c in accepted], s.n, s.chunk, s.density) if status == "ok"
               else torch.zeros(s.n, dtype=torch.float32))
    rejected = {s.names[j]: "weight" for j in heavy}
    for j in range(s.k):
        if j not in committed:
            rejected[s.names[j]] = s.rejected.get(j) or s.failed.get(j) or "timeout"
    contributors = [s.names[c] for c in accepted] if status == "ok" else []
    return AllreduceResult(
        average=average, status=status, committed_parts=[0] if status == "ok" else [], num_parts=1,
        contributors=contributors, rejected=rejected, bytes_sent=s.bytes_sent, bytes_received=s.bytes_received,
        seconds=time.perf_counter() - started, part_contributors={0: contributors} if status == "ok" else {},
        agreed_with=[s.names[j] for j in sorted(masks)], phases=dict(s.phases),
    )


async def receive(s: Session, j: int, h: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Serve member j's ``contrib`` message (called by `AllreduceService._serve`)."""
    density = getattr(s, "density", None)
    if j in s.contribs or j in s.rejected or j in s.failed or s.mask_fixed:
        writer.write(NO_GO)
        return False
    shape = {"n": s.n, "chunk": s.chunk}  # every member reduces in our chunk layout
    if s.refuse_header(j, h, shape, {"comp": s.compression, "density": density}) is not None:
        writer.write(NO_GO)
        return False
    writer.write(GO)
    frames: list[bytes] = []
    try:
        for a, b in wire.chunk_ranges(s.n, h["chunk"]):
            data = await streams.read_frame(reader, codecs.topk_size(b - a, density))
            s.bytes_received += streams.LENGTH_PREFIX + len(data)
            try:
                values = codecs.decode_topk(data, b - a, density)
            except wire.WireError:
                s.failed[j] = "shape"
                return False
            if not wire.is_finite(values):
                s.failed[j] = "nan"
                return False
            frames.append(data)
    except BaseException:
        s.failed.setdefault(j, "timeout")
        raise
    if s.mask_fixed or s.finished:
        return False
    weight = float(h["weight"])
    s.contribs[j] = (weight, frames)
    s.digests[j] = contribution_digest(weight, frames)
    s.complete.add(j)
    return True


async def _phase(hook: Callable | None, name: str) -> None:
    if hook is not None:
        outcome = hook(name)
        if asyncio.iscoroutine(outcome) or isinstance(outcome, asyncio.Future):
            await outcome
