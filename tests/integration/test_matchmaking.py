"""Group formation on a real swarm: 4 hivemind DHT peers (each its own p2pd) on loopback.

All matchmakers run on one BackgroundLoop in this process, each scenario as one coroutine, so
ordering is expressed with awaits and events, never with sleeps. Every scenario uses its own
run id (hence its own DHT keys and stream protocol), so scenarios cannot see each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import struct
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from hivemind.utils import get_dht_time

from diloco_p2p.swarm.membership import matchmaking as mm
from diloco_p2p.swarm.membership.matchmaking import Group, Matchmaker
from tests.harness.loopback import LoopbackPeers

HASH_A = "a" * 64
HASH_B = "b" * 64
_run_ids = itertools.count()


class MatchmakingPeers(LoopbackPeers):
    @contextlib.asynccontextmanager
    async def matchmakers(self, n: int) -> AsyncIterator[list[Matchmaker]]:
        """`n` started matchmakers of a fresh run id, stopped on exit."""
        run_id = f"mmtest{next(_run_ids)}"
        mms = [Matchmaker(self.dhts[i], self.p2ps[i], run_id=run_id) for i in range(n)]
        for m in mms:
            await m.start()
        try:
            yield mms
        finally:
            for m in mms:
                await m.stop()


@pytest.fixture(scope="module")
def swarm() -> Iterator[MatchmakingPeers]:
    # hivemind's MPFuture state is shared fd-based (tests/conftest.py): with torch's default
    # `file_system` strategy, about one run in four aborted the interpreter at exit here.
    with MatchmakingPeers(4) as peers:
        yield peers


def _form(m: Matchmaker, round: int = 1, params_hash: str = HASH_A, weight: float = 1.0, **kw):
    kw.setdefault("min_group_size", 2)
    kw.setdefault("target_group_size", 3)
    kw.setdefault("timeout", 2.0)
    return asyncio.ensure_future(m.form_group(round, params_hash, weight, **kw))


async def _until(condition, limit: float = 10.0) -> None:
    """Wait until `condition()` holds (a state we caused and wait to observe, not an order we hope for)."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _members(m: Matchmaker, key: str) -> int:
    session = m._sessions.get(key)
    return 0 if session is None or session.epoch is None else len(session.epoch.members)


def _assert_same_group(groups: list[Group | None], mms: list[Matchmaker]) -> None:
    assert all(isinstance(g, Group) for g in groups), groups
    ids = {g.group_id for g in groups}
    assert len(ids) == 1, ids
    order = [p.to_base58() for p in groups[0].peers]
    assert order == sorted(m.me for m in mms)
    for g, m in zip(groups, mms, strict=True):
        assert [p.to_base58() for p in g.peers] == order
        assert g.peers[g.my_index].to_base58() == m.me
        assert g.weights == groups[0].weights
        assert g.leader == groups[0].leader


def test_three_peers_group_as_soon_as_target_is_reached(swarm: MatchmakingPeers) -> None:
    timeout = 10.0

    async def scenario():
        async with swarm.matchmakers(3) as mms:
            t0 = time.perf_counter()
            groups = await asyncio.gather(*[
                _form(m, round=7, weight=float(i + 1), target_group_size=3, timeout=timeout) for i, m in enumerate(mms)
            ])
            return groups, time.perf_counter() - t0, mms

    groups, elapsed, mms = swarm.loop.run(scenario(), timeout=30)
    _assert_same_group(groups, mms)
    assert groups[0].size == 3
    assert groups[0].weights == {m.me: float(i + 1) for i, m in enumerate(mms)}
    assert all(m.last_outcome == mm.GROUP for m in mms)
    assert elapsed < timeout / 2, f"target was reached, yet formation took {elapsed:.2f}s"
    print(f"\n3-peer group formation: {elapsed * 1000:.0f} ms")


