"""DHT values for unit tests: progress records (`make(peer, **fields)` with sensible defaults)
and the signed-less `DHTRecord` a storing peer's validator sees (`dht_record`)."""

from __future__ import annotations

from typing import Any

from hivemind.dht.crypto import DHTRecord
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID

from diloco_p2p.config import Config
from diloco_p2p.swarm.records import ProgressRecord

PEERS = [f"12D3KooW{c * 44}" for c in "ABCDEFG"]
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
