"""In-process DHTs on loopback, each with a P2P replica on one background loop."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import hivemind

from diloco_p2p.swarm.runner import BackgroundLoop


@contextmanager
def loopback_dhts(n: int) -> Iterator[tuple[list[hivemind.DHT], list, BackgroundLoop]]:
    """`n` DHTs joined through the first, their P2P replicas, and the loop those live on."""
    # DHTs fork: create them all before the loop thread starts.
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = [str(a) for a in first.get_visible_maddrs()]
    dhts = [first] + [
        hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers) for _ in range(n - 1)
    ]
    loop = BackgroundLoop()
    try:
        p2ps = [loop.run(d.replicate_p2p(), timeout=30) for d in dhts]
        yield dhts, p2ps, loop
        for p in p2ps:
            loop.run(p.shutdown(), timeout=10)
    finally:
        loop.close()
        for d in dhts:
            d.shutdown()
