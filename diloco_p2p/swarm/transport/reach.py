"""Reachability: can other peers dial this node, or does it sit behind a NAT or firewall?

Only *public* nodes lead matchmaking groups, reduce all-reduce parts and serve state; *private*
ones take part through the connections they open themselves. A node learns which it is as libp2p
AutoNAT does: it asks a reachable peer (`PROTOCOL`) to dial its TCP ports back *at the address
the request came from* (never one the requester names, so a probe cannot aim a peer at a third
party). p2pd's own AutoNAT verdict is not exposed by its control API, hence this probe, run from
a short-lived p2pd before the DHT starts (the DHT's mode depends on it). `detect` returns
"public", "private", or None when no peer answered; `p2p.reachability` forces the answer.
What private members change in the all-reduce: docs/protocol/allreduce.md
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
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
    """(PUBLIC or PRIVATE, why) for a node about to start: `p2p.reachability`, or a probe through the
    initial peers; public with no initial peer (the first node) or no answer."""
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
    """What is wrong with a swarm of `public` and `private` training nodes, or None: private nodes
    average only through public ones, and fewer public than private overloads each public uplink."""
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


def log_shortage(records: Mapping[str, Any], me: str, public: bool, logged: str | None) -> str | None:
    """Log (once per change) a swarm of `records` and us with too few public peers; the message in force."""
    private = sum(r.reachability == PRIVATE for p, r in records.items() if p != me) + (not public)
    message = shortage(len(set(records) | {me}) - private, private)
    if message != logged and message is not None:
        log.warning("%s", message)
    return message
