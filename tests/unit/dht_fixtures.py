"""DHT values for unit tests: progress records (`make(peer, **fields)` with sensible defaults),
the signed-less `DHTRecord` a storing peer's validator sees (`dht_record`), and real peers:
`PEERS[i]` is the peer id of RSA key `KEYS[i]`, `subkey(peer)` its signed entries' subkey
(`subkey(peer, signer=other)`: an entry `other` signs while claiming to be `peer`)."""

from __future__ import annotations

from typing import Any

from hivemind.dht.crypto import DHTRecord
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.utils.crypto import RSAPrivateKey

from diloco_p2p.config import Config
from diloco_p2p.swarm.membership.records import ProgressRecord
from diloco_p2p.swarm.trust.signing import owned_subkey, peer_id_of_public_key, public_key_text

KEYS = [RSAPrivateKey() for _ in range(9)]
PEERS = [peer_id_of_public_key(public_key_text(k)) for k in KEYS]


def subkey(peer: str, signer: str | None = None) -> str:
    return owned_subkey(peer, public_key_text(KEYS[PEERS.index(signer or peer)]))


NOW = 1_000_000.0


def make(peer: str = PEERS[0], cfg: Config | None = None, **kw) -> ProgressRecord:
    cfg = cfg or Config(run_id="r")
    fields = dict(
        peer_id=peer,
        round=3,
        step=30,
        tokens=3840,
        tokens_per_s=12.5,
        params_sha256="a" * 64,
        config_hash=cfg.swarm_hash(),
        config_view=cfg.swarm_view(),
        status="committed",
        train_loss=4.25,
        eval_loss=4.5,
        group_size=3,
        updated=NOW,
    )
    fields.update(kw)
    return ProgressRecord.build(**fields)


def dht_record(key: str, subkey: Any, value: Any, expiration: float = NOW + 60) -> DHTRecord:
    """`value` under `key`/`subkey`, serialized as hivemind stores it."""
    ser = DHTProtocol.serializer
    return DHTRecord(
        key=DHTID.generate(source=key).to_bytes(),
        subkey=ser.dumps(subkey),
        value=ser.dumps(value),
        expiration_time=expiration,
    )
