"""Closed runs: who may take part (`sync.admission`).

An open run admits any peer that knows the run id. A closed run admits the peer ids listed in
`sync.admission.peers` and the holders of an admission token (``{run_id, peer_id, expires}``
signed by the run owner's RSA key, issued with ``diloco-p2p admit``), published in the holder's
progress record. A token is bound to one peer id, which p2pd proves on every stream, so a copied
token admits nobody else. In a closed run a node refuses every stream and record of anyone else
(`Admission.check_stream`), each refusal a ``not-admitted`` rejection (`guard`).
Closed runs: docs/protocol/records.md
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from diloco_p2p.config import AdmissionConfig
from diloco_p2p.errors import UserError
from diloco_p2p.swarm.trust.guard import Guard

TOKEN_VERSION = 1
# A peer unknown to us may have published its token a moment ago: re-read the records at most
# this often when an unknown peer opens a stream.
REFRESH_INTERVAL = 2.0


class TokenError(ValueError):
    """A token that does not admit its bearer (malformed, another run, expired, not signed by the owner)."""


def _statement(run_id: str, peer_id: str, expires: float | None) -> bytes:
    return json.dumps({"v": TOKEN_VERSION, "run_id": run_id, "peer_id": peer_id, "expires": expires},
                      sort_keys=True, separators=(",", ":")).encode()


def issue_token(owner: RSAPrivateKey, run_id: str, peer_id: str, expires: float | None = None) -> str:
    """A token admitting `peer_id` to `run_id` until `expires` (unix time; None: for good)."""
    statement = _statement(run_id, peer_id, expires)
    return base64.b64encode(statement).decode() + "." + owner.sign(statement).decode()


def verify_token(token: str, owner_key: str, run_id: str, now: float | None = None) -> str:
    """The peer id `token` admits to `run_id` (raises `TokenError` saying why not)."""
    try:
        body, signature = token.strip().split(".")
        statement = base64.b64decode(body, validate=True)
        fields = json.loads(statement)
        public = RSAPublicKey.from_bytes(owner_key.encode())
    except Exception:
        raise TokenError("not an admission token") from None
    if not isinstance(fields, dict) or fields.get("v") != TOKEN_VERSION:
        raise TokenError("not an admission token of this version")
    if not public.verify(statement, signature.encode()):
        raise TokenError("not signed by the run owner's key")
    if fields.get("run_id") != run_id:
        raise TokenError(f"issued for run {fields.get('run_id')!r}, not {run_id!r}")
    expires = fields.get("expires")
    if expires is not None and (not isinstance(expires, (int, float)) or expires < (now or time.time())):
        raise TokenError("expired")
    peer = fields.get("peer_id")
    if not isinstance(peer, str):
        raise TokenError("names no peer")
    return peer


def read_token(path: str | Path) -> str:
    """This node's token from its file (`sync.admission.token_path`); `UserError` if unreadable."""
    try:
        return Path(path).expanduser().read_text().strip()
    except OSError as e:
        raise UserError(
            f"sync.admission.token_path: cannot read {path} ({e.strerror or e}); ask the run owner for a token "
            "(diloco-p2p admit) and give its file here"
        ) from None


class Admission:
    """Who this node lets in, for one run. `refresh` re-reads the run's records (and calls
    `learn`); it is awaited when a peer we do not know yet opens a stream."""

    def __init__(self, cfg: AdmissionConfig, run_id: str, me: str, guard: Guard,
                 refresh: Callable[[], Awaitable[object]] | None = None):
        self.cfg, self.run_id, self.me, self.guard, self.refresh = cfg, run_id, me, guard, refresh
        self.open = cfg.mode == "open"
        self.listed = frozenset(cfg.peers)
        self.by_token: set[str] = set()
        self.token = read_token(cfg.token_path) if cfg.token_path else None
        if self.token is not None and cfg.owner_key:
            try:
                if verify_token(self.token, cfg.owner_key, run_id) != me:
                    raise TokenError(f"issued for another peer id, not this node's {me}")
            except TokenError as e:
                raise UserError(f"sync.admission.token_path: the token in {cfg.token_path} {e}; ask the run "
                                f"owner for a token for peer id {me} (diloco-p2p admit --peer-id {me})") from None
        self._refreshed = float("-inf")
        self._refreshing: asyncio.Lock | None = None

    def admits(self, peer: str) -> bool:
        return self.open or peer == self.me or peer in self.listed or peer in self.by_token

    def learn(self, tokens: Iterable[tuple[str, str | None]]) -> None:
        """Admit each peer whose token (from its signed record) the owner's key verifies."""
        if self.open or not self.cfg.owner_key:
            return
        for peer, token in tokens:
            if token is None or peer in self.by_token:
                continue
            try:
                admitted = verify_token(token, self.cfg.owner_key, self.run_id)
            except TokenError as e:
                self.guard.reject(peer, "not-admitted", f"its admission token is {e}")
                continue
            if admitted == peer:
                self.by_token.add(peer)
            else:
                self.guard.reject(peer, "not-admitted", f"it publishes the admission token of {admitted}")

    def filter(self, peers: Iterable[str], what: str) -> set[str]:
        """The peers of `peers` we admit; the others are refused (``not-admitted``) for `what`."""
        out = set()
        for peer in peers:
            if self.admits(peer):
                out.add(peer)
            else:
                self.guard.reject(peer, "not-admitted", f"{what} from a peer this closed run has not admitted")
        return out

    def refuses_donor(self, peer: str) -> bool:
        """A donor this closed run has not admitted: refused (`not-admitted`) before it is asked anything."""
        if self.admits(peer):
            return False
        self.guard.reject(peer, "not-admitted", "it announces a state in a closed run")
        return True

    async def check_stream(self, peer: str, what: str) -> bool:
        """Whether to serve a `what` stream opened by `peer` (its id proven by p2pd)."""
        if self.admits(peer):
            return True
        if self.refresh is not None and self.cfg.owner_key:  # only a token can admit it now
            if self._refreshing is None:
                self._refreshing = asyncio.Lock()
            async with self._refreshing:
                loop = asyncio.get_running_loop()
                if not self.admits(peer) and loop.time() - self._refreshed >= REFRESH_INTERVAL:
                    self._refreshed = loop.time()
                    try:
                        await self.refresh()
                    except Exception:  # the DHT did not answer: decide on what we know
                        pass
        return bool(self.filter([peer], f"a stream ({what})"))
