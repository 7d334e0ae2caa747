"""Fault-tolerant butterfly all-reduce of pseudo-gradients on hivemind's P2P streams.

Member j of a group of k reduces part j: every member scatters its parts, the reducer sums them
token-weighted in fp32 in member order, encodes the mean once and sends the same bytes to every
member, which keeps θ bit-identical (hivemind's averager does not). The gather is pipelined
behind the scatter; a part is always the reduce of complete contributions; every wait has a
deadline; a part not in every mask heard is zero on every member; faults end up in the result.
Sending and serving messages is `allreduce_streams`; the pure parts live in `allreduce_state`,
`aggregate` and `wire`. The protocol: docs/protocol/allreduce.md
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import suppress

import torch
from hivemind.p2p import P2P, PeerID

from diloco_p2p.swarm.collective import aggregate, allgather, samples, wire
from diloco_p2p.swarm.collective.allreduce_state import AllreduceResult, Session, conclude
from diloco_p2p.swarm.collective.allreduce_streams import AllreduceStreams
from diloco_p2p.swarm.transport import streams
from diloco_p2p.swarm.transport.streams import NETWORK_ERRORS

log = logging.getLogger(__name__)


PhaseHook = Callable[[str], object]  # may return an awaitable
PartHook = Callable[[torch.Tensor, float], Awaitable[tuple[torch.Tensor, str] | None]]

class AllreduceService(AllreduceStreams):
    """Serves and runs all-reduces for one run (`prefix` = run id) on one P2P instance."""

    _registered: set[tuple[int, str]] = set()

    def __init__(
        self,
        p2p: P2P,
        *,
        prefix: str,
        chunk_elements: int = wire.DEFAULT_CHUNK_ELEMENTS,
        buffer_ttl: float = 30.0,
        max_pending_sessions: int = 64,
        probe_interval: float = 1.0,
        pace_bytes: float | None = None,
    ):
        if not 0 < chunk_elements <= wire.MAX_CHUNK_ELEMENTS:
            raise ValueError(f"chunk_elements must be in (0, {wire.MAX_CHUNK_ELEMENTS}]")
        self.p2p, self.handler_name = p2p, f"{prefix}.allreduce.v1"
        self.chunk_elements, self.buffer_ttl = chunk_elements, buffer_ttl
        self.max_pending_sessions, self.probe_interval = max_pending_sessions, probe_interval
        # What this host's sends may write per second, all streams together (`streams.Pacer`).
        self.pacer = streams.Pacer(pace_bytes) if pace_bytes else None
        self._sessions: dict[str, Session] = {}
        self._background: set[asyncio.Task] = set()  # sends
        self._handlers: set[asyncio.Task] = set()  # incoming streams being served
        self._running = False
        # Whether to serve a peer's stream (its id proven by p2pd): a closed run admits its members
        # only (`diloco_p2p.swarm.trust.admission`); None serves everyone.
        self.admit: Callable[[str, str], Awaitable[bool]] | None = None

    async def start(self) -> None:
        key = (id(self.p2p), self.handler_name)
        if key in self._registered:
            raise RuntimeError(f"an AllreduceService for {self.handler_name!r} already runs on this P2P")
        await self.p2p.add_binary_stream_handler(self.handler_name, self._handle)
        self._registered.add(key)
        self._running = True

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        self._registered.discard((id(self.p2p), self.handler_name))
        with suppress(*NETWORK_ERRORS):
            await self.p2p.remove_binary_stream_handler(self.handler_name)
        now = asyncio.get_running_loop().time()
        for s in self._sessions.values():
            if not s.finished:
                s.finish(now)
        tasks = [t for t in self._background | self._handlers if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------------- the protocol

    async def allreduce(
        self,
        group_id: str,
        peers: list[PeerID],
        tensor: torch.Tensor,
        weight: float,
        *,
        compression: str = "fp16",
        timeout: float = 60.0,
        max_weight_ratio: float = 64.0,
        robust: aggregate.Robust = aggregate.MEAN,
        density: float = 0.01,
        on_phase: PhaseHook | None = None,
        on_scattered: Callable[[], object] | None = None,
        part_hook: PartHook | None = None,
        public: list[bool] | None = None,
    ) -> AllreduceResult:
        """Weighted average of `tensor` over `peers` (this peer included, same order on all members).
        `part_hook` (a grid level): our part is reduced whole and ``await part_hook(values, total_weight)``
        gives what we gather, or None (lost). `public[j]`: whether member j can be dialled (None: all)."""
        allgather.check_args(compression, density, part_hook, robust.aggregation)
        if tensor.dim() != 1 or tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            raise ValueError("allreduce expects a flat float32 CPU tensor")
        if not (timeout > 0 and max_weight_ratio >= 1):
            raise ValueError("timeout must be > 0 and max_weight_ratio >= 1")
        names = [p.to_base58() for p in peers]
        own = self.p2p.peer_id.to_base58()
        if len(set(names)) != len(names) or own not in names:
            raise ValueError("peers must be distinct and include this peer")
        started = time.perf_counter()
        if len(peers) == 1:  # alone: the exact tensor, nothing on the wire
            seconds = time.perf_counter() - started
            return AllreduceResult(tensor.detach().clone(), "ok", [0], 1, [own], {}, 0, 0, seconds, {0: [own]},
                                   [own])
        if not self._running:
            raise RuntimeError("AllreduceService.start() was not called")
        loop = asyncio.get_running_loop()
        s = self._session(group_id, local=True)
        if s is None or s.started.is_set():
            raise ValueError(f"group_id {group_id!r} was already used on this peer")
        me, n = names.index(own), tensor.numel()
        s.start(list(peers), me, n, compression, self.chunk_elements, loop.time(), timeout,
                None if compression in wire.SPARSE else public)
        s.part_hook, s.robust, s.own, s.own_weight = part_hook, robust, tensor.detach(), float(weight)
        if compression in wire.SPARSE:  # topk2 keeping `density` of the values: `allgather` on this session
            return await allgather.run(self, s, tensor, float(weight), density, max_weight_ratio, on_phase, on_scattered)
        tasks: list[asyncio.Task] = []
        scatter_tasks: list[asyncio.Task] = []
        clean = False
        try:
            tasks += self._scatter(s, tensor.detach(), float(weight))
            s.mark("prepared", started)  # our norms and own part done: the scatter streams open from here
            scatter_tasks = list(tasks)
            reducer = self._spawn(self._pipeline(s, max_weight_ratio, on_phase, started, tasks) if s.public[s.me]
                                  else _reduced_nothing(s, on_phase))  # a private member reduces no part
            tasks.append(reducer)
            if on_phase is not None or on_scattered is not None:
                if scatter_tasks:  # none when we are the only public member
                    await asyncio.wait(scatter_tasks, timeout=max(s.d_scatter - loop.time(), 0.0))
                await _phase(on_phase, "scattered")
                if on_scattered is not None:
                    on_scattered()
            await reducer  # our part reduced, its gather sent or on its way (a hook's exception surfaces here)
            s.mark("reduced", started)
            heard = s.public[s.me]  # a private member has heard nobody yet: it waits for every public reducer
            await self._wait(s, lambda: s.pending(s.gathered, only_heard=heard), s.d_gather)
            s.mark("gathered", started)
            await _phase(on_phase, "gathered")

            await self._agree(s, tasks, heard, tensor)
            result = conclude(s, time.perf_counter() - started)
            clean = True
            return result
        finally:
            s.finish(loop.time())
            for task in scatter_tasks if clean else tasks:
                task.cancel()  # gather/mask sends of a clean run finish in the background by d_end

    async def _agree(self, s: Session, tasks: list[asyncio.Task], heard: bool, tensor: torch.Tensor) -> None:
        """Step 5: send our mask (with our part digests and norms) and wait for the others'."""
        s.mask_fixed = True
        s.own_norms = self._own_norms(s, tensor)
        s.masks[s.me] = await self._relay_masks(s)
        s.mask_lists[s.me] = ([s.part_digests.get(p) if held else None for p, held in enumerate(s.masks[s.me])],
                              s.own_norms)
        relayed = {str(j): norms for j, (_, norms) in sorted(s.mask_lists.items()) if not s.public[j]
                   and j in s.masks and j not in s.excluded} if s.public[s.me] else {}
        s.mask_misquoted[s.me] = set(s.misquoted)
        mask = s.header("mask", mask=s.masks[s.me], part_digests=s.mask_lists[s.me][0], norms=s.own_norms,
                        **({"relayed_norms": relayed} if relayed else {}),
                        **({"misquoted": sorted(s.misquoted)} if s.misquoted else {}))
        tasks += [self._spawn(self._send(s, j, mask, [], s.d_end)) for j in set(s.others) - s.gone - s.silent]
        await self._wait(s, lambda: s.pending(s.masks, only_heard=heard), s.d_end)

    async def _relay_masks(self, s: Session) -> list[int]:
        """The mask we send: the parts we hold, ANDed by a public member with the masks of the private
        members it heard by `d_relay` (they cannot reach each other); a later private mask is refused."""
        own = [int(p in s.gathered and not s.gathered[p]["empty"] and p not in s.misquoted) for p in range(s.k)]
        if s.public[s.me] and not all(s.public):
            await self._wait(s, lambda: [j for j in s.pending(s.masks, True) if not s.public[j]], s.d_relay)
            for j, mask in list(s.masks.items()):
                if not s.public[j] and j not in s.excluded:  # a part it got other bytes of is dropped too
                    digests = s.mask_lists.get(j, ([None] * s.k, None))[0]
                    own = [int(a and b and d in (None, s.part_digests.get(p, d)))
                           for p, (a, b, d) in enumerate(zip(own, mask, digests, strict=True))]
        s.mask_sent = True
        return own

    def _scatter(self, s: Session, tensor: torch.Tensor, weight: float) -> list[asyncio.Task]:
        # A sender whose vector is non-finite anywhere says so, and every reducer drops it, not just the
        # one whose part holds the NaN; a sender that lies about it is still caught part by part. That
        # check is all that precedes the first header: each part's norm is summed as its chunks are
        # encoded and leaves in the stream's last frame, and our own part is encoded beside the sends.
        finite, tasks = wire.is_finite(tensor), []
        for j in s.others:
            if not s.public[j]:
                continue  # a private member reduces no part
            lo, hi = s.bounds[j]
            fields = {"part": j, "n": s.n, "numel": hi - lo, "chunk": s.chunk, "comp": s.compression}
            header = s.header("scatter", **fields, weight=weight, finite=finite)
            frames = self._part_frames(s, j, tensor[lo:hi])
            tasks.append(self._spawn(self._send(s, j, header, frames, s.d_gather)))
        reason = wire.weight_problem(weight, None, math.inf) or (None if finite else "nan")
        if reason is not None:  # our own contribution is refused under its reason, like anyone's
            s.rejected[s.me] = reason
        else:
            s.contribs[s.me] = (weight, [])
            lo, hi = s.bounds[s.me]
            tasks.append(self._spawn(self._own_part(s, tensor[lo:hi])))
        return tasks

    def _part_frames(self, s: Session, j: int, part: torch.Tensor) -> Iterator[bytes]:
        """Part j's scatter payload: its encoded chunks, then the norm we state for it (what the
        reducer will sum from the decoded chunks; `aggregate.norm_matches` holds us to it)."""
        total = 0.0
        for a, b in wire.chunk_ranges(part.numel(), s.chunk):
            data, sumsq = wire.encode_sumsq(part[a:b], s.compression)
            total += sumsq
            yield data
        s.part_norms[j] = math.sqrt(total)
        yield wire.pack_norm(self._stated_norm(s.part_norms[j]))

    async def _own_part(self, s: Session, part: torch.Tensor) -> None:
        """Our contribution to our own part: the same encoding and checks as anyone's, a chunk at a
        time beside the scatter sends (the pipeline reduces chunk c once ours is in too). A chunk that
        decodes to a non-finite value (fp16 overflow) voids it as a NaN would anyone's."""
        frames, total = s.contribs[s.me][1], 0.0
        for a, b in wire.chunk_ranges(part.numel(), s.chunk):
            data, sumsq = wire.encode_sumsq(part[a:b], s.compression)
            if not math.isfinite(sumsq):
                s.failed[s.me] = "nan"
                await s.notify()
                return
            frames.append(data)
            total += sumsq
            await s.notify()  # lets the sends and the pipeline run between our chunks
        s.part_norms[s.me] = math.sqrt(total)
        s.norms[s.me] = self._stated_norm(s.part_norms[s.me])
        s.complete.add(s.me)
        await s.notify()

    def _stated_norm(self, norm: float) -> float | None:
        """The norm we state for a part of our contribution (a lying test sender overrides it)."""
        return aggregate.stated(norm)

    def _own_norms(self, s: Session, tensor: torch.Tensor) -> list[float | None]:
        """Our mask's norms: each part's as its scatter stated it; a part whose stream never reached
        its end (the reducer refused or was gone) computed now."""
        return [self._stated_norm(s.part_norms[p] if p in s.part_norms
                                  else aggregate.encoded_norm(tensor[lo:hi], s.chunk, s.compression))
                for p, (lo, hi) in enumerate(s.bounds)]

    async def _pipeline(
        self, s: Session, max_ratio: float, on_phase: PhaseHook | None, started: float, tasks: list[asyncio.Task]
    ) -> None:
        """Reduce our part chunk by chunk as contributions stream in, queueing each chunk for the gather;
        if a contributor fails mid-part the gather ends void and the part is reduced again, whole."""
        await self._wait(s, lambda: s.pending(s.contribs.keys() | s.rejected.keys(), False), s.d_scatter)
        s.reduced = True  # from here on, scatter headers are late
        s.mark("scattered", started)
        for j in range(s.k):
            if j not in s.contribs and j not in s.rejected:
                s.rejected[j] = "timeout"
        candidates, heavy = wire.accept_weights({j: w for j, (w, _) in s.contribs.items()}, max_ratio)
        s.rejected.update({j: "weight" for j in heavy})
        weights = aggregate.capped_weights({j: s.contribs[j][0] for j in candidates}, s.robust.weight_cap)
        await _phase(on_phase, "reduced")
        lo, hi = s.bounds[s.me]
        fields = {"part": s.me, "n": s.n, "numel": hi - lo, "chunk": s.chunk, "comp": s.compression}
        hooked = s.part_hook is not None  # no streaming: the part goes to the next level whole first
        whole = hooked or s.robust.whole_part  # so does a whole-part rule's (centered clipping)
        if not whole:
            s.gather_header = s.header(
                "gather", **fields, empty=not candidates, stream=True, contributors=candidates,
                rejected={str(j): r for j, r in sorted(s.rejected.items())},
                samples=samples.quoted(s.robust, hooked, hi - lo, len(candidates)),
            )
            tasks += [self._spawn(self._gather_to(s, j)) for j in s.others]
        ok = bool(candidates) and not whole and await self._reduce_streamed(s, candidates, weights)
        if ok:  # norms are stated at the end of each contribution: a lie, or one past the bound, voids the part
            await self._wait(s, lambda: [j for j in candidates if j not in s.complete | s.failed.keys()
                                         and j not in s.gone], s.d_scatter)
            ok = all(j in s.complete and j not in s.failed for j in candidates)
            far = aggregate.accept_norms({j: s.norms.get(j) for j in candidates if ok}, s.robust.max_norm_ratio)[1]
            s.failed.update({j: "norm" for j in far})
            ok = ok and not far  # (when one failed, `reduce_part` bounds the complete ones)
        if ok and s.gram is not None:  # a direction against the others' (a sign flip) voids the part too
            flipped = [candidates[i] for i in aggregate.opposed(s.gram, range(len(candidates)), s.robust.opposed_cosine)]
            s.failed.update({j: "opposed" for j in flipped})
            ok = not flipped
        if ok:
            s.gathered[s.me] = s.gather_header
        else:  # reduce again over the complete contributions, without those that failed
            s.rejected.update(s.failed)
            await self._wait(s, lambda: [j for j in s.contribs if j not in s.complete | s.failed.keys()
                                         and j not in s.gone], s.d_scatter)
            complete = {j: c for j, c in s.contribs.items() if j in s.complete and j not in s.rejected}
            accepted, refused, frames, values = await asyncio.to_thread(self._reduce_part, s, complete, max_ratio)
            s.rejected.update(refused)
            if hooked and values is not None:  # the part's weight at the next level: the weights it was reduced with
                capped = aggregate.capped_weights({j: complete[j][0] for j in accepted}, s.robust.weight_cap)
                fields["comp"], frames, values = await self._next_level(s, values, list(capped.values()))
            if values is not None and s.result is not None:
                s.result[lo:hi] = values
                s.part_sumsq[s.me] = aggregate.part_sumsq(values, s.chunk)
            rejected = {str(j): r for j, r in sorted(s.rejected.items())}
            quoted = frames is not None and samples.quoted(s.robust, hooked, hi - lo, len(accepted))
            header = s.header("gather", **fields, empty=frames is None, stream=False, contributors=accepted,
                              rejected=rejected, samples=quoted)
            chunks_digest = _digest(accepted, frames or [])
            quotes = self._quote(s, accepted, complete, chunks_digest) if quoted else None
            s.refuted.pop(s.me, None)  # what the void streamed part's quotes said no longer holds
            s.misquoted.discard(s.me)
            if quotes is not None:  # every member checks every part, ours too: the same drops everywhere
                self._check_quotes(s, s.me, header, chunks_digest, quotes)
            s.fallback = (header, (frames or []) + ([quotes] if quotes else []))
            s.gathered[s.me] = header
            s.part_digests[s.me] = samples.digest(chunks_digest, quotes)
            if whole:
                tasks += [self._spawn(self._gather_to(s, j)) for j in s.others]
            log.debug("allreduce %s: part %d reduced again without %s", s.group_id, s.me, sorted(s.failed))
        s.out_final = wire.TRAILER_OK if ok else wire.TRAILER_VOID
        await s.notify()

    async def _reduce_streamed(self, s: Session, candidates: list[int], weights: dict[int, float]) -> bool:
        """Reduce and queue our part chunk by chunk, summing its digest, squares and (with a direction
        check) the contributions' inner products as it goes; False when a contributor failed or a
        chunk did not reduce to finite values."""
        lo, hi = s.bounds[s.me]
        digest, squares = aggregate.part_digest(candidates), 0.0
        directions = s.robust.opposed_cosine is not None and len(candidates) >= aggregate.OPPOSED_MIN
        s.gram = torch.zeros(len(candidates), len(candidates), dtype=torch.float64) if directions else None
        for c, (a, b) in enumerate(wire.chunk_ranges(hi - lo, s.chunk)):

            def missing(c=c) -> list[int]:
                return [j for j in candidates if len(s.contribs[j][1]) <= c and j not in s.failed]

            await self._wait(s, lambda: [j for j in missing() if j not in s.gone], s.d_scatter)
            s.failed.update({j: "timeout" for j in missing()})
            out = None if any(j in s.failed for j in candidates) else self._reduce_chunk(
                s, [(weights[j], s.contribs[j][1][c]) for j in candidates], b - a
            )
            if out is None or s.result is None:
                return False
            if s.gram is not None:  # the contributions' inner products, for `aggregate.opposed` at the end
                s.gram += aggregate.chunk_gram([s.contribs[j][1][c] for j in candidates], b - a, s.compression)
            s.out.append(out[0])
            s.result[lo + a : lo + b] = out[1]
            digest.update(out[0])
            squares += aggregate.sumsq(out[1])
            await s.notify()
        chunks_digest = digest.hexdigest()[: aggregate.DIGEST_HEX]
        s.quotes = self._quote(s, candidates, s.contribs, chunks_digest) if s.gather_header["samples"] else None
        if s.quotes is not None:
            self._check_quotes(s, s.me, s.gather_header, chunks_digest, s.quotes)
        s.part_digests[s.me], s.part_sumsq[s.me] = samples.digest(chunks_digest, s.quotes), squares
        return True

    def _quote(self, s: Session, contributors: list[int], contribs: dict[int, tuple[float, list[bytes]]],
               chunks_digest: str) -> bytes:
        """Our part's quoted samples (`samples`): each contributor's weight and values at the places
        the part's digest picks (a hostile test reducer overrides it)."""
        lo, hi = s.bounds[s.me]
        offsets = samples.places(s.group_id, s.me, chunks_digest, hi - lo)
        rows = [samples.at(contribs[j][1], hi - lo, s.chunk, s.compression, offsets) for j in contributors]
        return samples.pack([contribs[j][0] for j in contributors], torch.stack(rows))

    async def _next_level(self, s: Session, values: torch.Tensor, weights: list[float]):
        """(compression, encoded chunks, decoded values) of what `s.part_hook` makes of our reduced
        part; (compression, None, None) when it lost the part."""
        out = await s.part_hook(values, math.fsum(weights))
        if out is None or out[0].shape != values.shape or out[1] not in wire.COMPRESSIONS:
            return s.compression, None, None
        frames = list(_encoded_chunks(out[0], s.chunk, out[1]))
        decoded = torch.cat([wire.decode(f, b - a, out[1]) for f, (a, b) in
                             zip(frames, wire.chunk_ranges(values.numel(), s.chunk), strict=True)] or [values[:0]])
        return out[1], frames, decoded

    def _reduce_chunk(self, s: Session, contribs: list[tuple[float, bytes]], numel: int):
        """One chunk of our part, streamed (`aggregate.reduce_chunk`; a hostile test reducer overrides it)."""
        return aggregate.reduce_chunk(s.robust, contribs, numel, s.compression)

    def _reduce_part(self, s: Session, complete: dict[int, tuple[float, list[bytes]]], max_ratio: float):
        """Our whole part from complete contributions (`aggregate.reduce_part`)."""
        lo, hi = s.bounds[s.me]
        return aggregate.reduce_part(s.robust, complete, s.norms, max_ratio, hi - lo, s.chunk, s.compression)

    async def _streamed_part(self, s: Session) -> AsyncIterator[bytes]:
        """Our reduced chunks as the pipeline produces them, then the trailer (ok or void)."""
        i = 0
        while True:
            await s.wait_until(lambda i=i: len(s.out) > i or s.out_final is not None, s.d_gather)
            if len(s.out) > i:
                i += 1
                yield s.out[i - 1]
            elif s.out_final is not None:
                yield s.out_final
                if s.out_final == wire.TRAILER_OK and s.quotes is not None:
                    yield s.quotes
                return
            else:
                raise TimeoutError("our part was not reduced in time")

    async def _gather_to(self, s: Session, j: int) -> None:
        """Send member j our part: streamed as it is reduced, then, if that ended void, reduced again."""
        if s.gather_header is not None:
            await self._send(s, j, s.gather_header, self._streamed_part(s), s.d_end)
        if s.fallback is not None:
            await self._send(s, j, *s.fallback, s.d_end)

    async def _wait(self, s: Session, pending: Callable[[], list[int]], deadline: float) -> None:
        """Wait until nobody is `pending()` or `deadline`. Every `probe_interval` the silent members
        get a ping: a SIGKILLed peer (its stream is reset) or a vanished daemon (cannot open) becomes
        gone and is no longer waited for; a stalled one just times out the ping."""
        loop = asyncio.get_running_loop()
        while pending() and loop.time() < deadline:
            await s.wait_until(lambda: not pending(), min(deadline, loop.time() + self.probe_interval))
            unreachable = {j for j in s.others if not s.public[j] and j not in s.heard}
            for j in set(pending()) - s.probing - unreachable - {s.me}:  # our own part is no one to ping
                s.probing.add(j)
                ping = self._send(
                    s, j, s.header("ping"), [], min(deadline, loop.time() + self.probe_interval)
                )
                self._spawn(ping).add_done_callback(lambda _, j=j: s.probing.discard(j))

    # ------------------------------------------------------------------------- sending

    def _spawn(self, coro: Awaitable[bool]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ------------------------------------------------------------------------- receiving

    def _session(self, group_id: str, local: bool) -> Session | None:
        now = asyncio.get_running_loop().time()
        s = self._sessions.get(group_id)
        if s is None:
            stale = 2 * self.buffer_ttl  # > the longest a message waits for its session to start
            for gid, old in list(self._sessions.items()):
                expired = now - (old.finished_at if old.finished else old.touched) > stale
                if expired and (old.finished or not old.started.is_set()):
                    del self._sessions[gid]
            pending = sum(not x.started.is_set() for x in self._sessions.values())
            if not local and pending >= self.max_pending_sessions:
                return None
            s = self._sessions[group_id] = Session(group_id, now)
        s.touched = now
        return s

def _digest(contributors: list[int], frames: Iterable[bytes]) -> str:
    digest = aggregate.part_digest(contributors)
    for data in frames:
        digest.update(data)
    return digest.hexdigest()[: aggregate.DIGEST_HEX]


def _encoded_chunks(part: torch.Tensor, chunk: int, compression: str) -> Iterable[bytes]:
    """Encode lazily, one chunk per frame, so a send holds one chunk in memory at a time."""
    for a, b in wire.chunk_ranges(part.numel(), chunk):
        yield wire.encode(part[a:b], compression)


async def _reduced_nothing(s: Session, on_phase: PhaseHook | None) -> None:
    s.reduced = True
    await _phase(on_phase, "reduced")


async def _phase(hook: PhaseHook | None, name: str) -> None:
    if hook is not None:
        outcome = hook(name)
        if inspect.isawaitable(outcome):
            await outcome
