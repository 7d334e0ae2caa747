"""Model sizes for the benchmarks: `tiny` (the preset) or `HIDDENxLAYERS` (intermediate = 3 x
hidden, 64-wide heads), as `--set` overrides, and their parameter counts."""

from __future__ import annotations

from diloco_p2p.config import load_config
from diloco_p2p.model.build import build_model, build_tokenizer, count_parameters


def size_overrides(size: str) -> list[str]:
    if size == "tiny":
        return []
    hidden, layers = (int(x) for x in size.split("x"))
    return [f"model.hidden_size={hidden}", f"model.intermediate_size={3 * hidden}",
            f"model.num_hidden_layers={layers}", f"model.num_attention_heads={hidden // 64}",
            f"model.num_key_value_heads={hidden // 64}"]


def parameters(overrides: list[str]) -> int:
    cfg = load_config(None, overrides).model
    return count_parameters(build_model(cfg, build_tokenizer(cfg).vocab_size, 0))