def test_different_rounds_never_group(swarm: MatchmakingPeers) -> None:
    timeout = 2.0

    async def scenario():
        async with swarm.matchmakers(3) as mms:
            t0 = time.perf_counter()
            tasks = [_form(mms[0], round=5, target_group_size=2, timeout=timeout),
                     _form(mms[1], round=5, target_group_size=2, timeout=timeout),
                     _form(mms[2], round=6, target_group_size=2, timeout=timeout)]
            pair = await asyncio.gather(*tasks[:2])
            pair_s = time.perf_counter() - t0
            lone = await tasks[2]
            return pair, pair_s, lone, time.perf_counter() - t0, mms

    pair, pair_s, lone, lone_s, mms = swarm.loop.run(scenario(), timeout=30)
    _assert_same_group(pair, mms[:2])
    assert pair_s < timeout  # target 2 reached: no need to wait for the deadline
    assert lone is None and mms[2].last_outcome == mm.ALONE
    assert timeout * 0.9 <= lone_s <= timeout + mm.default_request_timeout(timeout) + 0.5


def test_different_params_hash_never_group(swarm: MatchmakingPeers) -> None:
    timeout = 2.0

    async def scenario():
        async with swarm.matchmakers(4) as mms:
            hashes = [HASH_A, HASH_B, HASH_A, HASH_B]
            return await asyncio.gather(*[
                _form(m, params_hash=h, target_group_size=4, timeout=timeout) for m, h in zip(mms, hashes, strict=True)
            ]), mms

    groups, mms = swarm.loop.run(scenario(), timeout=30)
    # target 4 is never reached: each hash's pair closes at its leader's deadline
    _assert_same_group([groups[0], groups[2]], [mms[0], mms[2]])
    _assert_same_group([groups[1], groups[3]], [mms[1], mms[3]])
    assert groups[0].group_id != groups[1].group_id


def test_late_peer_after_deadline_close_is_late_and_does_not_disturb(swarm: MatchmakingPeers) -> None:
    timeout = 2.0

    async def scenario():
        async with swarm.matchmakers(3) as mms:
            committed = await asyncio.gather(*[_form(m, timeout=timeout) for m in mms[:2]])  # closes at deadline
            t0 = time.perf_counter()
            late = await _form(mms[2], timeout=timeout)
            return committed, late, time.perf_counter() - t0, mms

    committed, late, late_s, mms = swarm.loop.run(scenario(), timeout=30)
    _assert_same_group(committed, mms[:2])
    assert mms[2].me not in {p.to_base58() for p in committed[0].peers}
    assert late is None and mms[2].last_outcome == mm.LATE
    assert late_s < timeout / 2, f"a late peer should learn it missed the round at once, took {late_s:.2f}s"


def test_late_peer_after_full_close_ends_alone(swarm: MatchmakingPeers) -> None:
    timeout = 2.0

    async def scenario():
        async with swarm.matchmakers(3) as mms:
            committed = await asyncio.gather(*[_form(m, target_group_size=2, timeout=timeout) for m in mms[:2]])
            late = await _form(mms[2], target_group_size=2, timeout=timeout)
            return committed, late, mms

    committed, late, mms = swarm.loop.run(scenario(), timeout=30)
    _assert_same_group(committed, mms[:2])
    # a full group does not close the round: the late peer could still have grouped with others
    assert late is None and mms[2].last_outcome == mm.ALONE


def test_group_below_min_size_is_void_on_every_member(swarm: MatchmakingPeers) -> None:
    timeout = 2.0

    async def scenario():
        async with swarm.matchmakers(2) as mms:
            return await asyncio.gather(*[
                _form(m, min_group_size=3, target_group_size=4, timeout=timeout) for m in mms
            ]), mms

    groups, mms = swarm.loop.run(scenario(), timeout=30)
    assert groups == [None, None]
    assert [m.last_outcome for m in mms] == [mm.VOID, mm.VOID]


async def _form_until_registered(leader: Matchmaker, park: bool = False, freeze: bool = False,
                                 **kw) -> asyncio.Future:
    """Start `_form(leader, **kw)`; return it once the leader has registered. `park`: it then waits
    there forever; `freeze`: and its join handlers stop answering too (as under SIGSTOP)."""
    registered = asyncio.Event()

    async def on_registered():
        leader._frozen = freeze
        registered.set()
        if park:
            await asyncio.Event().wait()

    leader._after_register = on_registered
    task = _form(leader, **kw)
    await registered.wait()
    return task


