"""The all-reduce's messages on the wire: sending one to a member, and serving those that arrive.

`AllreduceStreams` is the half of `AllreduceService` that touches streams: a message is one
libp2p stream (a header frame, then payload frames), answered by one go/no-go byte before the
payload and one after it (accepted or not). Receiving checks each header against the session it
names (`Session.refuse_header`), reads payloads chunk by chunk into the reducer's pipeline or
the member's result, and checks every stated norm against the bytes. The protocol:
docs/protocol/allreduce.md
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import suppress
from typing import Any

import torch

from diloco_p2p.swarm.collective import aggregate, allgather, samples, wire
from diloco_p2p.swarm.collective.allreduce_state import Session
from diloco_p2p.swarm.transport import streams
from diloco_p2p.swarm.transport.streams import NETWORK_ERRORS

log = logging.getLogger("diloco_p2p.swarm.collective.allreduce")

GO, NO_GO = b"\x01", b"\x00"
LINGER_TIMEOUT = 5.0  # how long a receiver keeps a stream open after its last byte, for the sender to close it
Frames = Iterable[bytes] | AsyncIterator[bytes]


class PeerGone(Exception):
    """The stream could not be opened, or the remote closed it before accepting our header."""


class AllreduceStreams:
    """Sending and serving the all-reduce's messages; mixed into `AllreduceService`, whose
    sessions, pacing and handlers it uses."""

    async def _send(self, s: Session, j: int, header: dict, frames: Frames, deadline: float) -> bool:
        """Deliver one message to member j before `deadline`; True iff the receiver accepted it."""
        try:
            async with asyncio.timeout_at(deadline):
                return await self._send_stream(s, j, header, frames)
        except PeerGone as e:
            log.debug("allreduce %s: member %s is gone (%r)", s.group_id, s.names[j], e.__cause__)
            s.gone.add(j)
            await s.notify()
        except (TimeoutError, *NETWORK_ERRORS) as e:
            log.debug("allreduce %s: %s to %s failed: %r", s.group_id, header["kind"], s.names[j], e)
        return False

    async def _send_stream(self, s: Session, j: int, header: dict, frames: Frames) -> bool:
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(s.peer_ids[j], self.handler_name)
        except NETWORK_ERRORS as e:
            raise PeerGone() from e
        payload = asyncio.ensure_future(self._write_payload(s, writer, header, frames))
        answers: list[asyncio.Future] = []
        try:  # the payload follows the header at once: waiting for the go first cost a round trip
            try:
                go = await reader.readexactly(1)
            except NETWORK_ERRORS as e:  # the remote daemon could not hand the stream to a live handler
                raise PeerGone() from e
            if go != GO:
                return False
            answers.append(asyncio.ensure_future(reader.readexactly(1)))
            await asyncio.wait((payload, answers[0]), return_when=asyncio.FIRST_COMPLETED)
            if not payload.done():  # the receiver answered before our last byte: it stopped reading
                return False
            await payload
            return await answers[0] == GO
        finally:
            for task in (payload, *answers):
                task.cancel()
                if task.done() and not task.cancelled():
                    task.exception()  # a payload cut by the receiver's refusal or death: no error of ours
            writer.close()

    async def _write_payload(self, s: Session, writer: asyncio.StreamWriter, header: dict, frames: Frames) -> None:
        s.bytes_sent += streams.write_frame(writer, wire.pack_header(header))
        await writer.drain()
        async for data in _frames(frames):
            sent = await streams.write_frame_paced(writer, data, self.pacer)
            s.bytes_sent += sent  # not `+= await ...`: that reads the total before the await

    # -------------------------------------------------------------------- receiving

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            if self.admit is not None and not await self.admit(info.peer_id.to_base58(), "all-reduce"):
                return
            await self._serve(info.peer_id.to_base58(), reader, writer)
            await streams.linger(reader, LINGER_TIMEOUT, drain=True)  # until the sender has read our last byte
        except (*NETWORK_ERRORS, TimeoutError, wire.WireError) as e:
            log.debug("allreduce: dropped a message from %s: %r", info.peer_id, e)
        except Exception:
            log.exception("allreduce: handler failed on a message from %s", info.peer_id)
        finally:
            writer.close()
            self._handlers.discard(task)

    async def _serve(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raw = await asyncio.wait_for(streams.read_frame(reader, wire.MAX_HEADER_BYTES), self.buffer_ttl)
        h = wire.parse_header(raw)
        if h["kind"] == "ping":  # liveness only: go + accepted, without touching any session
            writer.write(GO + GO)
            await writer.drain()
            return
        s = self._session(h["group"], local=False) if self._running else None
        if s is not None and not s.started.is_set():
            with suppress(TimeoutError):
                await asyncio.wait_for(s.started.wait(), self.buffer_ttl)
        if s is None or not s.started.is_set() or s.finished or s.result is None:
            writer.write(NO_GO)
            return
        j = s.index.get(sender)
        if j is None or j == s.me or j in s.excluded:
            writer.write(NO_GO)
            return
        s.bytes_received += streams.LENGTH_PREFIX + len(raw)
        if h["digest"] != s.digest:
            s.excluded.add(j)
            if h["kind"] == "scatter" and not s.reduced:
                s.rejected.setdefault(j, "group")
            writer.write(NO_GO)
            await s.notify()
            return
        s.heard.add(j)
        try:
            receive = {"scatter": self._recv_scatter, "gather": self._recv_gather, "mask": self._recv_mask,
                       "contrib": allgather.receive}
            async with asyncio.timeout_at(s.d_end):
                accepted = await receive[h["kind"]](s, j, h, reader, writer)
            writer.write(GO if accepted else NO_GO)
            await writer.drain()
        finally:
            await s.notify()

    async def _recv_scatter(self, s: Session, j: int, h: dict, reader: asyncio.StreamReader, writer) -> bool:
        lo, hi = s.bounds[s.me]
        if j in s.contribs or j in s.rejected or s.reduced:
            writer.write(NO_GO)
            return False
        shape = {"part": s.me, "n": s.n, "numel": hi - lo}
        if s.refuse_header(j, h, shape, {"comp": s.compression}) is not None:
            writer.write(NO_GO)
            return False
        writer.write(GO)
        frames: list[bytes] = []
        s.contribs[j] = (float(h["weight"]), frames)  # the pipeline reduces chunks as they land here
        squares = [0.0]

        def store(a: int, b: int, values: torch.Tensor, data: bytes) -> None:
            frames.append(data)
            squares[0] += aggregate.sumsq(values, exact=False)  # held to the stated norm within a tolerance

        try:
            reason = await self._read_payload(s, h, reader, store)
            if reason is None:
                reason = await self._read_norm(s, j, reader, squares[0])
        except BaseException:
            s.failed.setdefault(j, "timeout")
            raise
        finally:
            await s.notify()
        if reason is not None:
            s.failed.setdefault(j, reason)
            return False
        s.complete.add(j)
        return not s.finished

    async def _recv_gather(self, s: Session, j: int, h: dict, reader: asyncio.StreamReader, writer) -> bool:
        lo, hi = s.bounds[j]
        valid = (
            h["part"] == j
            and h["n"] == s.n
            and h["numel"] == hi - lo
            and h["comp"] in (s.compression, "fp32")  # fp32: a level of a hierarchy, exact (`part_hook`)
            and all(c < s.k for c in h["contributors"])
            and len(set(h["contributors"])) == len(h["contributors"])  # bounds the quotes' frame too
            and all(int(p) < s.k for p in h["rejected"])
        )
        if not valid:
            s.excluded.add(j)
        if not valid or j in s.gathered or s.mask_fixed:
            writer.write(NO_GO)
            return False
        writer.write(GO)
        digest, squares = aggregate.part_digest(h["contributors"]), [0.0]
        if not h["empty"]:

            def store(a: int, b: int, values: torch.Tensor, data: bytes) -> None:
                digest.update(data)
                squares[0] += aggregate.sumsq(values)  # the reducer check's norm, chunk by chunk as the reducer sums it
                if not s.mask_fixed and s.result is not None:  # no await between this check and the write
                    s.result[lo + a : lo + b] = values

            reason = await self._read_payload(s, h, reader, store)
            if reason is None and h["stream"]:  # a streamed part counts only if its reducer says so at the end
                trailer = await streams.read_frame(reader, 1)
                s.bytes_received += streams.LENGTH_PREFIX + len(trailer)
                reason = None if trailer == wire.TRAILER_OK else "void"
            if reason is not None or s.mask_fixed or s.finished:
                return False
        chunks_digest, quotes = digest.hexdigest()[: aggregate.DIGEST_HEX], None
        if h.get("samples") and not h["empty"]:
            quotes = await streams.read_frame(reader, samples.frame_size(len(h["contributors"]), h["numel"]))
            s.bytes_received += streams.LENGTH_PREFIX + len(quotes)
            if h["comp"] != s.compression or s.mask_fixed or s.finished or not self._check_quotes(
                    s, j, h, chunks_digest, quotes):  # no await from here to the part being held
                return False
        s.gathered[j] = h
        s.part_digests[j], s.part_sumsq[j] = samples.digest(chunks_digest, quotes), squares[0]
        return True

    def _check_quotes(self, s: Session, j: int, h: dict, chunks_digest: str, quotes: bytes) -> bool:
        """Hold part j to the samples its reducer quoted (`samples`): a part the quotes refute goes to
        `s.refuted`, one that misquoted us to `s.misquoted`; False when the frame is malformed."""
        lo, hi = s.bounds[j]
        try:
            weights, rows = samples.unpack(quotes, len(h["contributors"]), hi - lo)
        except wire.WireError as e:  # its own bytes to us, proven by p2pd's peer id: no one else can frame it
            s.bad_quotes[j] = f"sent quotes of part {j} that are malformed ({e})"
            return False
        assert s.result is not None
        offsets, part = samples.places(s.group_id, j, chunks_digest, hi - lo), s.result[lo:hi]
        allowed = samples.quantum(part, h["chunk"], s.compression, offsets)
        why = samples.refuted(s.robust, weights, rows, part[torch.from_numpy(offsets)], allowed)
        if why is not None:
            s.refuted[j] = why
        if s.me in h["contributors"]:
            values = samples.sent(s.own[lo:hi], s.chunk, s.compression, offsets)
            if samples.misquoted(weights, rows, h["contributors"].index(s.me), s.own_weight, values):
                s.misquoted.add(j)
                log.warning("allreduce %s: reducer %s quoted our contribution to part %d otherwise than we sent it",
                            s.group_id, s.names[j], j)
        return True

    async def _recv_mask(self, s: Session, j: int, h: dict, reader: asyncio.StreamReader, writer) -> bool:
        if len(h["mask"]) != s.k:
            s.excluded.add(j)
        late = s.mask_sent and not s.public[j]  # a private mask after ours left: see `_relay_masks`
        accepted = len(h["mask"]) == s.k and j not in s.masks and not s.finished and not late
        writer.write(GO if accepted else NO_GO)
        if accepted:
            s.masks[j] = h["mask"]
            s.mask_lists[j] = (h.get("part_digests") or [None] * s.k, h.get("norms") or [None] * s.k)
            if s.public[j]:  # the private members' norms, as public member j heard them
                s.relayed[j] = {int(q): v for q, v in (h.get("relayed_norms") or {}).items() if not s.public[int(q)]}
            s.mask_digests[j] = h.get("contrib_digests", [])
            s.mask_misquoted[j] = set(h.get("misquoted", []))
        return accepted

    async def _read_norm(self, s: Session, j: int, reader: asyncio.StreamReader, sumsq: float) -> str | None:
        """A scatter's last frame: the norm member j states for its contribution, which must be what
        its data has (`sumsq`, as decoded); None, or "norm"."""
        raw = await streams.read_frame(reader, wire.NORM_FRAME_BYTES)
        s.bytes_received += streams.LENGTH_PREFIX + len(raw)
        try:
            s.norms[j] = wire.unpack_norm(raw)
        except wire.WireError:
            return "norm"
        return None if aggregate.norm_matches(s.norms[j], sumsq) else "norm"

    async def _read_payload(self, s: Session, h: dict, reader, store: Callable) -> str | None:
        """Read, decode and check the chunks announced by `h`, handing each to
        ``store(a, b, values, data)`` as it lands; None, or the reason it stopped."""
        for a, b in wire.chunk_ranges(h["numel"], h["chunk"]):
            data = await streams.read_frame(reader, wire.encoded_size(b - a, h["comp"]))
            s.bytes_received += streams.LENGTH_PREFIX + len(data)
            try:
                values = wire.decode(data, b - a, h["comp"])
            except wire.WireError:
                return "shape"
            if not wire.is_finite(values):
                return "nan"
            store(a, b, values, data)
            await s.notify()
        return None


async def _frames(frames: Frames) -> AsyncIterator[bytes]:
    if isinstance(frames, AsyncIterator):
        async for data in frames:
            yield data
    else:
        for data in frames:
            yield data
