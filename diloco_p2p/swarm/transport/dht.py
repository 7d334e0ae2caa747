"""Starting the hivemind DHT: validated multiaddrs, a persistent identity, bounded joins.

Everything a node or a seed needs before it can talk to the swarm goes through here, so a
user's mistake at the boundary is one clear line (a `UserError`), not a traceback or a hang:
multiaddrs are parsed with the `multiaddr` package and initial peers must name their peer id;
the identity file fixes the peer id across restarts; joining is bounded by
`p2p.connect_timeout` (hivemind's p2pd exits on unreachable bootstrap peers, but a dial on a
lossy path can take much longer, so past the deadline we stop the DHT and its p2pd ourselves,
`_stop_failed_dht`). The DHT process and its p2pd die with the process that started them
(`_OwnedDHT`), so a ``kill -9`` leaves no daemon holding our identity.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import hivemind
import multiaddr
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import P2P, PeerID

from diloco_p2p.config import P2PConfig
from diloco_p2p.errors import UserError
from diloco_p2p.swarm.trust.signing import signature_validator

logger = logging.getLogger(__name__)

MADDR_EXAMPLE = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."
# p2pd needs a moment to start even with no peers to dial; this bounds that start alone.
STARTUP_TIMEOUT = 30.0
# How long a DHT process whose start failed gets to exit by itself before we terminate it.
STOP_GRACE = 5.0
# How often the DHT process checks that the process that started it is still alive.
PARENT_POLL_SECONDS = 0.5


def validate_maddrs(addrs: Sequence[str], what: str, *, require_peer_id: bool = False) -> list[str]:
    """Parse each multiaddr and return them as strings (hivemind takes strings), or a `UserError`
    naming `what`; with `require_peer_id`, each must end in ``/p2p/<peer id>``."""
    out: list[str] = []
    for s in addrs:
        if not isinstance(s, str):
            raise UserError(f"{what}: {s!r} is not a string; expected a multiaddr such as {MADDR_EXAMPLE}")
        try:
            parsed = multiaddr.Multiaddr(s.strip())
        except Exception as e:  # the package raises several ValueError/TypeError subclasses
            reason = " ".join(str(e).split()) or type(e).__name__
            raise UserError(
                f"{what}: {s!r} is not a valid multiaddr (expected e.g. {MADDR_EXAMPLE}): {reason}"
            ) from None
        names = [p.name for p in parsed.protocols()]
        if require_peer_id and "p2p" not in names:
            raise UserError(
                f"{what}: {s!r} has no /p2p/<peer id> part; copy the full address the seed printed "
                f"(e.g. {MADDR_EXAMPLE})"
            )
        out.append(str(parsed))
    return out


def _has_port_zero(addr: str) -> bool:
    parsed = multiaddr.Multiaddr(addr)
    return any(
        p.name in ("tcp", "udp") and parsed.value_for_protocol(p.code) == "0" for p in parsed.protocols()
    )


def load_or_create_identity(path: Path) -> Path:
    """`path` holding a libp2p private key, created if missing, so the peer id (and the multiaddr
    others dial) survives restarts. A file that is not a key is never overwritten: we say how to fix it."""
    path = Path(path).expanduser()
    if path.exists():
        try:
            peer_id_of(path)
        except OSError as e:
            raise UserError(
                f"identity file {path} cannot be read ({e.strerror or e}); fix its permissions for this user"
            ) from None
        except Exception:
            raise UserError(
                f"identity file {path} is not a libp2p private key; restore it from a backup, or delete it "
                "to create a new identity (the peer id and the address others use will change)"
            ) from None
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    except OSError as e:
        raise UserError(
            f"cannot create identity file {path} ({e.strerror or e}); choose a writable path with --identity"
        ) from None
    logger.info("created a new identity in %s (peer id %s); back it up", path, peer_id_of(path))
    return path


def peer_id_of(identity_path: Path) -> str:
    """The base58 peer id that an identity file gives (raises on a corrupt file)."""
    return PeerID.from_identity(Path(identity_path).read_bytes()).to_base58()


def start_dht(
    p2p_cfg: P2PConfig,
    identity_path: Path | None,
    *,
    client_mode: bool = False,
    record_validators: Iterable[RecordValidatorBase] = (),
) -> hivemind.DHT:
    """Start a DHT node (a forked process with its own p2pd) and join `p2p_cfg.initial_peers`.
    Create it before your own threads and give `record_validators` here (ours travel only by fork).
    A bad address or identity, a busy port or silent peers raise `UserError`, the process gone."""
    initial = validate_maddrs(p2p_cfg.initial_peers, "p2p.initial_peers", require_peer_id=True)
    host = validate_maddrs(p2p_cfg.host_maddrs, "p2p.host_maddrs")
    announce = validate_maddrs(p2p_cfg.announce_maddrs, "p2p.announce_maddrs")
    for a in announce:
        if _has_port_zero(a):
            raise UserError(f"p2p.announce_maddrs: {a!r} has port 0; announce the real port others dial")
    kwargs: dict = dict(host_maddrs=host, client_mode=client_mode)
    if announce:
        kwargs["announce_maddrs"] = announce
    throwaway = None
    if identity_path is None and not client_mode:  # a fresh identity for this process, so that it can sign
        throwaway = tempfile.TemporaryDirectory(prefix="diloco-identity-")
        identity_path = Path(throwaway.name) / "identity.key"
        P2P.generate_identity(str(identity_path))
    if identity_path is not None:
        kwargs["identity_path"] = str(load_or_create_identity(Path(identity_path)))
    # Every DHT of ours signs its entries with its identity and verifies everyone's (`signing`);
    # a client without an identity stores nothing: it only verifies.
    validators = [signature_validator(kwargs.get("identity_path")), *record_validators]
    try:
        return _start(initial, p2p_cfg.connect_timeout if initial else STARTUP_TIMEOUT, validators, kwargs,
                      identity_path)
    finally:
        if throwaway is not None:  # p2pd has read it; the validator holds the key
            throwaway.cleanup()


def _start(initial: list[str], timeout: float, validators: list, kwargs: dict, identity_path: Path | str
           ) -> hivemind.DHT:
    """Start the DHT process and wait for it (see `start_dht`)."""
    dht = _OwnedDHT(initial_peers=initial or None, start=False, record_validators=validators, **kwargs)
    dht.run_in_background(await_ready=False)
    try:
        dht.wait_until_ready(timeout=timeout)
    except TimeoutError:
        _stop_failed_dht(dht, reported=False)
        if initial:
            raise UserError(
                f"no answer from the initial peers within {timeout:g} s (p2p.connect_timeout): "
                f"{', '.join(initial)}; check that the address and port are right and open, "
                "and that the peer is running"
            ) from None
        raise UserError(f"the p2p daemon did not start within {timeout:g} s; check p2p.host_maddrs") from None
    except Exception as e:
        _stop_failed_dht(dht, reported=True)
        raise _explain_start_failure(e, initial, kwargs["host_maddrs"], identity_path) from None
    return dht


class _OwnedDHT(hivemind.DHT):
    """hivemind's DHT process, made to die with its parent: a watchdog thread polls the parent (Linux
    has no process-wide parent-death signal) and, once it is gone, stops p2pd and exits."""

    def start(self) -> None:
        self._owner_pid = os.getpid()
        super().start()

    def run(self) -> None:
        # Our callers install their stop handlers before forking us (the node's `StopRequested`);
        # inherited here they would make this process ignore SIGTERM and `terminate()`.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        threading.Thread(target=_exit_with_parent, args=(self._owner_pid,), name="dht-watchdog", daemon=True).start()
        super().run()


def _exit_with_parent(owner: int) -> None:
    """In the DHT process: wait until `owner` is gone, then stop our p2pd and exit."""
    while os.getppid() == owner:
        time.sleep(PARENT_POLL_SECONDS)
    daemons = _p2pd_pids(os.getpid())
    _terminate_pids(daemons)
    deadline = time.monotonic() + STOP_GRACE
    while (left := [p for p in daemons if _is_p2pd(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    _terminate_pids(left, signal.SIGKILL)
    os._exit(1)


def _explain_start_failure(
    e: Exception, initial: list[str], host: list[str], identity_path: Path | None
) -> UserError:
    msg = " ".join(str(e).split())
    if "failed to connect to bootstrap peers" in msg or "none of the initial_peers responded" in msg:
        return UserError(
            f"could not reach any initial peer ({', '.join(initial)}); check that the address, port and "
            "peer id are right, that the peer is running and that its port is open"
        )
    if "already taken" in msg:
        return UserError(
            f"identity {identity_path} is already used by a running peer; stop that peer or give this "
            "one its own identity file"
        )
    if "failed to listen" in msg or "address already in use" in msg:
        return UserError(f"cannot listen on {', '.join(host)} ({msg}); choose a free port in p2p.host_maddrs")
    return UserError(f"the DHT did not start: {msg}")


def _stop_failed_dht(dht: hivemind.DHT, *, reported: bool) -> None:
    """Stop a DHT process whose start failed (`reported`) or hung, never by SIGTERM first: it may hold
    hivemind's process-wide MPFuture lock, which would block every later DHT of ours. A hung one is
    stopped through its p2pd; only a survivor is terminated."""
    if dht.pid is None:
        return
    daemons = _p2pd_pids(dht.pid)
    if not reported:
        _terminate_pids(daemons)
    dht.join(timeout=STOP_GRACE)
    if dht.is_alive():
        logger.warning("the DHT process did not exit after its failed start; terminating it")
        daemons += _p2pd_pids(dht.pid)
        dht.terminate()
        dht.join(timeout=STOP_GRACE)
    _terminate_pids(p for p in daemons if _is_p2pd(p))  # orphans of a DHT that died first


def _p2pd_pids(pid: int) -> list[int]:
    """The p2pd children of `pid`, from /proc (Linux); empty where /proc is unavailable."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return [p for p in out if _is_p2pd(p)]


def _is_p2pd(pid: int) -> bool:
    """Whether `pid` is a running p2pd (a zombie that exited but is not reaped yet is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            head, tail = f.read().rsplit(")", 1)
    except (OSError, ValueError):
        return False
    return head.split("(", 1)[-1] == "p2pd" and tail.split()[:1] != ["Z"]


def _terminate_pids(pids: Iterable[int], sig: int = signal.SIGTERM) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """Multiaddrs others can pass as initial peers (each ends with /p2p/<our peer id>)."""
    return [str(m) for m in dht.get_visible_maddrs(latest=True)]


async def _routing_table_size(_dht: hivemind.DHT, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def dht_peer_count(dht: hivemind.DHT) -> int:
    """How many DHT peers this node knows (its routing table), e.g. the seed's view of the swarm."""
    return int(dht.run_coroutine(_routing_table_size))