async def _cancel_parked(leader: Matchmaker, task: asyncio.Future) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    leader._after_register = None  # a closure over `leader`: keep the matchmaker out of a gc cycle


def test_frozen_leader_is_skipped_within_the_deadline(swarm: MatchmakingPeers) -> None:
    """The best-placed peer registers, then stops answering with its socket open (SIGSTOP)."""
    timeout = 4.0

    async def scenario():
        async with swarm.matchmakers(3) as mms:
            leader, others = mms[0], mms[1:]
            stuck = await _form_until_registered(leader, park=True, freeze=True, timeout=timeout)
            try:
                t0 = time.perf_counter()
                groups = await asyncio.gather(*[_form(m, timeout=timeout) for m in others])
                return groups, time.perf_counter() - t0, others, leader
            finally:
                await _cancel_parked(leader, stuck)

    groups, elapsed, others, leader = swarm.loop.run(scenario(), timeout=30)
    assert elapsed <= timeout + mm.default_request_timeout(timeout) + 0.5
    _assert_same_group(groups, others)
    assert leader.me not in {p.to_base58() for p in groups[0].peers}


def test_cancelled_leader_is_skipped_quickly(swarm: MatchmakingPeers) -> None:
    timeout = 4.0

    async def scenario():
        async with swarm.matchmakers(3) as mms:
            leader, others = mms[0], mms[1:]
            await _cancel_parked(leader, await _form_until_registered(leader, park=True, timeout=timeout))
            t0 = time.perf_counter()
            groups = await asyncio.gather(*[_form(m, target_group_size=2, timeout=timeout) for m in others])
            return groups, time.perf_counter() - t0, others

    groups, elapsed, others = swarm.loop.run(scenario(), timeout=30)
    _assert_same_group(groups, others)
    assert elapsed < timeout / 2


def test_registration_is_withdrawn(swarm: MatchmakingPeers) -> None:
    async def scenario():
        async with swarm.matchmakers(2) as mms:
            await asyncio.gather(*[_form(m, target_group_size=2) for m in mms])
            await asyncio.gather(*mms[0]._background, *mms[1]._background)  # the withdrawal stores
            key = mm.matchmaking_key(mms[0].run_id, 1, HASH_A)
            found = await swarm.dhts[0].get(key, latest=True, return_future=True)
            return {p: v.value for p, v in found.value.items()}, mms

    entries, mms = swarm.loop.run(scenario(), timeout=30)
    assert set(entries) == {m.me for m in mms}
    assert all(v["done"] == "full" for v in entries.values()), entries
    assert all(v["t"] <= get_dht_time() for v in entries.values())


def test_a_held_withdrawal_waits_for_release(swarm: MatchmakingPeers) -> None:
    """With `hold_withdrawal` the registrations stay live until `release()` (the caller's
    all-reduce runs meanwhile), then become the same ``done`` markers."""

    async def entries(mms: list[Matchmaker]) -> dict:
        await asyncio.gather(*mms[0]._background, *mms[1]._background)  # withdrawal stores, if any
        key = mm.matchmaking_key(mms[0].run_id, 1, HASH_A)
        found = await swarm.dhts[0].get(key, latest=True, return_future=True)
        return {p: v.value for p, v in found.value.items()}

    async def scenario():
        async with swarm.matchmakers(2) as mms:
            groups = await asyncio.gather(*[_form(m, target_group_size=2, hold_withdrawal=True) for m in mms])
            held = await entries(mms)
            for m in mms:
                m.release()
            return groups, held, await entries(mms), mms

    groups, held, released, mms = swarm.loop.run(scenario(), timeout=30)
    _assert_same_group(groups, mms)
    assert set(held) == set(released) == {m.me for m in mms}
    assert not any("done" in v for v in held.values()), held
    assert all(v["done"] == "full" for v in released.values()), released


