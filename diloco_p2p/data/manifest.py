"""A prepared corpus on disk: fixed-size shards of token ids and the manifest that names them.

``DIR/manifest.json`` holds the format, the token dtype, the shard size, the tokenizer's
identity, the held-out share and each shard's name, token count and sha256. The dataset id is
the sha256 of that content (without ``id`` and ``base_url``): two volunteers who prepare the
same text with the same tokenizer get the same id. Shards are checked when a node opens them; a
shard's sha256 is remembered in ``DIR/verified.json`` against its size and mtime, so a restart
does not rehash the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diloco_p2p.errors import UserError

FORMAT = "diloco-p2p-tokens/1"
MANIFEST = "manifest.json"
VERIFIED = "verified.json"
_HASH_CHUNK = 8 << 20


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def dataset_id(content: dict[str, Any]) -> str:
    body = {k: v for k, v in content.items() if k not in ("id", "base_url")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_stamps(directory: Path) -> dict[str, Any]:
    """The shards of `directory` already verified (`VERIFIED`: name -> `shard_stamp`); empty if none."""
    try:
        return json.loads((directory / VERIFIED).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def shard_stamp(st: os.stat_result, shard: dict[str, Any]) -> list[Any]:
    """What a verified shard file is remembered by: a file of this size and mtime hashed to this sha256."""
    return [st.st_size, st.st_mtime_ns, shard["sha256"]]


def write_json_atomic(path: Path, content: Any) -> None:
    """Write then rename: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(content, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class Manifest:
    directory: Path
    content: dict[str, Any]

    @property
    def id(self) -> str:
        return self.content["id"]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.content["dtype"])

    @property
    def shards(self) -> list[dict[str, Any]]:
        return self.content["shards"]

    @property
    def total_tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.content["tokenizer"]

    @property
    def eval_fraction(self) -> float:
        return float(self.content["eval_fraction"])

    def path(self, shard: dict[str, Any]) -> Path:
        return self.directory / shard["name"]

    @classmethod
    def build(cls, directory: Path, *, dtype: np.dtype, shard_tokens: int, tokenizer: dict[str, Any],
              eval_fraction: float, shards: list[dict[str, Any]], documents: int) -> Manifest:
        content: dict[str, Any] = {
            "format": FORMAT, "dtype": np.dtype(dtype).name, "shard_tokens": shard_tokens, "tokenizer": tokenizer,
            "eval_fraction": eval_fraction, "shards": shards, "documents": documents,
            "total_tokens": sum(s["tokens"] for s in shards),
        }
        content["id"] = dataset_id(content)
        return cls(directory, content)

    def save(self) -> None:
        write_json_atomic(self.directory / MANIFEST, self.content)

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        """The manifest of `directory`, checked against its own id; one line naming what is wrong."""
        path = directory / MANIFEST
        try:
            content = json.loads(path.read_text())
        except OSError as e:
            raise UserError(f"{path}: cannot read the manifest ({e.strerror}); run `diloco-p2p prepare` first") from None
        except json.JSONDecodeError:
            raise UserError(f"{path} is not valid JSON; run `diloco-p2p prepare` again") from None
        if not isinstance(content, dict) or content.get("format") != FORMAT:
            raise UserError(f"{path} is not a {FORMAT} manifest; run `diloco-p2p prepare` again")
        if content.get("id") != dataset_id(content):
            raise UserError(f"{path} has been edited: its content does not hash to its id {content.get('id')}; "
                            "run `diloco-p2p prepare` again")
        return cls(directory, content)

    def check_shards(self) -> None:
        """Every shard present, of its size, and (once per file version) of its sha256."""
        cache, changed = read_stamps(self.directory), False
        for shard in self.shards:
            path, size = self.path(shard), shard["tokens"] * self.dtype.itemsize
            try:
                st = path.stat()
            except FileNotFoundError:
                raise UserError(f"{path} is missing (dataset {self.id[:12]}); copy it from where the corpus was "
                                "prepared or run `diloco-p2p prepare` again") from None
            if st.st_size != size:
                raise UserError(f"{path} is truncated or damaged: {st.st_size} bytes, the manifest says {size}; "
                                "copy it again or run `diloco-p2p prepare` again")
            stamp = shard_stamp(st, shard)
            if cache.get(shard["name"]) == stamp:
                continue
            if file_sha256(path) != shard["sha256"]:
                raise UserError(f"{path} is corrupt: its sha256 is not the manifest's; copy it again or run "
                                "`diloco-p2p prepare` again")
            cache[shard["name"]], changed = stamp, True
        if changed:
            try:
                write_json_atomic(self.directory / VERIFIED, cache)
            except OSError:
                pass  # a read-only corpus: hash again next start
