"""hivemind DHTs on loopback in this process, each with a P2P replica on one background loop."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import hivemind
from hivemind.p2p import P2P

from diloco_p2p.swarm.collective.allreduce import AllreduceService
from diloco_p2p.swarm.transport.runner import BackgroundLoop
from diloco_p2p.swarm.trust.signing import signature_validator

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


class LoopbackPeers:
    """`n` DHTs, each joined through those before it (and `initial_peers`), their P2P replicas
    (`p2ps`), and the loop those live on. Use as a context manager, or call `close`."""

    def __init__(self, n: int, initial_peers: Sequence[str] = (), identities: Sequence[Path] = ()):
        self.dhts: list[hivemind.DHT] = []
        self.maddrs: list[str] = list(initial_peers)
        self.p2ps: list = []
        self.loop: BackgroundLoop | None = None
        self._keys: tempfile.TemporaryDirectory | None = None
        try:
            # DHTs fork: create them all before the loop thread starts.
            for i in range(n):
                self.add_dht(identities[i] if i < len(identities) else None)
            self.loop = BackgroundLoop()
            self.p2ps = [self.loop.run(d.replicate_p2p(), timeout=30) for d in self.dhts]
        except BaseException:
            self.close()
            raise

    def add_dht(self, identity: Path | None = None) -> hivemind.DHT:
        """One more DHT joined through all the others; shut down by `close` (its P2P replica is the caller's).
        Like a node's, it has an identity file and signs its DHT entries with it (`swarm.trust.signing`)."""
        if identity is None:
            if self._keys is None:
                self._keys = tempfile.TemporaryDirectory(prefix="loopback-keys-")
            identity = Path(self._keys.name) / f"{len(self.dhts)}.key"
            P2P.generate_identity(str(identity))
        dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=list(self.maddrs),
                           identity_path=str(identity), record_validators=[signature_validator(identity)])
        self.maddrs += [str(a) for a in dht.get_visible_maddrs()]
        self.dhts.append(dht)
        return dht

    def close(self) -> None:
        try:
            for p in self.p2ps:
                self.loop.run(p.shutdown(), timeout=10)
        finally:
            if self.loop is not None:
                self.loop.close()
            for d in self.dhts:
                d.shutdown()
            if self._keys is not None:
                self._keys.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AllreducePeers(LoopbackPeers):
    """`LoopbackPeers`, each with an `AllreduceService` started under `prefix`: `services`, and the
    members' `peers` (PeerIDs) and `names` (base58) in the same order."""

    def __init__(self, n: int, prefix: str, chunk_elements: int):
        super().__init__(n)
        self.chunk_elements = chunk_elements
        self.services: list[AllreduceService] = []
        try:
            self.services = [self.service(p2p, prefix) for p2p in self.p2ps]
        except BaseException:
            self.close()
            raise
        self.peers = [p2p.peer_id for p2p in self.p2ps]
        self.names = [p.to_base58() for p in self.peers]

    def service(self, p2p, prefix: str) -> AllreduceService:
        """A started service on `p2p` (stopping it is the caller's, unless it is one of `services`)."""
        service = AllreduceService(p2p, prefix=prefix, chunk_elements=self.chunk_elements)
        self.loop.run(service.start(), 30)
        return service

    def close(self) -> None:
        try:
            for service in self.services:
                self.loop.run(service.stop(), 30)
        finally:
            super().close()
