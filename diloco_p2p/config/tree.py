"""`Config`: the whole tree, the checks that span its sections, and the fields the swarm agrees on.

`swarm_view` is hashed into every record a peer checks: nodes with another hash are refused.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar

from pydantic import Field, model_validator

from diloco_p2p.config import overlap_modes
from diloco_p2p.config.compression import CODECS
from diloco_p2p.config.data import DataConfig
from diloco_p2p.config.model import ModelConfig
from diloco_p2p.config.node import LogConfig, MetricsConfig, P2PConfig
from diloco_p2p.config.section import Section
from diloco_p2p.config.sync import SyncConfig
from diloco_p2p.config.training import InnerConfig, OuterConfig, TrainConfig

# The all-reduce's wire protocol (`swarm.collective.wire`), in every swarm view: nodes that cannot
# average with each other do not match (a checkpoint resumes across it: `loop.checkpoint`).
ALLREDUCE_PROTOCOL = 5
PROTOCOL_KEY = "protocol"


class Config(Section):
    run_id: str = Field(
        "diloco", min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description="Names the run; namespaces every DHT key."
    )
    seed: int = Field(0, description="Fixes the initial parameters; must be equal on every node of a run.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The language model.")
    data: DataConfig = Field(default_factory=DataConfig, description="The training corpus.")
    inner: InnerConfig = Field(default_factory=InnerConfig, description="The inner AdamW steps.")
    outer: OuterConfig = Field(default_factory=OuterConfig, description="The DiLoCo outer step.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The training loop.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Averaging with the swarm.")
    p2p: P2PConfig = Field(default_factory=P2PConfig, description="The DHT and libp2p transport.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="The Prometheus endpoint.")
    log: LogConfig = Field(default_factory=LogConfig, description="Logging.")

    # Fields that must be equal on every node of a swarm: they fix the parameters' shapes and
    # values, the outer trajectory and the wire format. Everything else (batch size, data path,
    # ports) may differ between volunteers.
    # A prepared corpus's `data.dataset_id` too (absent when unset: a plain-text or default
    # corpus may differ between volunteers, and older checkpoints stay resumable).
    SWARM_FIELDS: ClassVar[tuple[str, ...]] = (
        "run_id", "seed", "model", "outer", "sync.compression", "inner.seq_len", "data.dataset_id",
        "sync.topk_density",  # only under a sparse compression (topk2): other runs keep their hash
        "sync.overlap",  # absent when none: older runs keep their hash
        "sync.fragments",  # fixes each round's part of the parameters; absent at 1
        "sync.target_group_size",  # fixes the all-reduce's grid (`swarm.collective.hierarchy`); absent at 16, the default
        # How reducers aggregate and bound contributions (`swarm.collective.aggregate`); absent at the defaults.
        "sync.aggregation", "sync.trim_fraction", "sync.clip_radius", "sync.max_norm_ratio", "sync.weight_cap",
        "sync.max_weight_ratio", "sync.opposed_cosine", "sync.min_part_ratio",
        "sync.average_moments",  # a second all-reduce each round; absent when off
    )
    _VIEW_DEFAULTS: ClassVar[dict[str, Any]] = {
        "sync.aggregation": "mean", "sync.trim_fraction": 0.25, "sync.clip_radius": 1.0, "sync.max_norm_ratio": 8.0,
        "sync.weight_cap": 4.0, "sync.max_weight_ratio": 16.0, "sync.opposed_cosine": 0.0, "sync.min_part_ratio": 0.5,
        "sync.average_moments": False,
        # The outer schedules (`diloco_p2p.config.schedule`): absent while off, so runs from before keep their hash.
        "outer.h_schedule": "constant", "outer.h_start": 1, "outer.warmup_rounds": 0, "outer.lr_start": None,
    }
    # outer.recipe and outer.nodes only choose the fields above: the values they chose are hashed.
    _VIEW_INPUTS: ClassVar[tuple[str, ...]] = ("outer.recipe", "outer.nodes")

    @model_validator(mode="after")
    def _overlap_fits(self) -> Config:
        # The eager correction runs the outer step on its own input (diloco_p2p.loop.overlap): a plain
        # (Nesterov) momentum step, and H known when the round in flight is averaged.
        overlap = self.sync.overlap_mode
        if not overlap.blocking and self.outer.delayed_nesterov:
            raise ValueError("sync.overlap needs outer.delayed_nesterov unset (the overlapped step is plain Nesterov)")
        if not overlap.blocking and self.outer.dynamic_local_updates:
            raise ValueError("sync.overlap and outer.dynamic_local_updates cannot be combined")
        if overlap.hides == "steps" and max(self.sync.overlap_steps, 1) >= self.outer.inner_steps:
            raise ValueError(f"sync.overlap={overlap.name} needs sync.overlap_steps ({self.sync.overlap_steps}) below "
                             f"outer.inner_steps ({self.outer.inner_steps}) and H >= 2: the average lands inside "
                             "the next round")
        if self.sync.fragments > 1 and not overlap.fragments:
            with_fragments = " or ".join(m.name for m in overlap_modes.MODES.values() if m.fragments)
            raise ValueError(f"sync.fragments={self.sync.fragments} runs with sync.overlap {with_fragments}, not "
                             f"{overlap.name}")
        if self.sync.fragments > 1 and self.outer.delayed_nesterov:
            raise ValueError("sync.fragments > 1 needs outer.delayed_nesterov unset (each part takes its own step)")
        if self.outer.scheduled and (not overlap.blocking or self.sync.fragments > 1 or self.outer.delayed_nesterov
                                     or self.outer.dynamic_local_updates):
            raise ValueError("outer.h_schedule and outer.warmup_rounds run with sync.overlap=none, sync.fragments=1, "
                             "outer.delayed_nesterov unset and outer.dynamic_local_updates=false; set "
                             "outer.h_schedule=constant and outer.warmup_rounds=0")
        return self

    @model_validator(mode="before")
    @classmethod
    def _recipe(cls, data: Any) -> Any:
        """outer.recipe=auto: the outer fields the config leaves unset, from `diloco_p2p.config.recipe`."""
        outer = data.get("outer") if isinstance(data, dict) else None
        if isinstance(outer, dict) and outer.get("recipe") == "auto":
            from diloco_p2p.config.recipe import recipe

            train, sync, inner = (data.get(k) if isinstance(data.get(k), dict) else {} for k in ("train", "sync", "inner"))
            fields = OuterConfig.model_fields
            try:
                overlap = overlap_modes.MODES.get(sync.get("overlap", SyncConfig.model_fields["overlap"].default))
                schedules = (overlap is not None and overlap.blocking and int(sync.get("fragments", 1)) == 1
                             and not outer.get("delayed_nesterov") and not outer.get("dynamic_local_updates"))
                chosen = recipe(int(outer.get("nodes", fields["nodes"].default)),
                                int(train.get("max_rounds", TrainConfig.model_fields["max_rounds"].default)),
                                int(outer.get("inner_steps", fields["inner_steps"].default)), schedules,
                                str(inner.get("optimizer", InnerConfig.model_fields["optimizer"].default)))
            except (TypeError, ValueError):
                return data  # a malformed input: the field's own check names it
            data = {**data, "outer": {**chosen, **outer}}
        return data

    def swarm_view(self) -> dict[str, Any]:
        """The flattened fields that must agree across the swarm, by dotted path."""
        flat = _flatten(self.model_dump(mode="json"))
        return {k: v for k, v in flat.items() if any(k == f or k.startswith(f + ".") for f in self.SWARM_FIELDS)
                and not (k == "data.dataset_id" and v is None) and not (k == "sync.overlap" and v == "none")
                and not (k == "sync.target_group_size" and v == 16) and not (k == "sync.fragments" and v == 1)
                and not (k in self._VIEW_DEFAULTS and v == self._VIEW_DEFAULTS[k]) and k not in self._VIEW_INPUTS
                and not (k == "sync.topk_density" and not CODECS[self.sync.compression].sparse)} | {
            PROTOCOL_KEY: ALLREDUCE_PROTOCOL} | (  # averaged moments mean the same on every node: one optimizer
            {"inner.optimizer": self.inner.optimizer} if self.sync.average_moments else {})

    def swarm_hash(self) -> str:
        """sha256 over `swarm_view()`; peers with a different hash are refused."""
        blob = json.dumps(self.swarm_view(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def config_fields(view: dict[str, Any] | None) -> dict[str, Any] | None:
    """A swarm view without the protocol: the config's own fields (what a checkpoint must match)."""
    return None if view is None else {k: v for k, v in view.items() if k != PROTOCOL_KEY}


def diff_swarm_fields(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Dotted paths whose values differ between two `swarm_view()` dicts, as 'path: ours != theirs'."""
    keys = sorted(set(ours) | set(theirs))
    return [f"{k}: {ours.get(k)!r} != {theirs.get(k)!r}" for k in keys if ours.get(k) != theirs.get(k)]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key != "extra":
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out
