"""Strangers for the trust tests: K real DHT peers in the test's process, each with its own
identity (a Sybil's whole cost), that know what anyone can know (a seed's address, the run id,
the records) and hold no key but their own.

- `claim`: each publishes a progress record of its own for a later round with a made-up θ;
- `serve`: one serves a state blob it made (a forged one, or the swarm's θ with a made-up
  momentum) announced as any (round, θ hash) it likes;
- `announce`: one announces a state of any size without serving anything;
- `ranked_first`: identities a given joiner tries before the honest donors (rendezvous order
  is public: a joiner's peer id is in its records).

Create it before starting processes (hivemind forks); give `maddr` to the seed as an initial peer.
`attacked_swarm` is the whole scenario the trust tests and `benchmarks/swarm/attacks.py` share.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from diloco_p2p.swarm.membership.records import ProgressRecord, publish_progress, read_progress
from diloco_p2p.swarm.state.announcements import StateAnnouncement, rendezvous_order, state_key
from diloco_p2p.swarm.state.client import FetchedState, fetch_state
from diloco_p2p.swarm.state.codec import THETA, pack_state, theta_sha256, unpack_state
from diloco_p2p.swarm.state.server import StateServer
from diloco_p2p.swarm.transport.dht import peer_id_of
from diloco_p2p.swarm.trust.signing import own_subkey
from tests.harness.loopback import LoopbackPeers
from tests.harness.procs import wait_until
from tests.harness.swarm import ProcessSwarm


class Strangers(LoopbackPeers):
    def __init__(self, k: int, identities: list[Path] = ()):
        super().__init__(k, identities=identities)
        self.ids = [p.peer_id.to_base58() for p in self.p2ps]
        self.maddr = self.maddrs[0]
        self.servers: list[StateServer] = []

    def records(self, run_id: str) -> dict[str, ProgressRecord]:
        return {p: r for p, r in read_progress(self.dhts[0], run_id, timeout=10).items() if p not in self.ids}

    def claim(self, run_id: str, template: ProgressRecord, who: range | list[int], **lies: Any) -> None:
        """Each stranger in `who` publishes `template` as its own record, with `lies`."""
        for i in who:
            record = ProgressRecord.build(**{**template.dict(), "peer_id": self.ids[i], "updated": None, **lies})
            assert publish_progress(self.dhts[i], run_id, record, ttl=600)

    def serve(self, i: int, run_id: str, round: int, blob: bytes, params_hash: str) -> None:
        server = StateServer(self.dhts[i], self.p2ps[i], run_id=run_id)
        self.servers.append(server)

        async def go() -> None:
            await server.start()
            await server.set_state(round, blob, params_hash)

        self.loop.run(go(), timeout=30)

    def announce(self, i: int, run_id: str, round: int, params_hash: str, size: int) -> None:
        """Announce a state of `size` bytes that nobody serves."""
        value = StateAnnouncement(self.ids[i], round, hashlib.sha256(b"nothing").hexdigest(), size, params_hash).value()
        subkey = own_subkey(self.dhts[i], self.ids[i])
        assert self.dhts[i].store(state_key(run_id), value, get_dht_time() + 600, subkey=subkey)

    def download(self, run_id: str, min_round: int, timeout: float = 30.0) -> FetchedState:
        """The honest state of `min_round` or later (from the honest donors), as any stranger can download it."""
        return self.loop.run(fetch_state(self.dhts[0], self.p2ps[0], run_id=run_id, min_round=min_round, exclude=self.ids,
                                         timeout=timeout, wait=timeout / 2), timeout=timeout + 10)

    def close(self) -> None:
        for server in self.servers:
            self.loop.run(server.stop(), timeout=15)
        super().close()


def identity(path: Path) -> str:
    """A fresh identity file at `path`; its peer id."""
    path.parent.mkdir(parents=True, exist_ok=True)
    P2P.generate_identity(str(path))
    return peer_id_of(path)


def ranked_first(joiner: str, honest: list[str], n: int, folder: Path) -> list[Path]:
    """`n` identity files whose peers `joiner` tries before every one of `honest`, and in this order."""
    found: list[tuple[str, Path]] = []
    tries = 0
    while len(found) < n:
        path = folder / f"ranked-{tries}.key"
        peer = identity(path)
        tries += 1
        if rendezvous_order(joiner, [peer, *honest])[0] == peer:
            found.append((peer, path))
    order = rendezvous_order(joiner, [p for p, _ in found])
    return [dict(found)[p] for p in order]


RUN = "swarm-test"  # tests.harness.settings.SWARM
SYBILS = range(3)  # stranger 0..2: Sybils; 3, 4: bad donors the newcomer tries first; 5: oversized
MOMENTUM, WRONG_SIZE, OVERSIZED = 3, 4, 5
HOLD = {"DILOCO_P2P_FAULTS": "hold@delta:3"}
OPTS = ["train.max_rounds=6", "sync.target_group_size=3", "sync.matchmaking_timeout=10"]


class Attacked(NamedTuple):
    procs: ProcessSwarm
    nodes: list  # a, b, c
    honest: list[str]  # their peer ids
    d: Any  # the newcomer
    newcomer: str  # its peer id
    strangers: Strangers
    forged_hash: str


@contextmanager
def attacked_swarm(root: Path, seed_args: tuple[str, ...] = ("--witness", RUN),
                   forged_numel: int = 16) -> Iterator[Attacked]:
    """A seed (witnessing the run) and three honest nodes; before their first round three Sybils
    claim the last round with a made-up θ of `forged_numel` values and serve it. The honest nodes commit
    rounds 1-2 and park at round 3 (``hold``). A newcomer then joins; the two donors it tries
    first serve the swarm's round-2 θ with a made-up momentum and with a momentum of another size,
    and a third stranger announces a state of 2**62 bytes. Yields once the newcomer reached round 3,
    or at once (`d` None) if the Sybils took the honest nodes over (no witness, nor standing yet)."""
    honest = {name: identity(root / name / "identity.key") for name in "abc"}
    newcomer = identity(root / "d" / "identity.key")
    donors = ranked_first(newcomer, list(honest.values()), 2, root / "keys")
    keys = [_fresh(root / "keys" / f"sybil-{i}.key") for i in SYBILS] + donors + [_fresh(root / "keys" / "big.key")]
    with Strangers(len(keys), identities=keys) as strangers, \
            ProcessSwarm(root, seed_args=["--initial-peers", strangers.maddr, *seed_args]) as procs:
        nodes = [procs.node(name, OPTS, env=HOLD) for name in "abc"]
        procs.wait_joined(*nodes)
        wait_until(lambda: len(strangers.records(RUN)) >= 3, 60, "3 honest records")
        template = next(iter(strangers.records(RUN).values()))
        g = torch.Generator().manual_seed(48)
        forged = {THETA: torch.randn(forged_numel, generator=g), "outer.momentum": torch.zeros(forged_numel)}
        forged_hash = theta_sha256(forged)
        blob = pack_state(forged, {"round": 6, "averaged_round": 6})
        for i in SYBILS:
            strangers.serve(i, RUN, 6, blob, forged_hash)
        strangers.claim(RUN, template, SYBILS, round=6, params_sha256=forged_hash, status="committed",
                        averaged_round=6, members=[strangers.ids[i] for i in SYBILS])
        procs.release(*nodes)
        wait_until(lambda: all(2 in n.by_round() or n.exited() for n in nodes), 240, "round 2", *nodes)
        if any(n.exited() for n in nodes):  # taken over (a node that adopts the last round is done)
            yield Attacked(procs, nodes, list(honest.values()), None, newcomer, strangers, forged_hash)
            return

        state = strangers.download(RUN, 2)
        tensors, meta = unpack_state(state.blob)
        theta_hash = theta_sha256(tensors)
        assert (state.round, theta_hash) == (2, nodes[0].by_round()[2]["params_sha256"])
        made_up = {**tensors, "outer.momentum": torch.full_like(tensors["outer.momentum"], 0.5)}
        resized = {**tensors, "outer.momentum": torch.zeros(tensors["outer.momentum"].numel() + 1)}
        strangers.serve(MOMENTUM, RUN, 2, pack_state(made_up, meta), theta_hash)
        strangers.serve(WRONG_SIZE, RUN, 2, pack_state(resized, meta), theta_hash)
        strangers.announce(OVERSIZED, RUN, 2, theta_hash, 2 ** 62)
        d = procs.node("d", OPTS)
        d.wait_round(3, timeout=240)
        yield Attacked(procs, nodes, list(honest.values()), d, newcomer, strangers, forged_hash)


def _fresh(path: Path) -> Path:
    identity(path)
    return path
