"""The configuration tree: one pydantic v2 model per component, loaded from YAML or TOML.

Precedence is defaults < file < ``--set a.b=value`` overrides. Every model forbids unknown
keys so a typo fails loudly, and every field carries a description: the config
reference (docs/config.md) is generated from these descriptions (``tests/unit/test_readme.py`` keeps it in
sync). Each component receives only its own sub-config. One module per section (`model`, `data`,
`training`, `sync`, `node`), the whole tree and its swarm view in `tree`, loading in `load`; the
names are re-exported here, so ``from diloco_p2p.config import X`` is the way in.
"""

from __future__ import annotations

from diloco_p2p.config.data import SWARM_PREFIX, DataConfig
from diloco_p2p.config.load import (
    apply_override,
    config_reference,
    config_tree,
    load_config,
    parse_override,
    save_config,
    validate_config,
)
from diloco_p2p.config.model import ModelConfig
from diloco_p2p.config.node import LogConfig, MetricsConfig, P2PConfig
from diloco_p2p.config.sync import AdmissionConfig, SyncConfig
from diloco_p2p.config.training import InnerConfig, OuterConfig, TrainConfig
from diloco_p2p.config.tree import Config, config_fields, diff_swarm_fields

__all__ = [
    "SWARM_PREFIX", "AdmissionConfig", "Config", "DataConfig", "InnerConfig", "LogConfig", "MetricsConfig",
    "ModelConfig", "OuterConfig", "P2PConfig", "SyncConfig", "TrainConfig", "apply_override", "config_reference",
    "config_fields", "config_tree", "diff_swarm_fields", "load_config", "parse_override", "save_config", "validate_config",
]
