"""Local checkpoints: safetensors for tensors, JSON for everything else, written atomically.

A checkpoint is ``checkpoints/round-NNNNNN.safetensors`` plus ``round-NNNNNN.json``; the
``latest.json`` pointer is replaced last (``os.replace`` is atomic), so a crash at any point
leaves the previous checkpoint usable. The JSON records the sha256 of the tensor file and the
config's swarm view, so a corrupt file or a checkpoint from another run is refused with one
clear line instead of a traceback. Nothing here unpickles: nested optimizer state is split
into tensors (safetensors) and a JSON skeleton that points at them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from diloco_p2p.config import diff_swarm_fields
from diloco_p2p.errors import UserError

FORMAT = "diloco-p2p/checkpoint-v1"
KEEP = 2


def split_tensors(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """Replace every tensor in a nested structure by a reference, collecting the tensors."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {"__dict__": [[k, split_tensors(v, tensors, f"{prefix}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [split_tensors(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {prefix}")


def join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `split_tensors`."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(join_tensors(v, tensors) for v in obj["__tuple__"])
        return {k: join_tensors(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [join_tensors(v, tensors) for v in obj]
    return obj


@dataclass
class Checkpoint:
    round: int
    step: int
    tokens: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(directory: Path, ckpt: Checkpoint) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"round-{ckpt.round:06d}"
    tensor_path = directory / f"{stem}.safetensors"
    _atomic_write(tensor_path, lambda tmp: save_file(ckpt.tensors, tmp))
    meta = dict(ckpt.meta, format=FORMAT, round=ckpt.round, step=ckpt.step, tokens=ckpt.tokens,
                tensors_file=tensor_path.name, tensors_sha256=_sha256_file(tensor_path))
    meta_path = directory / f"{stem}.json"
    _atomic_write(meta_path, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=1)))
    _atomic_write(directory / "latest.json", lambda tmp: Path(tmp).write_text(json.dumps({"meta": meta_path.name})))
    for old in sorted(directory.glob("round-*.json"))[:-KEEP]:
        old.unlink(missing_ok=True)
        old.with_suffix(".safetensors").unlink(missing_ok=True)
    return meta_path


def load_checkpoint(directory: Path, swarm_view: dict[str, Any] | None = None) -> Checkpoint | None:
    """The latest checkpoint in `directory`, or None if there is none. Bad files raise UserError."""
    pointer = directory / "latest.json"
    if not pointer.exists():
        return None
    try:
        meta_path = directory / json.loads(pointer.read_text())["meta"]
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise UserError(f"checkpoint {meta_path} has format {meta.get('format')!r}, expected {FORMAT!r}")
        tensor_path = directory / meta["tensors_file"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"checkpoint in {directory} is unreadable ({type(e).__name__}: {e}); "
            "restore it or start with a new --run-dir"
        ) from None
    if not tensor_path.is_file() or _sha256_file(tensor_path) != meta["tensors_sha256"]:
        raise UserError(
            f"checkpoint {tensor_path} is missing or corrupt (sha256 mismatch); "
            "restore it or start with a new --run-dir"
        )
    if swarm_view is not None and meta.get("swarm_view") != swarm_view:
        diffs = diff_swarm_fields(swarm_view, meta.get("swarm_view") or {})
        raise UserError(
            f"checkpoint {meta_path} was written with a different config ({'; '.join(diffs[:4])}); "
            "use the original config or a new --run-dir"
        )
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError) as e:
        raise UserError(f"checkpoint {tensor_path} is not a valid safetensors file ({e}); use a new --run-dir") from None
    return Checkpoint(round=meta["round"], step=meta["step"], tokens=meta["tokens"], tensors=tensors, meta=meta)
