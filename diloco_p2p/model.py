"""The language model and its tokenizer, built locally with no download.

The model is a transformers Llama causal LM built from a size preset (optionally overridden
field by field) or loaded from a local `from_pretrained` directory. The default tokenizer is
byte-level: token = byte + 3, with pad=0, eos=1, unk=2 — exactly the id layout of
transformers' `ByT5Tokenizer(extra_ids=0)`, so an exported model ships a tokenizer that
`AutoTokenizer.from_pretrained` loads, while encoding here stays a fast numpy view of the bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from diloco_p2p.config import ModelConfig
from diloco_p2p.errors import UserError

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


def llama_config(cfg: ModelConfig, vocab_size: int) -> LlamaConfig:
    fields: dict[str, Any] = dict(PRESETS[cfg.preset])
    fields.update({k: getattr(cfg, k) for k in _OVERRIDABLE if getattr(cfg, k) is not None})
    fields.update(vocab_size=vocab_size, tie_word_embeddings=False, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    fields.update(cfg.extra)
    if fields["hidden_size"] % fields["num_attention_heads"]:
        raise UserError("model.hidden_size must be a multiple of model.num_attention_heads")
    try:
        return LlamaConfig(**fields)
    except (TypeError, ValueError) as e:
        raise UserError(f"model: invalid transformers Llama config: {e}") from None


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> torch.nn.Module:
    """A causal LM in fp32 on the CPU; the same `seed` gives the same initial parameters everywhere."""
    if cfg.pretrained_path:
        path = Path(cfg.pretrained_path)
        if not (path / "config.json").is_file():
            raise UserError(f"model.pretrained_path {path} has no config.json; point it at a save_pretrained directory")
        return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, torch_dtype=torch.float32)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(cfg, vocab_size))
    return model.float()


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
