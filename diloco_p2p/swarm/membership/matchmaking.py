"""Group formation for one DiLoCo round: which peers average their pseudo-gradients together.

Only nodes at the same round with the same θ may average, so a node registers in the DHT under
its round and θ hash and joins the candidate leader with the smallest (registration time, peer
id). The leader closes the group when it is full, when every live peer it expects has joined,
or at its deadline, and hands every member the same answer, or ``None`` (the node ends alone).
Our own protocol rather than hivemind's internal one, for a hard deadline and an answer
identical on every member; failures are data, and a straggler learns it is late. Both sides of
the protocol live here; its pure rules in `grouping`. The protocol: docs/protocol/matchmaking.md
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from diloco_p2p.swarm.membership.grouping import (
    ABORTED,
    ALONE,
    GROUP,
    LATE,
    MAX_WEIGHT,
    PROTOCOL_VERSION,
    TIMEOUT,
    VOID,
    Entry,
    Epoch,
    Final,
    Group,
    Redirect,
    Session,
    finite_number,
    parse_view,
    valid_weight,
)
from diloco_p2p.swarm.transport import streams

# The outcomes `Matchmaker.last_outcome` reports and the `Group` it returns live in `grouping`
# (its pure rules produce them); callers read them from here, with the matchmaker.
__all__ = [
    "ABORTED", "ALONE", "GROUP", "LATE", "TIMEOUT", "VOID",
    "Group", "Matchmaker", "default_request_timeout", "matchmaking_key",
]

logger = logging.getLogger(__name__)

_LENGTH_PREFIX = 4  # bytes of a join frame's big-endian length
_MAX_FRAME_BYTES = 1 << 20  # a member list of thousands of peers fits; anything bigger is hostile
_FINISHED_MEMORY = 64  # how many finished rounds we still answer "closed: <reason>" for
_REQUEST_READ_TIMEOUT = 10.0  # a stream that sends no join request within this is dropped
_ROUND_OVER = ("expired", "complete")  # a group closed so: who comes later has missed the round
_LINGER_TIMEOUT = 10.0  # how long a leader keeps a stream open after its last frame, for the follower to close it


def matchmaking_key(run_id: str, round: int, params_hash: str) -> str:
    return f"{run_id}.mm.{int(round)}.{params_hash[:16]}"


def default_request_timeout(timeout: float) -> float:
    """Ack/heartbeat tolerance: long enough for a loaded machine, short next to the round's timeout."""
    return min(max(timeout / 4, 1.0), 5.0)


# ---------------------------------------------------------------- wire format


