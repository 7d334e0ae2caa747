"""In-memory stand-ins for hivemind's DHT and P2P, for measuring the membership protocol at sizes
no test machine can start daemons for: hundreds of `Matchmaker`s in one event loop.

`MemoryDHT` keeps one dictionary of (key, subkey) -> (value, expiration) with hivemind's rule
(the later expiration wins) and counts, per node, the gets and stores it served and the entries
each get returned. `MemoryP2P` connects binary stream handlers with asyncio pipes. Both implement
only what `diloco_p2p.swarm.membership.matchmaking` calls.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from types import SimpleNamespace
from typing import Any

from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time


class MemoryStore:
    """The shared table, and what each node asked of it."""

    def __init__(self) -> None:
        self.table: dict[str, dict[str, ValueWithExpiration]] = {}
        self.gets: Counter[str] = Counter()
        self.stores: Counter[str] = Counter()
        self.entries_read: Counter[str] = Counter()

    def reset_counts(self) -> None:
        self.gets.clear()
        self.stores.clear()
        self.entries_read.clear()


class MemoryDHT:
    """One node's view of a `MemoryStore`, with the `hivemind.DHT` calls matchmaking makes."""

    def __init__(self, store: MemoryStore, node: str):
        self.shared, self.node = store, node

    def store(self, key: str, value: Any, expiration: float, *, subkey: str, return_future: bool = False):
        self.shared.stores[self.node] += 1
        entries = self.shared.table.setdefault(key, {})
        old = entries.get(subkey)
        if old is None or old.expiration_time < expiration:
            entries[subkey] = ValueWithExpiration(value, expiration)
        return _done(True)

    def get(self, key: str, *, latest: bool = True, return_future: bool = False):
        self.shared.gets[self.node] += 1
        now = get_dht_time()
        entries = {s: v for s, v in self.shared.table.get(key, {}).items() if v.expiration_time > now}
        self.shared.entries_read[self.node] += len(entries)
        if not entries:
            return _done(None)
        return _done(ValueWithExpiration(entries, max(v.expiration_time for v in entries.values())))


def _done(value: Any) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


class _PipeWriter:
    """The writing end of a one-way pipe: bytes land in the other side's reader."""

    def __init__(self, target: asyncio.StreamReader):
        self.target, self.closed = target, False

    def write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("pipe closed")
        self.target.feed_data(data)

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.target.feed_eof()

    def is_closing(self) -> bool:
        return self.closed


class MemoryNetwork:
    """Which handlers each peer serves."""

    def __init__(self) -> None:
        self.handlers: dict[tuple[str, str], Any] = {}
        self.tasks: set[asyncio.Task] = set()


class MemoryP2P:
    """One peer: a random peer id, its handlers in the network, streams as pairs of pipes."""

    def __init__(self, network: MemoryNetwork):
        self.network = network
        self.peer_id = PeerID(b"\x00\x24" + os.urandom(36))

    async def add_binary_stream_handler(self, name: str, handler: Any) -> None:
        self.network.handlers[self.peer_id.to_base58(), name] = handler

    async def remove_binary_stream_handler(self, name: str) -> None:
        self.network.handlers.pop((self.peer_id.to_base58(), name), None)

    async def call_binary_stream_handler(self, peer: PeerID, name: str):
        handler = self.network.handlers.get((peer.to_base58(), name))
        if handler is None:
            raise ConnectionRefusedError(f"{peer} serves no {name}")
        ours, theirs = asyncio.StreamReader(), asyncio.StreamReader()
        info = SimpleNamespace(peer_id=self.peer_id)
        task = asyncio.ensure_future(handler(info, theirs, _PipeWriter(ours)))
        self.network.tasks.add(task)
        task.add_done_callback(self.network.tasks.discard)
        return SimpleNamespace(peer_id=peer), ours, _PipeWriter(theirs)


async def one_round(n: int, *, late: int = 0, ghosts: int = 0, spread: float = 0.5, timeout: float = 10.0,
                    seed: int = 0) -> dict[str, Any]:
    """`n` matchmakers on one store and network form round 1, arriving uniformly over `spread`
    seconds, each expecting the others (as `SwarmSync` does from the progress records); then
    `late` more arrive together once those returned (joiners nobody expected). `ghosts` peers are
    expected but never come (dead nodes whose records live on): the group waits until `timeout`. Returns the groups
    formed, the seconds from the first arrival to the last return of the `n`, and per node (the
    `n`, then the late ones) the DHT gets, stores, entries read and `last_outcome`."""
    import random

    from diloco_p2p.swarm.collective.hierarchy import MAX_MEMBERS
    from diloco_p2p.swarm.membership.matchmaking import Matchmaker

    store, network = MemoryStore(), MemoryNetwork()
    p2ps = [MemoryP2P(network) for _ in range(n + late)]
    names = [p.peer_id.to_base58() for p in p2ps]
    mms = [Matchmaker(MemoryDHT(store, name), p2p, run_id="mem") for name, p2p in zip(names, p2ps, strict=True)]
    for mm in mms:
        await mm.start()
    rng = random.Random(seed)
    ghost_names = [MemoryP2P(network).peer_id.to_base58() for _ in range(ghosts)]
    delays = sorted(rng.uniform(0, spread) for _ in range(n)) + [0.0] * late
    loop = asyncio.get_running_loop()

    async def member(i: int):
        await asyncio.sleep(delays[i])
        expected = [x for x in names[:n] + ghost_names if x != names[i]]
        return await mms[i].form_group(1, "ab" * 32, 1.0 + i, min_group_size=2, target_group_size=MAX_MEMBERS,
                                       timeout=timeout, expected=expected)

    start = loop.time()
    groups = await asyncio.gather(*(member(i) for i in range(n)))
    seconds = loop.time() - start
    await asyncio.sleep(0.05)  # the withdrawals (background stores)
    groups += await asyncio.gather(*(member(i) for i in range(n, n + late)))
    await asyncio.sleep(0.05)
    for mm in mms:
        await mm.stop()
    return {"groups": {g.group_id for g in groups if g}, "sizes": [g.size if g else 1 for g in groups],
            "seconds": seconds, "gets": [store.gets[x] for x in names], "stores": [store.stores[x] for x in names],
            "entries_read": [store.entries_read[x] for x in names], "outcomes": [m.last_outcome for m in mms]}
