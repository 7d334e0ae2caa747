"""What a state donor announces in the DHT, and the order a joiner tries donors in.

This module also holds the constants both ends of a transfer share (handler name, header bound,
verdict bytes). The protocol: docs/protocol/state-transfer.md
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import hivemind
import pydantic.v1 as pydantic
from hivemind.dht.schema import SchemaValidator
from hivemind.p2p import PeerID

from diloco_p2p.swarm.trust.schema import Hex64, live_values, subkey_validator

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 2  # 2: striped transfers (`stripes`); 1: one stream, the whole blob from an offset
LEGACY_VERSION = 1  # still served, so joiners of older releases keep working
DEFAULT_ANNOUNCE_TTL = 60.0
MAX_HEADER_BYTES = 4096  # our JSON request/reply headers
VERIFIED, REJECTED = b"\x01", b"\x00"  # the joiner's verdict on the bytes, and the donor's last byte


def state_key(run_id: str) -> str:
    return f"{run_id}.state"


def handler_name(run_id: str, version: int = PROTOCOL_VERSION) -> str:
    return f"{run_id}.state.v{version}"


@dataclass(frozen=True)
class StateAnnouncement:
    peer_id: str
    round: int
    sha256: str
    size: int
    params_hash: str | None = None

    def value(self) -> dict[str, Any]:
        """What goes into the DHT (the peer id is the subkey)."""
        return {"round": self.round, "sha256": self.sha256, "size": self.size, "params_hash": self.params_hash}


class AnnouncementValue(pydantic.BaseModel):
    """The announcement as stored: strict types (hivemind's validator rejects conversions)."""

    round: pydantic.conint(strict=True, ge=0)
    sha256: Hex64
    size: pydantic.conint(strict=True, ge=0)
    params_hash: Optional[Hex64] = None

    class Config:
        extra = pydantic.Extra.forbid


def state_validator(run_id: str) -> SchemaValidator:
    """A hivemind validator for this run's state key; pass it to `start_dht(record_validators=...)`
    so storing peers reject malformed announcements (readers check them again anyway)."""
    return subkey_validator("StateSchema", state_key(run_id), AnnouncementValue)


def parse_announcements(found: Any, now: float | None = None) -> list[StateAnnouncement]:
    """Announcements from the result of `dht.get(state_key)`, newest round first: drops
    tombstones, expired and malformed entries (a storing peer may not validate our key)."""
    out = []
    for subkey, value in live_values(found, now):
        if not isinstance(subkey, str):
            continue
        try:
            PeerID.from_base58(subkey)
            v = AnnouncementValue.parse_obj(value)
        except Exception as e:
            logger.debug("dropping a malformed state announcement under %r: %s", subkey, e)
            continue
        out.append(StateAnnouncement(subkey, v.round, v.sha256, v.size, v.params_hash))
    return sorted(out, key=lambda a: (-a.round, a.peer_id))


async def list_donors(dht: hivemind.DHT, run_id: str, timeout: float = 10.0) -> list[StateAnnouncement]:
    """Every live announcement of the run, newest round first (raises TimeoutError past `timeout`)."""
    found = await asyncio.wait_for(dht.get(state_key(run_id), latest=True, return_future=True), timeout)
    return parse_announcements(found)


def rendezvous_order(joiner: str, donors: Iterable[str]) -> list[str]:
    """Donors in this joiner's order: by H(joiner ‖ donor), highest first (rendezvous hashing)."""

    def score(donor: str) -> bytes:
        return hashlib.sha256(f"{joiner}\n{donor}".encode()).digest()

    return sorted(set(donors), key=lambda d: (score(d), d), reverse=True)


def order_candidates(
    announcements: Sequence[StateAnnouncement], joiner: str, prefer: Sequence[str] = ()
) -> list[StateAnnouncement]:
    """The order a joiner tries donors in: states newest round first, then most donors, then by
    hash; within one, the donors in `prefer` first, then this joiner's rendezvous order."""
    groups: dict[tuple[int, str], list[StateAnnouncement]] = {}
    for a in announcements:
        groups.setdefault((a.round, a.params_hash or a.sha256), []).append(a)
    rank = {p: i for i, p in enumerate(prefer)}
    out: list[StateAnnouncement] = []
    for (_, _), members in sorted(groups.items(), key=lambda kv: (-kv[0][0], -len(kv[1]), kv[0][1])):
        by_peer = {a.peer_id: a for a in members}
        hashed = {p: i for i, p in enumerate(rendezvous_order(joiner, by_peer))}
        out += sorted(by_peer.values(), key=lambda a: (rank.get(a.peer_id, len(rank)), hashed[a.peer_id]))
    return out
