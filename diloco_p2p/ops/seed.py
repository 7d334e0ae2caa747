"""`diloco-p2p seed`: a DHT bootstrap node that trains nothing.

A seed is how volunteers find each other: a persistent identity (its multiaddr survives
restarts), a fixed port, and the multiaddrs others pass as ``--initial-peers``. It stores DHT
records for any run id and answers the dial-back probes of `diloco_p2p.swarm.transport.reach`,
so it must itself be public (operators' notes: ``bootstrap/README.md``). With ``--witness
RUN_ID`` it also publishes, signed, the peers of that run it trusts (`Witness`), so a newcomer
backs states only by those peers' records (docs/threat-model.md). It runs until SIGTERM or
SIGINT and returns 0; if the DHT process dies under it, it returns 1 so a supervisor restarts it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hivemind.utils import get_dht_time

from diloco_p2p.config import P2PConfig
from diloco_p2p.errors import UserError
from diloco_p2p.logs import short_peer
from diloco_p2p.swarm.membership.records import read_progress
from diloco_p2p.swarm.membership.standing import WITNESS_TTL, Witness, witness_key, witness_validator
from diloco_p2p.swarm.transport.dht import dht_peer_count, start_dht, visible_maddrs
from diloco_p2p.swarm.transport.reach import ReachServer
from diloco_p2p.swarm.transport.runner import BackgroundLoop
from diloco_p2p.swarm.trust.signing import own_subkey

logger = logging.getLogger(__name__)

# The seed's TCP port unless --host-maddrs says otherwise: fixed so that the address in
# volunteers' configs stays valid. 31337 is hivemind's customary example port.
DEFAULT_SEED_PORT = 31337
DEFAULT_HOST_MADDRS = (f"/ip4/0.0.0.0/tcp/{DEFAULT_SEED_PORT}",)
# How often the seed checks that its DHT process is alive and logs what it sees.
HEARTBEAT_SECONDS = 5.0
WITNESS_SECONDS = 1.0  # how often a witness reads its runs' records
LOG_EVERY_HEARTBEATS = 60


def run_seed(
    host_maddrs: Sequence[str] | None = None,
    announce_maddrs: Sequence[str] = (),
    identity_path: Path | str | None = None,
    maddrs_file: Path | str | None = None,
    metrics_host: str = "127.0.0.1",
    metrics_port: int = 0,
    *,
    initial_peers: Sequence[str] = (),
    stop_event: threading.Event | None = None,
    witness: Sequence[str] = (),
    founders: Sequence[str] = (),
) -> int:
    """Serve the DHT until SIGTERM/SIGINT (or `stop_event`); returns the exit code. `initial_peers`:
    another seed to join; `witness`: the runs it witnesses, trusting `founders` (`Witnesses`)."""
    if not -1 <= metrics_port < 65536:
        raise UserError(f"--metrics-port must be a TCP port, 0 (off) or -1 (any free port), not {metrics_port}")
    hosts = list(host_maddrs) if host_maddrs else list(DEFAULT_HOST_MADDRS)
    if identity_path is None:
        logger.warning("no --identity: this seed's peer id and address change on every restart")
    cfg = P2PConfig(
        host_maddrs=hosts, announce_maddrs=list(announce_maddrs), initial_peers=list(initial_peers)
    )
    # The DHT forks: start it before any thread of ours (metrics server) and before our signal
    # handlers, which the forked DHT process would otherwise inherit.
    dht = start_dht(cfg, Path(identity_path) if identity_path is not None else None,
                    record_validators=[witness_validator(run_id) for run_id in witness])
    stop = stop_event or threading.Event()
    previous = _install_stop_handlers(stop)
    metrics = loop = None
    try:
        loop = BackgroundLoop("seed-reach")
        reach = ReachServer(loop.run(dht.replicate_p2p(), timeout=30))
        loop.run(reach.start(), timeout=30)
        addrs = visible_maddrs(dht)
        for a in addrs:
            print(a, flush=True)
        if maddrs_file is not None:
            _write_atomically(Path(maddrs_file), "".join(a + "\n" for a in addrs))
        metrics = _start_metrics(metrics_host, metrics_port, dht)
        logger.info(
            "seed %s is up; pass one of the addresses above as --initial-peers", dht.peer_id.to_base58()
        )
        witnesses = Witnesses(dht, witness, founders)
        beats = 0
        while not stop.wait(WITNESS_SECONDS if witness else HEARTBEAT_SECONDS):
            witnesses.step()
            if not dht.is_alive():
                logger.error(
                    "the DHT process exited unexpectedly; stopping so the supervisor can restart the seed"
                )
                return 1
            beats += 1
            if beats % (LOG_EVERY_HEARTBEATS * (HEARTBEAT_SECONDS // WITNESS_SECONDS if witness else 1)) == 0:
                logger.info("seed alive: %d DHT peers in the routing table", dht_peer_count(dht))
        logger.info("stopping the seed")
        return 0
    finally:
        _restore_handlers(previous)
        if metrics is not None:
            metrics.shutdown()
        if loop is not None:
            loop.close()
        dht.shutdown()


class Witnesses:
    """The seed's witness of each run it follows: read the run's records, update whom it trusts
    (`Witness.observe`), publish them under the run's witness key with the seed's signed subkey.
    A DHT that does not answer now is tried again at the next beat."""

    def __init__(self, dht: Any, run_ids: Sequence[str], founders: Sequence[str] = ()):
        self.dht, self.runs = dht, {run_id: Witness(founders) for run_id in run_ids}
        self.subkey = own_subkey(dht, dht.peer_id.to_base58()) if run_ids else None

    def step(self) -> None:
        for run_id, witness in self.runs.items():
            try:
                records = read_progress(self.dht, run_id, timeout=WITNESS_SECONDS)
            except Exception as e:  # no view of the run this beat
                logger.debug("witness of %s: no records (%s)", run_id, e)
                continue
            before = set(witness.trusted)
            witness.observe(records)
            if witness.abstains:
                continue
            if witness.trusted != before:
                logger.info("witness of %s: trusts %d peer(s) (%s)", run_id, len(witness.trusted),
                            ", ".join(short_peer(p) for p in sorted(witness.trusted - before)))
            # Published even while it trusts nobody: "no group has committed yet" moves no newcomer.
            value = {"round": witness.round, "peers": witness.listed(records)}
            self.dht.store(witness_key(run_id), value, get_dht_time() + WITNESS_TTL, subkey=self.subkey)


def _install_stop_handlers(stop: threading.Event) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}  # signals only reach the main thread; the caller stops us through stop_event

    def handler(signum: int, _frame: Any) -> None:
        logger.info("received %s", signal.Signals(signum).name)
        stop.set()

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def _restore_handlers(previous: dict[int, Any]) -> None:
    for sig, old in previous.items():
        signal.signal(sig, old)


def _write_atomically(path: Path, text: str) -> None:
    """Readers polling for the file never see it half-written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(
            f"cannot write --maddrs-file {path} ({e.strerror or e}); choose a writable path"
        ) from None


def _start_metrics(host: str, port: int, dht: Any) -> Any:
    """The seed's Prometheus endpoint (DHT size, uptime); port 0 means off, -1 any free port
    (logged: ``metrics on http://HOST:PORT/metrics``)."""
    from diloco_p2p.loop.metrics import start_seed_metrics

    if not port:
        return None
    server = start_seed_metrics(host, max(port, 0), dht)  # a busy port: UserError naming --metrics-port
    logger.info("metrics on http://%s:%d/metrics", host, server.port)
    return server
