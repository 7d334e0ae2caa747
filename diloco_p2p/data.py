"""Training text: loading, a fixed held-out split, and a per-node training order.

The embedded default corpus is the Python standard library's own source files (about 11 MB
of real text on every machine that has Python, so nothing is downloaded). The token stream
is cut into windows of ``seq_len + 1`` tokens. A window belongs to the eval split by a hash
of its index alone, so every node with the same corpus holds out the same windows. The
training order is a per-epoch permutation seeded by the node's *order key* (its identity in a
swarm), not by the run's ``seed``: ``seed`` must be equal on every node (it fixes the initial
parameters) while nodes should see different data without coordinating. The position in that
order is part of every checkpoint, so a resumed run neither repeats nor skips a batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diloco_p2p.config import DataConfig
from diloco_p2p.errors import UserError
from diloco_p2p.model import Tokenizer

_SKIP_STDLIB_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo"}


def default_corpus_files() -> Iterator[Path]:
    """The standard library's sources in sorted path order, walked lazily: a corpus cut at
    `data.max_bytes` reads only the files it uses."""
    return _sorted_py_files(Path(sysconfig.get_paths()["stdlib"]))


def _sorted_py_files(directory: Path) -> Iterator[Path]:
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in _SKIP_STDLIB_DIRS:
                yield from _sorted_py_files(Path(entry.path))
        elif entry.name.endswith(".py") and entry.is_file():
            yield Path(entry.path)


def _documents(path: str | None) -> Iterator[bytes]:
    if path is None:
        for f in default_corpus_files():
            yield f.read_bytes()
        return
    p = Path(path)
    if not p.exists():
        raise UserError(f"data.path {path!r} does not exist; point it at a text file, a directory or a .jsonl file")
    if p.is_dir():
        files = [f for f in sorted(p.rglob("*")) if f.is_file() and not f.name.startswith(".")]
        if not files:
            raise UserError(f"data.path {path!r} is an empty directory; put text files in it")
        for f in files:
            yield f.read_bytes()
    elif p.suffix == ".jsonl":
        for lineno, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"data.path {path}: line {lineno} is not a JSON object with a 'text' field") from None
            yield str(text).encode()
    else:
        yield p.read_bytes()


def load_tokens(cfg: DataConfig, tokenizer: Tokenizer) -> np.ndarray:
    """The whole corpus as one token stream, documents separated by EOS."""
    parts: list[np.ndarray] = []
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    budget = cfg.max_bytes
    for doc in _documents(cfg.path):
        if budget is not None:
            doc = doc[:budget]
            budget -= len(doc)
        parts += [tokenizer.encode(doc), eos]
        if budget is not None and budget <= 0:
            break
    if not parts:
        raise UserError(f"data.path {cfg.path!r} holds no text")
    return np.concatenate(parts)


def _is_eval(index: np.ndarray, fraction: float) -> np.ndarray:
    # Knuth's multiplicative hash spreads held-out windows evenly through the corpus.
    h = (index.astype(np.uint64) * np.uint64(2654435761)) % np.uint64(2**32)
    return h < np.uint64(int(fraction * 2**32))


@dataclass
class DataPosition:
    """Where this node is in its training order; saved in every checkpoint."""

    epoch: int = 0
    offset: int = 0


class TextDataset:
    def __init__(self, tokens: np.ndarray, seq_len: int, eval_fraction: float, order_key: str):
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len = seq_len
        n_windows = (len(tokens) - 1) // seq_len
        index = np.arange(n_windows)
        held_out = _is_eval(index, eval_fraction)
        self.train_windows = index[~held_out]
        self.eval_windows = index[held_out]
        if len(self.train_windows) == 0 or len(self.eval_windows) == 0:
            raise UserError(
                f"corpus too small: {len(tokens)} tokens give {n_windows} windows of inner.seq_len={seq_len}; "
                "use more text or a shorter inner.seq_len"
            )
        self.order_key = order_key
        self.position = DataPosition()
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    @property
    def fingerprint(self) -> str:
        """sha256 of the token stream: two nodes with equal fingerprints hold out the same eval split."""
        return hashlib.sha256(self.tokens.numpy().tobytes()).hexdigest()

    def _window(self, i: int) -> torch.Tensor:
        start = int(i) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            digest = hashlib.sha256(f"{self.order_key}:{epoch}".encode()).digest()
            rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
            self._order = rng.permutation(self.train_windows)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """The next `batch_size` training windows, shape (batch, seq_len + 1); advances the position."""
        rows = []
        while len(rows) < batch_size:
            order = self._epoch_order(self.position.epoch)
            if self.position.offset >= len(order):
                self.position = DataPosition(self.position.epoch + 1, 0)
                continue
            rows.append(self._window(order[self.position.offset]))
            self.position.offset += 1
        return torch.stack(rows)

    def eval_batches(self, batch_size: int, n_batches: int) -> list[torch.Tensor]:
        """The first `n_batches` held-out batches, in corpus order: identical on every node."""
        windows = self.eval_windows[: batch_size * n_batches]
        rows = [self._window(i) for i in windows]
        return [torch.stack(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]


def build_dataset(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, order_key: str) -> TextDataset:
    return TextDataset(load_tokens(cfg, tokenizer), seq_len, cfg.eval_fraction, cfg.order_key or order_key)
