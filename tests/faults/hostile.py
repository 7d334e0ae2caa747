"""A hostile peer for the fault tests: a real DHT peer with its own identity and p2pd, in the
test's process, that lies the ways issue 12 lists. It knows what any stranger can know (a seed's
address, the run id, the records in the DHT) and holds no key but its own.

- `publish_claim`: a progress record of its own for a later round, with a made-up θ hash;
- `serve_forged_state`: a made-up θ whose blob's sha256 matches its announcement;
- `forge_record_as`: a record under another peer's id (signed with its own key: the only
  signature it can make);
- `fetch`: download the run's state; `knock`: open a matchmaking or all-reduce stream.

`LyingAllreduce` (`tests.faults.lying`) is an all-reduce member (in-process,
on any loopback peer) that lies as its `lie` says: about its contribution's norm, or, as a
reducer, about its part's average.

Create it before starting processes (hivemind forks); give `maddr` to the seed as an initial
peer so that everyone shares one DHT.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from diloco_p2p.swarm.membership.records import ProgressRecord, progress_key, publish_progress, read_progress
from diloco_p2p.swarm.state.client import StateUnavailable, fetch_state
from diloco_p2p.swarm.state.codec import pack_state, theta_sha256
from diloco_p2p.swarm.state.server import StateServer
from diloco_p2p.swarm.trust.signing import own_subkey
from tests.harness.loopback import LoopbackPeers


class HostilePeer(LoopbackPeers):
    def __init__(self) -> None:
        super().__init__(1)
        self.dht, self.p2p = self.dhts[0], self.p2ps[0]
        self.peer_id = self.p2p.peer_id.to_base58()
        self.maddr = self.maddrs[0]
        self.server: StateServer | None = None

    def honest_records(self, run_id: str) -> dict[str, ProgressRecord]:
        return {p: r for p, r in read_progress(self.dht, run_id, timeout=10).items() if p != self.peer_id}

    def claim(self, template: ProgressRecord, **lies: Any) -> ProgressRecord:
        """An honest node's record with our id and `lies` (round, params_sha256, ...)."""
        return ProgressRecord.build(**{**template.dict(), "peer_id": self.peer_id, "updated": None, **lies})

    def publish_claim(self, run_id: str, record: ProgressRecord) -> None:
        assert publish_progress(self.dht, run_id, record, ttl=300)

    def forge_record_as(self, run_id: str, victim: str, record: ProgressRecord) -> None:
        """Store `record` (naming `victim`) under `victim`'s id, signed with our key."""
        subkey = own_subkey(self.dht, self.peer_id).replace(self.peer_id, victim, 1)
        assert self.dht.store(progress_key(run_id), record.dict(), get_dht_time() + 300, subkey=subkey)

    def serve_forged_state(self, run_id: str, round: int, numel: int, params_hash: str | None = None) -> str:
        """Serve a made-up θ (and momentum) of `numel` parameters as the state of `round`,
        announced with `params_hash` (default: the made-up θ's own hash). Returns that hash."""
        g = torch.Generator().manual_seed(666)
        tensors = {"outer.theta": torch.randn(numel, generator=g), "outer.momentum": torch.zeros(numel)}
        blob = pack_state(tensors, {"round": round, "averaged_round": round})
        self.server = StateServer(self.dht, self.p2p, run_id=run_id)

        async def serve() -> None:
            await self.server.start()
            await self.server.set_state(round, blob, params_hash or theta_sha256(tensors))

        self.loop.run(serve(), timeout=30)
        return theta_sha256(tensors)

    def fetch(self, run_id: str, timeout: float = 15.0) -> Any:
        """The run's state as a stranger downloads it: `FetchedState`, or the `StateUnavailable` raised."""
        try:
            return self.loop.run(fetch_state(self.dht, self.p2p, run_id=run_id, timeout=timeout), timeout=timeout + 10)
        except StateUnavailable as e:
            return e

    def knock(self, peer: str, protocol: str, payload: bytes = b"\x00\x00\x00\x02{}") -> bytes:
        """Open a `protocol` stream to `peer`, send `payload`, and return what comes back before
        the stream ends (b"" when the peer closes it without a word)."""

        async def go() -> bytes:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol)
            try:
                writer.write(payload)
                await writer.drain()
                return await asyncio.wait_for(reader.read(), 10)
            except (ConnectionError, asyncio.IncompleteReadError):
                return b""
            finally:
                writer.close()

        return self.loop.run(go(), timeout=30)

    def close(self) -> None:
        if self.server is not None and self.loop is not None:
            self.loop.run(self.server.stop(), timeout=15)
        super().close()