def test_leader_forfeits_to_an_earlier_registration(swarm: MatchmakingPeers) -> None:
    """`early` takes its registration time first but stores it last: `a` leads `c` meanwhile, then
    sees `early`, forfeits, redirects `c`, and all three end in `early`'s group."""
    timeout = 6.0

    async def scenario():
        async with swarm.matchmakers(3) as mms:
            early, a, c = mms
            key = mm.matchmaking_key(early.run_id, 1, HASH_A)
            release = asyncio.Event()
            early._before_register = release.wait
            tasks = [_form(early, timeout=timeout)]
            try:
                await _until(lambda: key in early._sessions)
                tasks.append(_form(a, timeout=timeout))
                await _until(lambda: key in a._sessions)
                tasks.append(_form(c, timeout=timeout))
                await _until(lambda: _members(a, key) == 2)  # c follows a
                release.set()
                t0 = time.perf_counter()
                groups = await asyncio.gather(*tasks)
                return groups, time.perf_counter() - t0, mms
            finally:
                early._before_register = None

    groups, elapsed, mms = swarm.loop.run(scenario(), timeout=30)
    _assert_same_group(groups, mms)
    assert groups[0].leader.to_base58() == mms[0].me
    assert elapsed < timeout / 2  # target 3 reached right after the forfeit


def test_malformed_join_requests_are_refused_without_disturbing(swarm: MatchmakingPeers) -> None:
    timeout = 4.0

    async def scenario():
        async with swarm.matchmakers(3) as mms:
            leader, follower, attacker = mms
            try:
                lead = await _form_until_registered(leader, target_group_size=2, timeout=timeout)
                key = mm.matchmaking_key(leader.run_id, 1, HASH_A)
                good = {"v": 1, "key": key, "h": HASH_A, "t": 0.0, "w": 1.0, "hb": 0.5}
                replies = []
                for payload in (
                    struct.pack(">I", 1 << 31),  # a frame far over the size limit
                    _frame({**good, "w": float("nan")}),
                    _frame({**good, "h": HASH_B}),
                    _frame({**good, "v": 99}),
                    _frame({**good, "key": key + "x"}),
                    _frame([1, 2, 3]),
                ):
                    _, reader, writer = await attacker.p2p.call_binary_stream_handler(leader.p2p.peer_id, leader.protocol)
                    writer.write(payload)
                    await writer.drain()
                    try:  # one reply frame, or the stream just ends
                        replies.append(await asyncio.wait_for(mm._recv_frame(reader), 10))
                    except asyncio.IncompleteReadError:
                        replies.append(None)
                    writer.close()
                assert _members(leader, key) == 1
                group = await _form(follower, target_group_size=2, timeout=timeout)
                return replies, [await lead, group], mms
            finally:
                leader._after_register = None

    replies, groups, mms = swarm.loop.run(scenario(), timeout=30)
    assert replies == [
        None,
        {"s": "closed", "reason": "bad_request"},
        {"s": "closed", "reason": "bad_request"},
        {"s": "closed", "reason": "bad_request"},
        {"s": "closed", "reason": "unknown"},
        None,
    ]
    _assert_same_group(groups, mms[:2])


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


def test_leader_keeps_each_stream_open_until_the_follower_has_closed_it(swarm: MatchmakingPeers, monkeypatch) -> None:
    """Under CPU load a leader that closed its end right after writing the answer counted a follower
    that read EOF with 0 bytes: the two disagreed on the group. The leader now closes only after the
    follower (which closes once it has read the answer), and within `_LINGER_TIMEOUT` otherwise."""
    timeout = 4.0

    async def scenario():
        async with swarm.matchmakers(2) as mms:
            leader, client = mms
            try:
                lead = await _form_until_registered(leader, target_group_size=2, timeout=timeout)
                key = mm.matchmaking_key(leader.run_id, 1, HASH_A)
                join = _frame({"v": 1, "key": key, "h": HASH_A, "t": 0.0, "w": 1.0, "hb": 0.5})
                _, reader, writer = await client.p2p.call_binary_stream_handler(leader.p2p.peer_id, leader.protocol)
                writer.write(join)
                await writer.drain()
                frames = [await asyncio.wait_for(mm._recv_frame(reader), 10) for _ in range(2)]
                group = await lead
                held_after_answer = len(leader._handler_tasks)  # the answer is out: is the stream still held?
                writer.close()
                await _until(lambda: not leader._handler_tasks)  # our close ends it

                # A follower that never closes holds a handler for at most _LINGER_TIMEOUT.
                monkeypatch.setattr(mm, "_LINGER_TIMEOUT", 0.2)
                _, reader, writer = await client.p2p.call_binary_stream_handler(leader.p2p.peer_id, leader.protocol)
                writer.write(join)
                await writer.drain()
                late = await asyncio.wait_for(mm._recv_frame(reader), 10)
                await _until(lambda: not leader._handler_tasks)
                rest = await asyncio.wait_for(reader.read(), 10)  # then the leader closes
                writer.close()
                return frames, group, held_after_answer, late, rest, mms
            finally:
                leader._after_register = None

    frames, group, held_after_answer, late, rest, mms = swarm.loop.run(scenario(), timeout=30)
    assert [f["s"] for f in frames] == ["wait", "group"]
    assert frames[1]["id"] == group.group_id and frames[1]["peers"] == sorted(m.me for m in mms)
    assert held_after_answer == 1, "the leader closed the stream before the follower had closed it"
    assert late == {"s": "closed", "reason": "full"} and rest == b""


