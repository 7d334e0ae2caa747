"""Progress records for unit tests: `make(peer, **fields)` with sensible defaults."""

from __future__ import annotations

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
