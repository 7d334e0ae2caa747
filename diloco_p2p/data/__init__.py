"""Training data: read documents, tokenize once into shards, train on memory-mapped windows.

`documents` (text, JSONL, Parquet, saved datasets; the embedded default corpus), `encode`
(documents to ids + EOS; a tokenizer's identity), `prepare` (the resumable, atomic shard writer),
`manifest` (the prepared corpus on disk and its dataset id), `dataset` (windows, the eval split,
the keyed training order) and `cache` (a corpus fetched from the swarm shard by shard).
`open_dataset` is what a node calls: it picks in memory, memory-mapped, prepared once into the
run directory, or fetched from the swarm, by ``data.path``.
How: docs/architecture.md, "Data"; for users: docs/data.md.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from diloco_p2p.config import DataConfig, ModelConfig
from diloco_p2p.data.cache import (
    LazyShardSource,
    Prefetcher,
    Remote,
    ShardCache,
    is_cache,
    load_or_fetch_manifest,
    mark_cache,
)
from diloco_p2p.data.dataset import ArraySource, DataPosition, ShardSource, TokenDataset
from diloco_p2p.data.documents import default_corpus_files, input_files, iter_documents
from diloco_p2p.data.encode import tokenizer_identity
from diloco_p2p.data.manifest import MANIFEST, Manifest
from diloco_p2p.errors import UserError
from diloco_p2p.model.build import Tokenizer

__all__ = [
    "DataPosition", "TextDataset", "TokenDataset", "build_dataset", "default_corpus_files", "load_tokens",
    "open_dataset",
]

log = logging.getLogger("diloco_p2p.data")
TextDataset = TokenDataset  # the name callers used before shards


def _documents(path: str | None) -> Iterator[bytes]:
    if path is None:
        return (f.read_bytes() for f in default_corpus_files())
    return iter_documents(input_files([path], "data.path"))


def load_tokens(cfg: DataConfig, tokenizer: Tokenizer) -> np.ndarray:
    """The whole corpus as one token stream in memory, documents separated by EOS."""
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


def build_dataset(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, order_key: str) -> TokenDataset:
    """The corpus tokenized in memory (the default corpus; small experiments and benchmarks)."""
    return TokenDataset(ArraySource(load_tokens(cfg, tokenizer)), seq_len, cfg.eval_fraction,
                        cfg.order_key or order_key)


def open_dataset(cfg: DataConfig, model_cfg: ModelConfig, tokenizer: Tokenizer, seq_len: int, order_key: str,
                 cache_dir: Path, *, leader: bool = True, barrier: Callable[[], None] = lambda: None,
                 remote: Remote | None = None) -> TokenDataset:
    """The node's dataset (see the module docstring). On N local ranks the leader prepares a
    plain ``data.path`` into `cache_dir` while the others wait at `barrier`. `remote` (the
    swarm's `DataShare`) fetches a corpus this node lacks and serves the one it holds."""
    key = cfg.order_key or order_key
    if cfg.path is None:
        if cfg.dataset_id is not None:
            if remote is None:
                raise UserError(f"data.dataset_id is {cfg.dataset_id} (the run trains on a prepared corpus) but "
                                "data.path is unset and this node is not in a swarm to fetch it from; point data.path "
                                "at that corpus (see `diloco-p2p prepare`) or join the swarm with --initial-peers")
            directory = cache_dir / f"swarm-{cfg.dataset_id[:16]}"
            return _from_swarm(cfg, model_cfg, tokenizer, seq_len, key, directory, remote)
        return build_dataset(cfg, tokenizer, seq_len, order_key)
    identity = tokenizer_identity(model_cfg, tokenizer)
    path = Path(cfg.path)
    if (path / MANIFEST).is_file():
        manifest = Manifest.load(path)
        if cfg.max_bytes is not None:
            log.warning("data.max_bytes is ignored for a prepared corpus (prepare with --max-bytes instead)")
        if is_cache(path, manifest, remote is not None or bool(manifest.content.get("base_url"))):  # shards missing
            return _from_swarm(cfg, model_cfg, tokenizer, seq_len, key, path, remote)
    else:
        if leader:
            _prepare_into(cfg, tokenizer, identity, cache_dir)
        barrier()
        manifest = Manifest.load(cache_dir)
    check_manifest(manifest, identity, cfg)
    manifest.check_shards()
    if remote is not None and cfg.serve and leader:
        remote.serve(manifest, lambda: range(len(manifest.shards)))
    return TokenDataset(ShardSource(manifest), seq_len, manifest.eval_fraction, key)


def _from_swarm(cfg: DataConfig, model_cfg: ModelConfig, tokenizer: Tokenizer, seq_len: int, key: str,
                directory: Path, remote: Remote | None) -> TokenDataset:
    """A corpus whose shards come from the swarm as training needs them (`diloco_p2p.data.cache`)."""
    dataset = cfg.dataset_id or Manifest.load(directory).id
    manifest = load_or_fetch_manifest(directory, dataset, remote, cfg.fetch_timeout)
    check_manifest(manifest, tokenizer_identity(model_cfg, tokenizer), cfg)
    mark_cache(directory, manifest.id)
    cache = ShardCache(manifest, remote, cache_bytes=cfg.cache_bytes, fetch_timeout=cfg.fetch_timeout)
    source = LazyShardSource(cache)
    data = TokenDataset(source, seq_len, manifest.eval_fraction, key, blocked=True)
    source.keep = lambda: set(data.upcoming_shards(cfg.prefetch_shards))
    if remote is not None and cfg.serve:
        remote.serve(manifest, cache.held)
    first = (data.position.epoch, data.position.offset)

    def upcoming() -> list[int]:
        # Until training reads its first window, only the shard it starts in (and, on the reader's
        # thread, the eval windows' shard): fetching further ahead at once would share the link
        # and the CPU with the shards the first step waits for.
        if (data.position.epoch, data.position.offset) == first:
            return data.upcoming_shards(0)[:1]
        return data.upcoming_shards(cfg.prefetch_shards)

    data.prefetcher = Prefetcher(cache, upcoming)  # type: ignore[attr-defined]
    log.info("data: dataset %s from the swarm into %s (%d of %d shards here, cache limit %s)", manifest.id[:12],
             directory, len(cache.held()), len(manifest.shards),
             "none" if cfg.cache_bytes is None else f"{cfg.cache_bytes / 1e6:.3g} MB")
    return data


def _prepare_into(cfg: DataConfig, tokenizer: Tokenizer, identity: dict, cache_dir: Path) -> None:
    from diloco_p2p.data.prepare import prepare

    result = prepare([str(cfg.path)], cache_dir, tokenizer, identity, eval_fraction=cfg.eval_fraction,
                     max_bytes=cfg.max_bytes, progress=sys.stderr.isatty(), replace=True, what="data.path")
    if result.reused:
        log.info("data: %s prepared earlier in %s (dataset %s)", cfg.path, cache_dir, result.manifest.id[:12])
    else:
        log.info("data: prepared %s into %s in %.1f s (dataset %s); later starts reuse it", cfg.path, cache_dir,
                 result.seconds, result.manifest.id[:12])
    if result.replaced_docs:
        log.warning("data: %d documents of %s held bytes that are not UTF-8 (replaced with U+FFFD)",
                    result.replaced_docs, cfg.path)


def check_manifest(manifest: Manifest, identity: dict, cfg: DataConfig) -> None:
    """Refuse a corpus prepared with another tokenizer, or another dataset than the run's."""
    theirs = manifest.tokenizer
    if theirs["sha256"] != identity["sha256"]:
        raise UserError(
            f"{manifest.directory / MANIFEST}: prepared with tokenizer {theirs['sha256'][:12]} ({theirs['kind']}, "
            f"vocab {theirs['vocab_size']}) but this node's tokenizer is {identity['sha256'][:12]} "
            f"({identity['kind']}, vocab {identity['vocab_size']}); set model.tokenizer_path to the tokenizer it "
            "was prepared with, or prepare it again with --tokenizer"
        )
    if cfg.dataset_id is not None and cfg.dataset_id != manifest.id:
        raise UserError(f"data.path {manifest.directory} holds dataset {manifest.id} but data.dataset_id is "
                        f"{cfg.dataset_id}; point data.path at that dataset or drop data.dataset_id")