def test_group_filled_before_the_leaders_first_read_binds_the_leader(swarm: MatchmakingPeers) -> None:
    """`c` registers; `d` and `e` join it and its group fills (c, d, e) while `c` is still reading the
    DHT for the first time. That read shows `early`, which precedes `c`. The group is closed and `d`
    and `e` hold its answer: `c` must keep it, not follow `early` into another group."""
    timeout = 4.0

    async def scenario():
        async with swarm.matchmakers(4) as mms:
            early, c, d, e = mms
            key = mm.matchmaking_key(early.run_id, 1, HASH_A)
            release_early, early_stored = asyncio.Event(), asyncio.Event()
            c_registered, release_c = asyncio.Event(), asyncio.Event()

            async def early_after():
                early_stored.set()

            async def c_after():
                c_registered.set()
                await release_c.wait()

            early._before_register, early._after_register = release_early.wait, early_after
            c._after_register = c_after
            tasks = [_form(early, timeout=timeout)]
            try:
                await _until(lambda: key in early._sessions)  # early's registration time is the smallest
                tasks.append(_form(c, timeout=timeout))
                await c_registered.wait()
                tasks += [_form(d, timeout=timeout), _form(e, timeout=timeout)]
                de = await asyncio.gather(*tasks[2:])  # they join c: the group fills and closes
                release_early.set()
                await early_stored.wait()
                release_c.set()  # c's first read now shows early
                return [await tasks[0], await tasks[1], *de], mms
            finally:
                release_early.set()
                release_c.set()
                await asyncio.gather(*tasks, return_exceptions=True)
                early._before_register = early._after_register = c._after_register = None

    (early_group, *groups), mms = swarm.loop.run(scenario(), timeout=30)
    _assert_same_group(groups, mms[1:])
    assert groups[0].leader.to_base58() == mms[1].me
    assert early_group is None and mms[0].last_outcome == mm.ALONE


def test_group_closes_once_the_expected_swarm_is_in_and_waits_for_a_quiet_peer(swarm: MatchmakingPeers) -> None:
    """Target 8 is never reached: three peers that expect each other close at once; when a fourth
    expected peer stays quiet, the three wait for it until the deadline."""
    timeout = 4.0

    async def form(mms: list[Matchmaker], round: int, expected: list[str]):
        t0 = time.perf_counter()
        groups = await asyncio.gather(*[
            _form(m, round=round, target_group_size=8, timeout=timeout, expected=expected, speed=100.0 * (i + 1))
            for i, m in enumerate(mms)
        ])
        return groups, time.perf_counter() - t0

    async def scenario():
        async with swarm.matchmakers(4) as mms:
            live = [m.me for m in mms[:3]]
            quick = await form(mms[:3], 1, live)
            t0 = time.perf_counter()
            late = await _form(mms[3], round=1, target_group_size=8, timeout=timeout)  # not expected, after close
            late_s = time.perf_counter() - t0
            slow = await form(mms[:3], 2, live + [mms[3].me])
            return quick, (late, late_s), slow, mms

    (quick, quick_s), (late, late_s), (slow, slow_s), mms = swarm.loop.run(scenario(), timeout=30)
    # the live swarm did round 1 without the 4th: it learns so at once and catches up
    assert late is None and mms[3].last_outcome == mm.LATE and late_s < timeout / 2, (late, late_s)
    _assert_same_group(quick, mms[:3])
    _assert_same_group(slow, mms[:3])
    # every member learns every member's compute speed (dynamic local updates)
    assert all(g.speeds == {m.me: 100.0 * (i + 1) for i, m in enumerate(mms[:3])} for g in quick + slow)
    assert quick_s < timeout / 2, f"everyone expected was in, yet formation took {quick_s:.2f}s"
    assert slow_s >= timeout * 0.9, f"a quiet expected peer was not waited for ({slow_s:.2f}s)"
    # the leader's wait reaches every member alike: a sample for the adaptive deadline (`liveness`)
    assert len({g.wait for g in quick}) == 1 and 0 <= quick[0].wait < quick_s
    assert len({g.wait for g in slow}) == 1 and timeout * 0.9 <= slow[0].wait <= slow_s  # closed at the deadline
    print(f"\n3 expected peers: {quick_s * 1000:.0f} ms; with a quiet 4th: {slow_s:.2f} s")


