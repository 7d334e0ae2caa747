"""Tokenize a corpus once into shards: resumable, atomic, and the same stream as in memory.

Documents are encoded a batch at a time into one shard's buffer; a full buffer is written to a
temporary file, synced and renamed, so a shard file is whole or absent. ``prepare-state.json``
records where the next shard starts, so an interrupted prepare resumes when run again; the
inputs' signature refuses an output directory that holds another corpus. The token stream is
`load_tokens`'s (each document's ids, then EOS), so training on the shards sees exactly what
training in memory sees.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diloco_p2p.data.documents import input_files, iter_documents
from diloco_p2p.data.encode import Encoder, token_dtype
from diloco_p2p.data.manifest import MANIFEST, VERIFIED, Manifest, shard_name, shard_stamp, write_json_atomic
from diloco_p2p.errors import UserError
from diloco_p2p.model.build import Tokenizer

STATE = "prepare-state.json"
# 16 MiB of uint16 ids per shard: what a node fetching from the swarm waits for before its first
# step is about two shards (the eval windows' and the first one of its order).
DEFAULT_SHARD_TOKENS = 1 << 23
# Documents encoded together: a fast tokenizer spreads one batch's documents over its threads,
# so a batch holds many documents' worth of text (and bounds the text held in memory).
_BATCH_BYTES = 32 << 20


@dataclass
class PrepareResult:
    manifest: Manifest
    documents: int
    text_bytes: int
    seconds: float
    replaced_docs: int
    reused: bool


@dataclass
class _Cursor:
    """Where the next shard starts: document `doc`, after its first `skip` tokens."""

    doc: int = 0
    skip: int = 0
    bytes_before: int = 0  # text bytes of the documents before `doc` (for max_bytes and progress)


def source_signature(files: list[Path], inputs: list[str], **settings: Any) -> dict[str, Any]:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return {"inputs": [str(Path(i).resolve()) for i in inputs], "files_sha256": h.hexdigest(), **settings}


def prepare(inputs: list[str], out: Path, tokenizer: Tokenizer, identity: dict[str, Any], *,
            text_field: str = "text", shard_tokens: int = DEFAULT_SHARD_TOKENS, eval_fraction: float = 0.02,
            max_bytes: int | None = None, workers: int | None = None, progress: bool = True,
            replace: bool = False, what: str = "input") -> PrepareResult:
    """Prepare `inputs` into `out`, or resume, or find it done; `replace` clears an `out` that holds
    another corpus instead of refusing it (a run directory's own cache)."""
    start = time.perf_counter()
    if not inputs:
        raise UserError("no input given; name the text, JSONL or Parquet files or directories to prepare")
    files = input_files(inputs, what)
    dtype = token_dtype(identity["vocab_size"])
    signature = source_signature(files, inputs, text_field=text_field, max_bytes=max_bytes,
                                 tokenizer=identity["sha256"], shard_tokens=shard_tokens, eval_fraction=eval_fraction)
    out.mkdir(parents=True, exist_ok=True)
    state = _resume_state(out, signature, replace)
    if state.get("done"):
        return PrepareResult(Manifest.load(out), state["documents"], state["cursor"]["bytes_before"],
                             time.perf_counter() - start, state["replaced_docs"], reused=True)
    if workers:
        os.environ.setdefault("RAYON_NUM_THREADS", str(workers))  # the fast tokenizer's thread pool
    writer = _ShardWriter(out, dtype, shard_tokens, state, signature)
    encoder = Encoder(tokenizer, dtype, replaced_docs=state.get("replaced_docs", 0))
    total = sum(f.stat().st_size for f in files)
    bar = _progress(total, writer.cursor.bytes_before, progress)
    try:
        for doc, ids, n_bytes, skipped in _encoded(files, text_field, encoder, writer.cursor, max_bytes):
            writer.add(doc, ids, n_bytes, skipped, encoder.replaced_docs)
            bar.update(n_bytes)
        shards = writer.finish(encoder.replaced_docs)
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    if not shards:
        raise UserError(f"{', '.join(inputs)} holds no text")
    manifest = Manifest.build(out, dtype=dtype, shard_tokens=shard_tokens, tokenizer=identity,
                              eval_fraction=eval_fraction, shards=shards, documents=writer.documents)
    manifest.save()
    writer.save_state(done=True, replaced=encoder.replaced_docs)
    return PrepareResult(manifest, writer.documents, writer.text_bytes, time.perf_counter() - start,
                         encoder.replaced_docs, reused=False)


def _resume_state(out: Path, signature: dict[str, Any], replace: bool) -> dict[str, Any]:
    """The saved progress of this same prepare in `out`, or a fresh start; refuses another corpus."""
    try:
        state = json.loads((out / STATE).read_text())
    except (OSError, json.JSONDecodeError):
        state = None
    has_shards = any(out.glob("shard-*.bin")) or (out / MANIFEST).exists()
    if state is not None and state.get("source") == signature:
        if state.get("done") and not (out / MANIFEST).is_file():
            state = None  # the manifest was removed: start over
        else:
            _drop_leftovers(out, {s["name"] for s in state["shards"]})
            return state
    if state is not None or has_shards:
        if not replace:
            held = _held_dataset(out)
            raise UserError(f"--out {out} already holds {held} prepared from other inputs or settings; "
                            "choose an empty directory or remove that one")
        _drop_leftovers(out, set())
        for name in (MANIFEST, STATE, VERIFIED):
            (out / name).unlink(missing_ok=True)
    _drop_leftovers(out, set())
    return {"source": signature, "shards": [], "cursor": vars(_Cursor()), "documents": 0, "replaced_docs": 0}


def _held_dataset(out: Path) -> str:
    try:
        return f"dataset {Manifest.load(out).id[:12]}"
    except UserError:
        return "the shards of an unfinished prepare"


def _drop_leftovers(out: Path, keep: set[str]) -> None:
    for f in list(out.glob("shard-*.bin")) + list(out.glob("*.tmp")):
        if f.name not in keep:
            f.unlink()


def _encoded(files: list[Path], text_field: str, encoder: Encoder, cursor: _Cursor,
             max_bytes: int | None) -> Iterator[tuple[int, np.ndarray, int, int]]:
    """(document index, its ids + EOS, its text bytes, ids skipped) from the cursor on, `max_bytes` applied as
    `load_tokens` applies it; the cursor's document starts after its `skip` tokens."""
    budget = None if max_bytes is None else max_bytes - cursor.bytes_before
    if budget is not None and budget <= 0:
        return  # resumed after the last document max_bytes lets in
    index, skip = cursor.doc, cursor.skip
    batch: list[bytes] = []
    size = 0
    docs = iter_documents(files, text_field, skip=cursor.doc)
    while True:
        doc = next(docs, None)
        last = doc is None
        if doc is not None and budget is not None:
            doc = doc[:budget]
            budget -= len(doc)
            last = budget <= 0
        if doc is not None:
            batch.append(doc)
            size += len(doc)
        if batch and (last or size >= _BATCH_BYTES):
            for doc_bytes, ids in zip(batch, encoder.encode_docs(batch), strict=True):
                yield index, ids[skip:], len(doc_bytes), skip
                index, skip = index + 1, 0
            batch, size = [], 0
        if last:
            return


class _ShardWriter:
    """Writes shards behind the encoding: the write and sha256 on a pool, then fsync, rename and the
    resume state in shard order on `_syncer`, so the state names only whole shards on disk."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, state: dict[str, Any],
                 signature: dict[str, Any]):
        self.out, self.shard_tokens, self.signature = out, shard_tokens, signature
        self.shards: list[dict[str, Any]] = list(state["shards"])  # synced, renamed and in the state
        self.cursor = _Cursor(**state["cursor"])
        self.documents = state["documents"]  # documents wholly written
        self.text_bytes = self.cursor.bytes_before  # their text bytes
        self.buf = np.empty(shard_tokens, dtype=dtype)
        self._spare = np.empty(shard_tokens, dtype=dtype)  # filled while `buf` is being written
        self.fill = 0
        self.next_doc = self.cursor.doc
        self._next_shard = len(self.shards)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="shard-writer")  # the write, and its sha256
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="shard-sync")  # fsync, rename, state: in order
        self._pending: Future | None = None
        self._failed: BaseException | None = None  # a shard that could not be committed: the later ones wait

    def add(self, doc: int, ids: np.ndarray, n_bytes: int, skipped: int, replaced: int) -> None:
        """Document `doc`'s ids after its first `skipped` (already in earlier shards)."""
        pos = 0
        while pos < len(ids):
            n = min(len(ids) - pos, self.shard_tokens - self.fill)
            self.buf[self.fill : self.fill + n] = ids[pos : pos + n]
            self.fill, pos = self.fill + n, pos + n
            if self.fill == self.shard_tokens:
                if pos == len(ids):  # the shard ends with this document
                    self._flush(_Cursor(doc + 1, 0, self.text_bytes + n_bytes), replaced, self.documents + 1)
                else:
                    self._flush(_Cursor(doc, skipped + pos, self.text_bytes), replaced, self.documents)
        self.documents += 1
        self.text_bytes += n_bytes
        self.next_doc = doc + 1

    def _flush(self, cursor: _Cursor, replaced: int, documents: int) -> None:
        """Hand the full buffer to the writer threads and go on encoding into the other buffer."""
        self._wait()
        full, self.buf, self._spare = self.buf[: self.fill], self._spare, self.buf
        index, self.fill = self._next_shard, 0
        self._next_shard += 1

        def write() -> None:
            record = write_shard(self.out, index, full, self._pool)
            self._syncer.submit(self._commit, index, record, cursor, replaced, documents)

        self._pending = self._pool.submit(write)

    def _commit(self, index: int, record: dict[str, Any], cursor: _Cursor, replaced: int, documents: int) -> None:
        """On `_syncer`: shard `index`'s file synced and renamed, then recorded in the resume state."""
        if self._failed is not None:
            _tmp(self.out, index).unlink(missing_ok=True)
            return
        try:
            commit_shard(self.out, index)
            self.shards.append(record)
            self.cursor = cursor
            self.save_state(done=False, replaced=replaced, documents=documents)
        except BaseException as e:
            self._failed = e
            raise

    def _wait(self) -> None:
        """The buffer being written is free again; a failed write or commit (disk full) surfaces here."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
        if self._failed is not None:
            raise self._failed

    def finish(self, replaced: int) -> list[dict[str, Any]]:
        try:
            if self.fill:
                self._flush(_Cursor(self.next_doc, 0, self.text_bytes), replaced, self.documents)
            self._wait()
        finally:
            self._close()
        if self._failed is not None:
            raise self._failed
        return self.shards

    def abort(self) -> None:
        """Let the shards being written finish (or fail) before the process goes on; shards written
        but not committed are removed (a rerun writes them again)."""
        try:
            self._wait()
        except BaseException:  # the exception being handled is the one reported
            pass
        finally:
            self._close()
            for f in self.out.glob("shard-*.bin.tmp"):
                f.unlink(missing_ok=True)

    def _close(self) -> None:
        self._pool.shutdown(wait=True)  # its last write queues that shard's commit first
        self._syncer.shutdown(wait=True)

    def save_state(self, *, done: bool, replaced: int, documents: int | None = None) -> None:
        state = {"source": self.signature, "shards": self.shards, "cursor": vars(self.cursor),
                 "documents": self.documents if documents is None else documents, "replaced_docs": replaced,
                 "done": done}
        _guard_disk(self.out / STATE, lambda: write_json_atomic(self.out / STATE, state), len(self.shards))
        if done:
            stamps = {s["name"]: shard_stamp((self.out / s["name"]).stat(), s) for s in self.shards}
            write_json_atomic(self.out / VERIFIED, stamps)


def _tmp(out: Path, index: int) -> Path:
    return out / (shard_name(index) + ".tmp")


def write_shard(out: Path, index: int, ids: np.ndarray, pool: ThreadPoolExecutor | None = None) -> dict[str, Any]:
    """`ids` written to shard `index`'s ``.tmp`` file (not yet synced: `commit_shard`), hashed on `pool`
    meanwhile; its manifest record."""
    tmp = _tmp(out, index)
    view = memoryview(np.ascontiguousarray(ids)).cast("B")
    sha = pool.submit(lambda: hashlib.sha256(view).hexdigest()) if pool else None

    def write() -> None:
        try:
            with open(tmp, "wb") as f:
                f.write(view)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    _guard_disk(out / shard_name(index), write, index)
    digest = sha.result() if sha else hashlib.sha256(view).hexdigest()
    return {"name": shard_name(index), "tokens": int(len(ids)), "sha256": digest}


def commit_shard(out: Path, index: int) -> None:
    """Shard `index`'s written ``.tmp`` file synced to disk, then renamed: whole or absent."""
    tmp = _tmp(out, index)

    def sync() -> None:
        try:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, out / shard_name(index))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    _guard_disk(out / shard_name(index), sync, index)


def _guard_disk(path: Path, write: Any, shard: int) -> None:
    try:
        write()
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"disk full writing {path}: free space and run the same prepare again; "
                            f"it resumes at shard {shard}") from None
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, done: int, show: bool) -> Any:
    """A bar of input bytes with MB/s and ETA on stderr (tqdm), or nothing."""
    if not show:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=done, unit="B", unit_scale=True, desc="prepare", file=sys.stderr,
                mininterval=0.5, smoothing=0.1)
