"""Reachability: can other peers dial this node, or does it sit behind a NAT or firewall?

A node behind a home router can open connections but not accept them. The swarm needs to know
which nodes are *public* (dialable): only they lead matchmaking groups, reduce all-reduce parts
and serve state; *private* nodes take part through the connections they open themselves
(`diloco_p2p.swarm.collective.allreduce`, "Private members").

How a node learns it (libp2p AutoNAT's idea, Seemann et al., libp2p specs "autonat"): it asks a
peer it can reach, over a libp2p stream (`PROTOCOL`), to dial it back. The request names the TCP
ports the node listens on; the peer opens a plain TCP connection to each of them *at the address
it sees the request coming from* (never an address the requester names, so a probe cannot aim a
peer at a third party) and answers which ones accepted. A node behind NAT is seen at its router's
address, whose ports are closed to connections that start outside: no port answers, the node is
private. p2pd runs libp2p's own AutoNAT, but its control API does not expose the verdict, hence
this protocol. The probe runs from a short-lived p2pd of its own before the node's DHT starts,
because the DHT's mode (server or client) depends on the answer; it listens on the node's
configured address, so a fixed port (a port forwarding) is what gets probed.

`detect` returns "public", "private", or None when no peer answered (the caller decides; a node
with no initial peer is the first of its swarm and public by definition). `p2p.reachability`
forces the answer without a probe.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import multiaddr
from hivemind.p2p import P2P, PeerID

from diloco_p2p.config import P2PConfig
from diloco_p2p.swarm.transport import streams
from diloco_p2p.swarm.transport.dht import validate_maddrs
from diloco_p2p.swarm.transport.streams import NETWORK_ERRORS

log = logging.getLogger(__name__)

PUBLIC, PRIVATE = "public", "private"
PROTOCOL = "/diloco-p2p/reach/1"
DIAL_TIMEOUT = 3.0  # a dial-back that gets no answer within this counts as closed
MAX_PORTS = 4
_MAX_FRAME = 1024
_CONCURRENT_PROBES = 8  # dial-backs served at once; more wait


def tcp_ports(maddrs: Sequence[Any]) -> list[int]:
    """The TCP ports in `maddrs` (at most `MAX_PORTS`, in order, without repeats)."""
    ports: list[int] = []
    for m in maddrs:
        parsed = multiaddr.Multiaddr(str(m))
        names = [p.name for p in parsed.protocols()]
        if "tcp" in names and "p2p-circuit" not in names:
            port = int(parsed.value_for_protocol(multiaddr.protocols.P_TCP))
            if port and port not in ports:
                ports.append(port)
    return ports[:MAX_PORTS]


def observed_host(addr: Any) -> str | None:
    """The IP address in a stream's remote multiaddr (hivemind's `StreamInfo.addr`), or None."""
    try:
        parsed = multiaddr.Multiaddr(str(addr))
    except Exception:
        return None
    for code in (multiaddr.protocols.P_IP4, multiaddr.protocols.P_IP6):
        with suppress(Exception):
            return parsed.value_for_protocol(code)
    return None


async def _dial(host: str, port: int, timeout: float) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with suppress(OSError):
        await writer.wait_closed()
    return True


class ReachServer:
    """Answers dial-back requests on a P2P instance (seeds and public nodes run one)."""

    def __init__(self, p2p: P2P, dial_timeout: float = DIAL_TIMEOUT):
        self.p2p, self.dial_timeout = p2p, dial_timeout
        self._limit = asyncio.Semaphore(_CONCURRENT_PROBES)
        self._running = False

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(PROTOCOL, self._handle)
        self._running = True

    async def stop(self) -> None:
        if self._running:
            self._running = False
            with suppress(*NETWORK_ERRORS):
                await self.p2p.remove_binary_stream_handler(PROTOCOL)

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(streams.read_json(reader, _MAX_FRAME), self.dial_timeout)
            ports = request.get("ports")
            host = observed_host(info.addr)
            if not (isinstance(ports, list) and all(isinstance(p, int) and 0 < p < 65536 for p in ports)):
                ports = []
            async with self._limit:
                open_ = [p for p in ports[:MAX_PORTS] if host and await _dial(host, p, self.dial_timeout)]
            streams.write_json(writer, {"open": open_, "seen": host})
            await writer.drain()
            await streams.linger(reader, self.dial_timeout)
        except (*NETWORK_ERRORS, TimeoutError, streams.WireError) as e:
            log.debug("reachability probe from %s dropped: %r", info.peer_id, e)
        finally:
            writer.close()


async def ask(p2p: P2P, peer: PeerID, ports: list[int], timeout: float) -> bool | None:
    """Ask `peer` to dial us back on `ports`: True if one answered, False if none, None if no verdict."""
    try:
        async with asyncio.timeout(timeout):
            _, reader, writer = await p2p.call_binary_stream_handler(peer, PROTOCOL)
            try:
                streams.write_json(writer, {"ports": ports})
                await writer.drain()
                answer = await streams.read_json(reader, _MAX_FRAME)
            finally:
                writer.close()
    except (*NETWORK_ERRORS, TimeoutError, streams.WireError) as e:
        log.debug("reachability probe via %s failed: %r", peer, e)
        return None
    open_ = answer.get("open")
    return bool(open_) if isinstance(open_, list) else None


async def detect(p2p: P2P, peers: Sequence[PeerID], timeout: float = 2 * DIAL_TIMEOUT + 5) -> str | None:
    """PUBLIC or PRIVATE as the first of `peers` that answers sees us; None if none answered."""
    ports = tcp_ports(await p2p.get_visible_maddrs())
    if not ports:
        return None
    for peer in peers:
        verdict = await ask(p2p, peer, ports, timeout)
        if verdict is not None:
            return PUBLIC if verdict else PRIVATE
    return None


def peer_ids(maddrs: Sequence[str]) -> list[PeerID]:
    """The peer ids named by ``/p2p/<id>`` multiaddrs (initial peers always name one)."""
    out: list[PeerID] = []
    for m in maddrs:
        with suppress(Exception):
            out.append(PeerID.from_base58(multiaddr.Multiaddr(m).value_for_protocol(multiaddr.protocols.P_P2P)))
    return out


def resolve(cfg: P2PConfig) -> tuple[str, str]:
    """(PUBLIC or PRIVATE, why) for a node about to start with `cfg`: forced by
    `p2p.reachability`, or probed through the initial peers from a short-lived p2pd (see the
    module docstring). No initial peer: the first node of a swarm, public. No answer: public, as
    before reachability existed (the DHT start then says what is wrong with the initial peers)."""
    if cfg.reachability != "auto":
        return cfg.reachability, "set by p2p.reachability"
    validate_maddrs(cfg.initial_peers, "p2p.initial_peers", require_peer_id=True)  # a typo: one clear line
    if not cfg.initial_peers:
        return PUBLIC, "no initial peer to ask (the first node of a swarm)"
    try:
        verdict = asyncio.run(asyncio.wait_for(_probe(cfg), cfg.connect_timeout + 2 * DIAL_TIMEOUT + 10))
    except Exception as e:  # the daemon did not start or the peers did not answer: no verdict
        log.debug("reachability probe failed: %r", e)
        verdict = None
    if verdict is None:
        return PUBLIC, "no initial peer answered the dial-back probe; assuming public"
    if verdict == PUBLIC:
        return PUBLIC, "an initial peer dialled this node back"
    return PRIVATE, "an initial peer could not dial this node back (NAT or firewall)"


async def _probe(cfg: P2PConfig) -> str | None:
    p2p = await P2P.create(initial_peers=list(cfg.initial_peers), host_maddrs=list(cfg.host_maddrs),
                           announce_maddrs=list(cfg.announce_maddrs) or None)
    try:
        return await detect(p2p, peer_ids(cfg.initial_peers))
    finally:
        await p2p.shutdown()


def shortage(public: int, private: int) -> str | None:
    """What is wrong with a swarm of `public` dialable and `private` NATed training nodes, or None.

    Private nodes average only through public ones (they reduce no part, lead no group): with
    none public they cannot average at all; with fewer public than private each public node
    reduces more than twice its even share ((k+P-2)/P of the vector each way instead of about 2),
    and its uplink sets the pace of every round."""
    if private and not public:
        return (f"no public peer among the {private} training nodes: nodes behind NAT cannot average with each "
                "other (each ends its rounds alone); a node with an open TCP port (p2p.host_maddrs, "
                "p2p.announce_maddrs) is needed")
    if private > public:
        k = public + private
        return (f"too few public peers: {public} of {k} nodes can be dialled, so each reduces 1/{public} of the "
                f"vector and moves {(k + public - 2) / public:.1f}x the parameter bytes per round each way "
                f"(even share: {2 * (k - 1) / k:.1f}x); add nodes with an open TCP port")
    return None
