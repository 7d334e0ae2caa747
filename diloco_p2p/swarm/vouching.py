"""What the swarm vouches for, as one node reads it: the DHT reads behind a resync.

`Vouching` reads the run's progress records (and, for a node with no standing yet, the witness of
the seeds it bootstrapped from) and answers with the pure rules of `membership.resync` and
`membership.standing`: which peers have standing now, whether a (round, θ hash) is vouched for and
with which whole-state hash, and the records once a state at our round is vouched for (a group that
formed without us). `layout_of` is what a peer's state may hold for our model (`codec.Layout`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from diloco_p2p.swarm.membership.records import ProgressRecord
from diloco_p2p.swarm.membership.resync import vouched_records, vouched_state_hash
from diloco_p2p.swarm.membership.standing import Standing, parse_witness, witness_key
from diloco_p2p.swarm.state.codec import THETA, Layout

log = logging.getLogger(__name__)

RECORDS_TIMEOUT = 5.0  # one read of the run's records
VOUCH_WAIT = 2.0  # how long a state at the swarm's front may wait for its quorum of records


class Vouching:
    """The reads of one swarm endpoint that decide what it may adopt. `read_records` returns the
    run's records that count (signed, admitted), ours included; `dht` reads the witness."""

    def __init__(self, read_records: Callable[[], Awaitable[dict[str, ProgressRecord]]], me: str, dht: Any,
                 run_id: str, quorum: int, max_round: int | None, witnesses: set[str]):
        self.read_records, self.me, self.dht, self.run_id = read_records, me, dht, run_id
        self.quorum, self.max_round, self.witnesses = quorum, max_round, witnesses
        self.standing = Standing(me)

    async def others(self) -> dict[str, ProgressRecord]:
        found = await asyncio.wait_for(self.read_records(), RECORDS_TIMEOUT)
        return {p: r for p, r in found.items() if p != self.me}

    def vouched(self, others: dict[str, ProgressRecord]) -> dict[str, ProgressRecord]:
        return vouched_records(others, quorum=self.quorum, max_round=self.max_round,
                               standing=self.standing.among(others))

    async def standing_among(self, others: dict[str, ProgressRecord]) -> frozenset[str] | None:
        """The peers whose records may back a state now (`Standing.among`). Until we commit a
        round with someone, the witness of the seeds we bootstrapped from speaks for us."""
        if not self.standing.direct and self.witnesses:
            try:
                found = await asyncio.wait_for(
                    self.dht.get(witness_key(self.run_id), latest=True, return_future=True), RECORDS_TIMEOUT)
                self.standing.witness(parse_witness(found, self.witnesses))
            except Exception as e:  # no witness now: the headcount decides, as for a node with no view
                log.debug("no witness read: %s", e)
        return self.standing.among(others)

    async def state_hash(self, round: int, params_hash: str) -> str | None:
        """The whole-state hash the records vouch for at (`round`, `params_hash`) (None: none published)."""
        try:
            others = await self.others()
        except Exception:  # no view of the swarm now: θ alone is checked
            return None
        return vouched_state_hash(self.vouched(others), round, params_hash, self.standing.among(others))

    async def is_vouched(self, round: int, params_hash: str | None, wait: float = 0.0) -> tuple[bool, str | None]:
        """Whether the records vouch for θ `params_hash` at `round`, and its whole-state hash; a state at
        the swarm's front is waited for up to `wait` seconds, as its records are published just after."""
        deadline = time.monotonic() + wait
        while True:
            try:
                others = await self.others()
            except Exception:  # no view of the swarm now: not vouched
                return False, None
            vouched = self.vouched(others)
            if any((r.round, r.params_sha256) == (round, params_hash) for r in vouched.values()):
                return True, vouched_state_hash(vouched, round, params_hash, self.standing.among(others))
            newest = max((r.round for r in others.values()), default=-1)
            if not newest <= round <= newest + 1 or time.monotonic() >= deadline:
                return False, None  # not the swarm's front (its members publishing it now), or no more time
            await asyncio.sleep(0.2)

    async def records_at(self, round: int, wait: float) -> dict[str, ProgressRecord]:
        """The others' records once the vouched records reach `round`, waiting at most `wait`."""
        deadline = time.monotonic() + wait
        while True:
            try:
                others = await self.others()
            except Exception:  # no view of the swarm now: try again until the deadline
                others = {}
            if max((r.round for r in self.vouched(others).values()), default=-1) >= round \
                    or time.monotonic() >= deadline:
                return others
            await asyncio.sleep(0.2)


def layout_of(state: dict[str, torch.Tensor]) -> Layout:
    """What a peer's state may hold for our model: our own outer state's tensors exactly, and an
    average in flight (sync.overlap) of at most θ's size, whatever our own state holds now."""
    outer = {name: t for name, t in state.items() if name.startswith("outer.")}
    flight = {"overlap.average": state[THETA].reshape(-1), "overlap.average_round": torch.zeros(1, dtype=torch.int64)}
    return Layout.of(outer, flight, bounded=("overlap.average",))
