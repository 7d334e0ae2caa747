"""`data`: the training corpus, local or fetched from the swarm, and its held-out split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from diloco_p2p.config.section import Section

SWARM_PREFIX = "swarm:"  # data.path=swarm:<dataset id>: fetch that prepared corpus from the swarm


class DataConfig(Section):
    path: str | None = Field(
        None,
        description="A corpus prepared by `diloco-p2p prepare` (a directory with manifest.json, memory-mapped), or "
        "a text file, a directory, a JSONL or Parquet file (prepared once into the run directory); "
        "swarm:<dataset id> = a prepared corpus fetched from the swarm's peers as training needs it; "
        "unset = the embedded default corpus (the Python standard library's sources).",
    )
    eval_fraction: float = Field(
        0.02, gt=0, lt=0.5, description="Share of the corpus held out for evaluation; the same split on every node."
    )
    order_key: str | None = Field(
        None,
        description="Key that fixes this node's training order; unset = the node's identity, so nodes see "
        "different data without coordinating.",
    )
    max_bytes: int | None = Field(
        None, gt=0, description="Read at most this many bytes of the corpus (quick experiments)."
    )
    dataset_id: str | None = Field(
        None,
        description="Id of a prepared corpus (its manifest's hash), filled from `data.path`'s manifest.json; every "
        "node of a run must have the same one. Set it to pin a run to one dataset; with no data.path, the node "
        "fetches that corpus from the swarm's peers (as with data.path=swarm:<id>).",
        pattern=r"^[0-9a-f]{64}$",
    )
    cache_bytes: int | None = Field(
        None, gt=0, description="Disk kept for the shards of a corpus fetched from the swarm; past it, shards the "
        "node has finished with are deleted. Unset = keep every shard.",
    )
    serve: bool = Field(True, description="Serve the shards of the prepared corpus this node holds to its peers.")
    fetch_timeout: float = Field(
        60.0, gt=0, description="Seconds to find a peer serving the corpus's manifest or a shard, and fetch it.",
    )
    prefetch_shards: int = Field(
        2, ge=1, description="Shards of a corpus from the swarm fetched ahead of the node's data position.",
    )

    @model_validator(mode="before")
    @classmethod
    def _dataset_id_from_manifest(cls, data: Any) -> Any:
        """A prepared `path` names its dataset: its id joins the fields the swarm agrees on."""
        if isinstance(data, dict) and str(data.get("path") or "").startswith(SWARM_PREFIX):
            dataset = str(data["path"])[len(SWARM_PREFIX):]
            if data.get("dataset_id") not in (None, dataset):
                raise ValueError(f"data.path names dataset {dataset} but data.dataset_id is {data['dataset_id']}")
            return {**data, "path": None, "dataset_id": dataset}
        if isinstance(data, dict) and data.get("path") and not data.get("dataset_id"):
            try:
                manifest = json.loads((Path(data["path"]) / "manifest.json").read_text())
                data = {**data, "dataset_id": str(manifest["id"])}
            except (OSError, ValueError, KeyError, TypeError):
                pass  # not a prepared corpus (or a damaged one: opening it says so)
        return data
