"""The language model and its tokenizer, built locally with no download.

The model is a Llama causal LM (`diloco_p2p.model.llama`: transformers' `LlamaForCausalLM`, op for op and
name for name) built from a size preset (optionally overridden field by field), or any transformers
causal LM loaded from a local `from_pretrained` directory. The default tokenizer is
byte-level: token = byte + 3, with pad=0, eos=1, unk=2 — exactly the id layout of
transformers' `ByT5Tokenizer(extra_ids=0)`, so an exported model ships a tokenizer that
`AutoTokenizer.from_pretrained` loads, while encoding here stays a fast numpy view of the bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from diloco_p2p.config import ModelConfig
from diloco_p2p.errors import UserError
from diloco_p2p.model.llama import Llama, LlamaShape

# Transformer shapes. `tiny` is a ~0.4M-parameter model that trains on 2 CPU cores in about a
# minute; `small` (4.2M non-embedding parameters) is the smallest shape whose quality says something
# about real ones and still trains on a CPU; `35m` is the DiLoCo scaling-laws paper's smallest model
# (6 layers, d=512, 8 heads, MLP 2048: 25M non-embedding parameters with the byte vocabulary); `150m` follows the DiLoCo paper's 150M model (12 layers, d=768, 12 heads); `1b`
# follows OpenDiLoCo's 1.1B model (TinyLlama shape: 22 layers, d=2048, 32 heads, 4 KV heads).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512,
    ),
    "small": dict(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512,
    ),
    "35m": dict(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=1024,
    ),
    "150m": dict(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=12, max_position_embeddings=1024,
    ),
    "1b": dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=2048,
    ),
}

_OVERRIDABLE = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings",
)
# The model.extra fields the Llama reads (`LlamaConfig`'s names), with their types.
EXTRA_FIELDS: dict[str, type] = {"rope_theta": float, "rms_norm_eps": float, "initializer_range": float,
                                 "tie_word_embeddings": bool}


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: bytes) -> np.ndarray: ...

    def save(self, directory: Path) -> None: ...


class ByteTokenizer:
    """Bytes as tokens, in `ByT5Tokenizer(extra_ids=0)`'s id layout."""

    offset = 3
    vocab_size = 259
    pad_id, eos_id, unk_id = 0, 1, 2

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8).astype(np.int32) + self.offset

    def decode(self, ids: list[int]) -> str:
        return bytes(i - self.offset for i in ids if i >= self.offset).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        from transformers import ByT5Tokenizer

        ByT5Tokenizer(extra_ids=0).save_pretrained(str(directory))


class HFTokenizer:
    """A local transformers tokenizer directory."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise UserError(f"model.tokenizer_path {path!r} is not a loadable tokenizer directory: {e}") from None
        self.vocab_size = len(self._tok)
        self.eos_id = self._tok.eos_token_id if self._tok.eos_token_id is not None else 0
        self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id

    def encode(self, text: bytes) -> np.ndarray:
        ids = self._tok(text.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=np.int32)

    def save(self, directory: Path) -> None:
        self._tok.save_pretrained(str(directory))


def build_tokenizer(cfg: ModelConfig) -> Tokenizer:
    if cfg.tokenizer_path:
        return HFTokenizer(cfg.tokenizer_path)
    if cfg.pretrained_path and (Path(cfg.pretrained_path) / "tokenizer_config.json").is_file():
        return HFTokenizer(cfg.pretrained_path)
    return ByteTokenizer()


def llama_shape(cfg: ModelConfig, vocab_size: int) -> LlamaShape:
    fields: dict[str, Any] = dict(PRESETS[cfg.preset])
    fields.update({k: getattr(cfg, k) for k in _OVERRIDABLE if getattr(cfg, k) is not None})
    unknown = sorted(set(cfg.extra) - set(EXTRA_FIELDS))
    if unknown:
        raise UserError(f"model.extra: {', '.join(unknown)} not supported by the built-in Llama (it reads "
                        f"{', '.join(EXTRA_FIELDS)}); train another architecture from model.pretrained_path")
    for key, value in cfg.extra.items():
        kind = EXTRA_FIELDS[key]
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, (int, float)):
            raise UserError(f"model.extra.{key}: {value!r} is not a {kind.__name__}")
        fields[key] = kind(value)
    if fields["hidden_size"] % fields["num_attention_heads"]:
        raise UserError("model.hidden_size must be a multiple of model.num_attention_heads")
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise UserError("model.num_attention_heads must be a multiple of model.num_key_value_heads")
    return LlamaShape(vocab_size=vocab_size, pad_token_id=ByteTokenizer.pad_id, **fields)


def llama_config(shape: LlamaShape) -> Any:
    """transformers' `LlamaConfig` of the same model (an export's config.json)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta, rms_norm_eps=shape.rms_norm_eps, initializer_range=shape.initializer_range,
        tie_word_embeddings=shape.tie_word_embeddings, bos_token_id=None, eos_token_id=ByteTokenizer.eos_id,
        pad_token_id=shape.pad_token_id,
    )


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> torch.nn.Module:
    """A causal LM in fp32 on the CPU; the same `seed` gives the same initial parameters everywhere."""
    if cfg.pretrained_path:
        from transformers import AutoModelForCausalLM

        path = Path(cfg.pretrained_path)
        if not (path / "config.json").is_file():
            raise UserError(f"model.pretrained_path {path} has no config.json; point it at a save_pretrained directory")
        return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, torch_dtype=torch.float32)
    shape = llama_shape(cfg, vocab_size)
    torch.manual_seed(seed)
    return Llama(shape)


def save_pretrained(model: torch.nn.Module, directory: Path) -> None:
    """Write `model` in the transformers format (config.json and safetensors)."""
    if isinstance(model, Llama):
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            hf = LlamaForCausalLM(llama_config(model.shape))
        hf.load_state_dict(model.state_dict(), assign=True)
        model = hf
    model.save_pretrained(str(directory), safe_serialization=True)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