async def _send_frame(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    streams.write_json(writer, obj, prefix=_LENGTH_PREFIX, allow_nan=False)
    await writer.drain()


async def _recv_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    return await streams.read_json(reader, _MAX_FRAME_BYTES, prefix=_LENGTH_PREFIX)


async def _send_last(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    """Send a stream's last frame, then keep the stream open until the follower closes it
    (`streams.linger`, at most `_LINGER_TIMEOUT`)."""
    await _send_frame(writer, obj)
    await streams.linger(reader, _LINGER_TIMEOUT)


class Matchmaker:
    """Forms one group per round over the DHT and P2P streams; see the module docstring."""

    def __init__(self, dht: hivemind.DHT, p2p: P2P, *, run_id: str, public: bool = True):
        self.dht, self.p2p, self.run_id, self.public = dht, p2p, run_id, public
        self.me = p2p.peer_id.to_base58()
        self.protocol = f"/diloco-p2p/{run_id}/matchmaking/{PROTOCOL_VERSION}"
        self.last_outcome: str | None = None
        self._sessions: dict[str, Session] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._handler_tasks: set[asyncio.Task] = set()
        self._background: set[asyncio.Task] = set()
        self._held: list[tuple[Session, str]] = []  # withdrawals waiting for `release`
        self._tokens = itertools.count(1)
        self._started = False
        # Whether to serve a peer's stream (its id proven by p2pd): a closed run admits its members
        # only (`diloco_p2p.swarm.trust.admission`); None serves everyone.
        self.admit: Callable[[str, str], Awaitable[bool]] | None = None
        self.distrusted: Callable[[], Collection[str]] = frozenset  # caught reducers (`Guard`): out of our groups
        # Test-only fault injection: awaited right before / after our registration is stored; and,
        # when `_frozen`, join handlers keep the stream open and never answer (a SIGSTOPped peer).
        self._before_register: Callable[[], Awaitable[None]] | None = None
        self._after_register: Callable[[], Awaitable[None]] | None = None
        self._frozen = False

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.protocol, self._handle_join)
        self._started = True

    async def stop(self) -> None:
        if self._started:
            self._started = False
            try:
                await self.p2p.remove_binary_stream_handler(self.protocol)
            except Exception as e:  # the daemon may already be gone at shutdown
                logger.debug("removing the matchmaking handler failed: %r", e)
        for session in self._sessions.values():
            if session.epoch is not None and not session.epoch.answer.done():
                session.epoch.answer.set_result({"s": "closed", "reason": "aborted"})
        for task in list(self._handler_tasks) + list(self._background):
            task.cancel()
        await asyncio.gather(*self._handler_tasks, *self._background, return_exceptions=True)

    # ------------------------------------------------------------ the caller's side

    async def form_group(
        self,
        round: int,
        params_hash: str,
        weight: float,
        *,
        min_group_size: int,
        target_group_size: int,
        timeout: float,
        request_timeout: float | None = None,
        expected: Collection[str] = (),
        refresh_expected: Callable[[], Awaitable[Collection[str]]] | None = None,
        speed: float = 0.0,
        hold_withdrawal: bool = False,
        close_after: float | None = None,
    ) -> Group | None:
        """Find the peers at `round` with `params_hash`; our group, or None if we end alone, within
        ``timeout + request_timeout``. A group we lead closes once every peer in `expected` (re-read by
        `refresh_expected`) has joined, or `close_after` seconds after our registration; `weight` and
        `speed` reach every member; `hold_withdrawal` defers our withdrawal to `release()`."""
        if not self._started:
            raise RuntimeError("Matchmaker.start() must be awaited before form_group()")
        if not valid_weight(weight):
            raise ValueError(f"weight must be a finite number in [0, {MAX_WEIGHT:g}], got {weight!r}")
        if not (1 <= min_group_size <= target_group_size) or not timeout > 0:
            raise ValueError("need 1 <= min_group_size <= target_group_size and timeout > 0")
        request_timeout = default_request_timeout(timeout) if request_timeout is None else request_timeout
        self.release()  # one held since an earlier round whose all-reduce never ran (interrupted): now
        key = matchmaking_key(self.run_id, round, params_hash)
        if key in self._sessions:
            raise RuntimeError(f"form_group for {key} is already running")
        session = Session(
            key=key, round=int(round), params_hash=params_hash, me=self.me, t=get_dht_time(),
            weight=float(weight), min_size=min_group_size, target=target_group_size, timeout=timeout,
            request_timeout=request_timeout, expected=frozenset(expected) - {self.me}, refresh=refresh_expected,
            speed=float(speed) if valid_weight(speed) else 0.0, public=self.public, close_after=close_after)
        session.lead()  # serve join requests from the start: they may arrive before our first read
        self._sessions[key] = session
        final = Final(None, TIMEOUT)
        try:
            final = await asyncio.wait_for(self._run(session), session.deadline - get_dht_time())
        except TimeoutError:
            logger.debug("%s: matchmaking deadline fired", key)
            final = self._closed_epoch(session) or final
        except asyncio.CancelledError:
            final = Final(None, ABORTED)
            raise
        finally:
            if session.epoch is not None and not session.epoch.answer.done():
                session.epoch.answer.set_result({"s": "closed", "reason": "aborted"})
            del self._sessions[key]
            reason = final.close_reason or ("expired" if final.outcome == LATE else "void")
            self._finished[key] = reason
            while len(self._finished) > _FINISHED_MEMORY:
                self._finished.popitem(last=False)
            self.last_outcome = final.outcome
            if hold_withdrawal and final.group is not None:
                self._held.append((session, reason))
            else:
                self._spawn(self._withdraw(session, reason))
        logger.debug("%s: %s (%s)", key, final.outcome, final.group and final.group.group_id)
        return final.group

    async def _run(self, session: Session) -> Final:
        if self._before_register is not None:
            await self._before_register()
        await self._register(session)
        if self._after_register is not None:
            await self._after_register()
        excluded: set[str] = set(self.distrusted())  # reducers caught lately: not followed
        view: dict[str, Entry] = {}
        first = True
        while True:
            view = await self._read_view(session) or view
            closed = self._closed_epoch(session)
            if closed is not None:
                return closed  # joiners filled our group while we read: they hold its answer, so it binds us
            if first and any(e.done in _ROUND_OVER for p, e in view.items() if p != self.me):
                return Final(None, LATE)  # a committed group of this round closed at its deadline or complete
            first = False
            best = session.best_candidate(view, excluded)
            if best is None:
                result = await self._lead(session, excluded)
                if isinstance(result, Final):
                    return result
                target = result  # _lead forfeited to this candidate
            else:
                session.follow(best.peer, best.t)
                target = best
            while True:
                outcome = await self._follow(session, target.peer)
                if isinstance(outcome, Final):
                    return outcome
                if (
                    isinstance(outcome, Redirect)
                    and outcome.to not in excluded
                    and outcome.to != self.me
                    and session.precedes(outcome.t, outcome.to)
                ):
                    target = Entry(outcome.to, outcome.t, 0.0, None)
                    session.follow(outcome.to, outcome.t)
                    continue
                excluded.add(target.peer)
                break
            session.lead()  # lead again while we look at the view: arrivals are served meanwhile

    def _closed_epoch(self, session: Session) -> Final | None:
        """Our result if the group we lead has already closed (its members got the answer), else None."""
        epoch = session.epoch
        if epoch is None or not epoch.answer.done():
            return None
        return session.final(epoch.answer.result(), own=True)

    async def _lead(self, session: Session, excluded: set[str]) -> Final | Entry:
        """Lead until our group closes (a `Final`), or forfeit to a better candidate (returned)."""
        epoch = session.epoch
        assert epoch is not None
        poll = session.request_timeout / 2
        self._close_if_due(session, epoch)
        while not epoch.answer.done():
            remaining = session.close_at - get_dht_time()
            if remaining <= 0:
                session.close(epoch, self.run_id, "expired", get_dht_time())
                break
            await asyncio.wait({epoch.answer}, timeout=min(poll, remaining))
            if epoch.answer.done():
                break
            # Bounded by the time left, so a slow DHT cannot push our close past `close_at`.
            remaining = session.close_at - get_dht_time()
            view = await self._read_view(session, timeout=min(session.request_timeout, max(remaining, 0.01)))
            await self._refresh_expected(session)
            self._close_if_due(session, epoch)
            best = session.best_candidate(view or {}, excluded)
            if best is not None and not epoch.answer.done():
                logger.debug("%s: forfeiting leadership to %s", session.key, best.peer)
                session.follow(best.peer, best.t)
                return best
        # Our own answer is well formed; anything else means stop() aborted the round.
        return session.final(epoch.answer.result(), own=True) or Final(None, ABORTED)

    async def _follow(self, session: Session, leader: str) -> Final | Redirect | None:
        """Ask `leader` to take us in; a final result, a redirect, or None (give up on this leader)."""
        rt = session.request_timeout
        writer: asyncio.StreamWriter | None = None
        try:
            _, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(leader), self.protocol), rt
            )
            await _send_frame(writer, {
                "v": PROTOCOL_VERSION, "key": session.key, "h": session.params_hash,
                "t": session.t, "w": session.weight, "hb": rt / 3, "sp": session.speed, "pub": session.public,
            })
            while True:
                remaining = session.deadline - get_dht_time()
                if remaining <= 0:
                    return Final(None, TIMEOUT)
                try:
                    msg = await asyncio.wait_for(_recv_frame(reader), min(rt, remaining))
                except TimeoutError:
                    if session.deadline - get_dht_time() <= 0:
                        return Final(None, TIMEOUT)
                    logger.debug("%s: leader %s went silent", session.key, leader)
                    return None
                status = msg.get("s")
                if status == "wait":
                    continue
                if status in ("group", "void"):
                    return session.final(msg, own=False)
                if status == "redirect" and isinstance(msg.get("to"), str) and finite_number(msg.get("t")):
                    return Redirect(msg["to"], float(msg["t"]))
                if status == "closed" and msg.get("reason") in _ROUND_OVER:
                    return Final(None, LATE)
                logger.debug("%s: leader %s answered %s", session.key, leader, msg)
                return None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # unreachable, reset, malformed: this leader is out for this round
            logger.debug("%s: joining %s failed: %r", session.key, leader, e)
            return None
        finally:
            if writer is not None:
                writer.close()

    # ------------------------------------------------------------ the leader's side

    async def _handle_join(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handler_tasks.add(task)
        try:
            if self.admit is not None and not await self.admit(info.peer_id.to_base58(), "matchmaking"):
                return
            await self._serve_join(info.peer_id.to_base58(), reader, writer)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # a follower that vanished or spoke garbage; nothing to propagate
            logger.debug("join handler for %s failed: %r", info.peer_id, e)
        finally:
            self._handler_tasks.discard(task)
            writer.close()

    async def _serve_join(self, follower: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await asyncio.wait_for(_recv_frame(reader), _REQUEST_READ_TIMEOUT)
        if self._frozen:
            await asyncio.Event().wait()  # test-only: hold the socket, never answer
        key, hb = request.get("key"), request.get("hb")
        session = self._sessions.get(key) if isinstance(key, str) else None
        if session is None:
            reason = self._finished.get(key, "unknown") if isinstance(key, str) else "bad_request"
            await _send_last(reader, writer, {"s": "closed", "reason": reason})
            return
        if session.rejects(request, follower) or follower in self.distrusted():
            await _send_last(reader, writer, {"s": "closed", "reason": "bad_request"})
            return
        hb = min(max(float(hb), 0.05), 10.0)
        if session.following is not None:
            leader, leader_t = session.following
            await _send_last(reader, writer, {"s": "redirect", "to": leader, "t": leader_t})
            return
        epoch = session.epoch
        assert epoch is not None
        if epoch.answer.done():
            answer = epoch.answer.result()
            if answer.get("s") != "redirect":
                answer = {"s": "closed", "reason": epoch.close_reason or "void"}
            await _send_last(reader, writer, answer)
            return

        token = next(self._tokens)
        epoch.members[follower] = (float(request["w"]), token)
        epoch.speeds[follower] = float(request["sp"]) if valid_weight(request.get("sp")) else 0.0
        epoch.public[follower] = request.get("pub") is not False
        gone = asyncio.ensure_future(reader.read(1))  # EOF (or anything) = the follower left
        try:
            await _send_frame(writer, {"s": "wait"})
            self._close_if_due(session, epoch)
            while not epoch.answer.done():
                await asyncio.wait({epoch.answer, gone}, timeout=hb, return_when=asyncio.FIRST_COMPLETED)
                if epoch.answer.done():
                    break
                if gone.done() or get_dht_time() > session.deadline:
                    self._drop(epoch, follower, token)
                    return
                try:
                    await _send_frame(writer, {"s": "wait"})
                except (ConnectionError, OSError):
                    self._drop(epoch, follower, token)
                    return
            answer = epoch.answer.result()
            if answer.get("s") == "group" and follower not in answer["peers"]:
                answer = {"s": "closed", "reason": "full"}  # replaced by a newer stream of the same peer
            await _send_frame(writer, answer)
            await asyncio.wait({gone}, timeout=_LINGER_TIMEOUT)  # see `_send_last`
        finally:
            gone.cancel()
            if not epoch.answer.done():
                self._drop(epoch, follower, token)

    async def _refresh_expected(self, session: Session) -> None:
        """Read the live swarm again (`form_group`'s `refresh_expected`), within the time left
        before we close; a failed or slow read keeps what we expected."""
        remaining = session.close_at - get_dht_time()
        if session.refresh is None or remaining <= 0:
            return
        try:
            expected = await asyncio.wait_for(session.refresh(), min(session.request_timeout, remaining))
        except Exception as e:  # no fresh view of the swarm: keep the one we have
            logger.debug("%s: could not refresh the expected peers (%r)", session.key, e)
            return
        session.expected = frozenset(expected) - {self.me}

    def _close_if_due(self, session: Session, epoch: Epoch) -> None:
        """Close the group we lead if it is full or everyone we expect is in (`Session.closing_reason`)."""
        reason = session.closing_reason(epoch)
        if reason is not None:
            session.close(epoch, self.run_id, reason, get_dht_time())

    @staticmethod
    def _drop(epoch: Epoch, follower: str, token: int) -> None:
        """Remove a follower that left before the group closed (only the stream that added it)."""
        if not epoch.answer.done() and epoch.members.get(follower, (0.0, -1))[1] == token:
            del epoch.members[follower]

    # ------------------------------------------------------------ DHT

    async def _register(self, session: Session) -> None:
        value = {"t": session.t, "w": session.weight, "pub": session.public}
        ok = await self._dht_call(
            self.dht.store, session.key, value, self._expiration(session), subkey=self.me,
            timeout=session.request_timeout,
        )
        if not ok:
            logger.warning("%s: could not register for matchmaking in the DHT; others may not find us", session.key)

    def release(self) -> None:
        """Withdraw the registrations `form_group` held back (call on the P2P loop once the
        group's all-reduce is over)."""
        held, self._held = self._held, []
        for session, reason in held:
            self._spawn(self._withdraw(session, reason))

    async def _withdraw(self, session: Session, reason: str) -> None:
        value = {"t": session.t, "w": session.weight, "pub": session.public, "done": reason}
        # A later expiration than the registration's: hivemind keeps the newest value of a subkey.
        await self._dht_call(
            self.dht.store, session.key, value, self._expiration(session) + 1.0, subkey=self.me,
            timeout=session.request_timeout,
        )

    @staticmethod
    def _expiration(session: Session) -> float:
        return session.t + 2 * (session.timeout + session.request_timeout)

    async def _read_view(self, session: Session, timeout: float | None = None) -> dict[str, Entry] | None:
        """The registrations under our key, or None if the DHT did not answer in time."""
        timeout = session.request_timeout if timeout is None else timeout
        result = await self._dht_call(self.dht.get, session.key, latest=True, timeout=timeout)
        return None if result is False else parse_view(result)

    @staticmethod
    async def _dht_call(method: Callable[..., Any], *args: Any, timeout: float, **kwargs: Any) -> Any:
        """Run a DHT facade call without blocking the loop; False if it failed or took too long."""
        future = method(*args, return_future=True, **kwargs)

        async def _wait() -> Any:
            return await future

        try:
            return await asyncio.wait_for(_wait(), timeout)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as e:
            future.cancel()
            logger.debug("DHT %s failed: %r", getattr(method, "__name__", method), e)
            return False

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
