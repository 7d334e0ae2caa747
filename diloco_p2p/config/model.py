"""`model`: the language model a run trains (a preset, its overrides, or a local pretrained model)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from diloco_p2p.config.section import Section


class ModelConfig(Section):
    preset: Literal["tiny", "small", "35m", "150m", "1b"] = Field(
        "tiny", description="Llama-architecture size preset; the fields below override it."
    )
    pretrained_path: str | None = Field(
        None, description="Local directory with a transformers model (`from_pretrained`); replaces the preset."
    )
    tokenizer_path: str | None = Field(
        None, description="Local tokenizer directory; unset = the built-in byte-level tokenizer (no download)."
    )
    hidden_size: int | None = Field(None, gt=0, description="Override the preset's hidden size.")
    intermediate_size: int | None = Field(None, gt=0, description="Override the preset's MLP width.")
    num_hidden_layers: int | None = Field(None, gt=0, description="Override the preset's number of blocks.")
    num_attention_heads: int | None = Field(None, gt=0, description="Override the preset's attention heads.")
    num_key_value_heads: int | None = Field(None, gt=0, description="Override the preset's key/value heads.")
    max_position_embeddings: int | None = Field(None, gt=0, description="Override the preset's context size.")
    extra: dict[str, Any] = Field(
        default_factory=dict, description="More `LlamaConfig` fields of the built-in Llama: rope_theta, rms_norm_eps, "
        "initializer_range, tie_word_embeddings (any other architecture: model.pretrained_path)."
    )