def test_a_quiet_expected_peer_is_waited_for_only_until_the_adaptive_deadline(swarm: MatchmakingPeers) -> None:
    """`close_after` (the deadline a node learnt) closes the leader's group early; a follower
    whose own deadline is shorter than its leader's still waits for the leader's answer."""
    timeout, close_after = 20.0, 1.0

    async def scenario():
        async with swarm.matchmakers(4) as mms:
            quiet = mms[3].me  # expected, never comes
            t0 = time.perf_counter()
            leader = _form(mms[0], round=1, target_group_size=8, timeout=timeout, expected=[m.me for m in mms[1:]],
                           close_after=close_after)
            await _until(lambda: _members(mms[0], mm.matchmaking_key(mms[0].run_id, 1, HASH_A)) >= 1)
            followers = [_form(m, round=1, target_group_size=8, timeout=timeout, expected=[quiet], close_after=0.1)
                         for m in mms[1:3]]
            groups = await asyncio.gather(leader, *followers)
            return groups, time.perf_counter() - t0, mms

    groups, elapsed, mms = swarm.loop.run(scenario(), timeout=60)
    _assert_same_group(groups, mms[:3])
    assert all(close_after <= g.wait < close_after + 1.0 for g in groups)  # closed by the adaptive deadline
    assert elapsed < timeout / 2, f"the group waited {elapsed:.1f} s, past its adaptive deadline"


def test_a_leader_rereads_who_it_expects_while_its_group_is_open(swarm: MatchmakingPeers) -> None:
    """The leader's first read saw nobody (its partner started later) or a peer that then left
    the round: with `refresh_expected` it closes when the live swarm is in, not at the timeout."""
    timeout = 4.0

    async def scenario():
        async with swarm.matchmakers(3) as mms:
            leader, partner, gone = mms
            live = {leader.me, partner.me}

            async def refresh():
                return live

            async def pair(round: int, expected: list[str], refresh_expected):
                t0 = time.perf_counter()
                first = _form(leader, round=round, target_group_size=8, timeout=timeout, expected=expected,
                              refresh_expected=refresh_expected)
                await _until(lambda: _members(leader, mm.matchmaking_key(leader.run_id, round, HASH_A)) >= 1)
                second = _form(partner, round=round, target_group_size=8, timeout=timeout, expected=[leader.me])
                return await asyncio.gather(first, second), time.perf_counter() - t0

            unseen = await pair(1, [], refresh)  # the first read was empty
            left = await pair(2, [partner.me, gone.me], refresh)  # `gone` left the round since
            blind = await pair(3, [], None)  # no refresh: nothing expected, the group waits out the timeout
            return unseen, left, blind, mms

    unseen, left, blind, mms = swarm.loop.run(scenario(), timeout=40)
    for groups, _ in (unseen, left, blind):
        _assert_same_group(groups, mms[:2])
    assert unseen[1] < timeout / 2 and left[1] < timeout / 2, (unseen[1], left[1])
    assert blind[1] >= timeout * 0.9, blind[1]
