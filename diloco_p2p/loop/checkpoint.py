"""Local checkpoints: safetensors for tensors, JSON for everything else, written atomically.

A checkpoint is ``checkpoints/round-NNNNNN.safetensors`` plus ``round-NNNNNN.json``; the
``latest.json`` pointer is replaced last (``os.replace`` is atomic), so a crash at any point
leaves the previous checkpoint usable. The JSON records the sha256 of the tensor file and the
config's swarm view, so a corrupt file or a checkpoint from another run is refused with one
clear line instead of a traceback. Nothing here unpickles: nested optimizer state is split
into tensors (safetensors) and a JSON skeleton that points at them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from diloco_p2p.config import config_fields, diff_swarm_fields
from diloco_p2p.errors import UserError

FORMAT = "diloco-p2p/checkpoint-v1"
KEEP = 2
LATEST = "latest.json"


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
    """Write `ckpt` as ``round-NNNNNN.{safetensors,json}``, then point ``latest.json`` at it. A failed
    write raises `UserError` naming the file, removes this round's files and keeps the previous one."""
    stem = f"round-{ckpt.round:06d}"
    tensor_path, meta_path, pointer = directory / f"{stem}.safetensors", directory / f"{stem}.json", directory / LATEST
    writing = tensor_path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _atomic_write(tensor_path, lambda tmp: save_file(ckpt.tensors, tmp))
        meta = dict(ckpt.meta, format=FORMAT, round=ckpt.round, step=ckpt.step, tokens=ckpt.tokens,
                    tensors_file=tensor_path.name, tensors_sha256=_sha256_file(tensor_path))
        writing = meta_path
        _atomic_write(meta_path, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=1)))
        writing = pointer
        _atomic_write(pointer, lambda tmp: Path(tmp).write_text(json.dumps({"meta": meta_path.name})))
    except (OSError, SafetensorError) as e:
        if _pointed_at(directory) != meta_path.name:  # never remove what latest.json points at
            for path in (tensor_path, meta_path):
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        raise UserError(
            f"cannot write checkpoint {writing} ({_io_reason(e)}); free space there or choose another --run-dir, "
            "then run the same command again: it resumes from the last complete checkpoint"
        ) from None
    for old in sorted(directory.glob("round-*.json"))[:-KEEP]:
        old.unlink(missing_ok=True)
        old.with_suffix(".safetensors").unlink(missing_ok=True)
    return meta_path


def _io_reason(e: Exception) -> str:
    """The operating system's words for a failed write ("No space left on device")."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    # safetensors: "Error while serializing: I/O error: No space left on device (os error 28)"
    return re.sub(r" \(os error \d+\)$", "", str(e).rsplit("I/O error: ", 1)[-1])


def _pointed_at(directory: Path) -> str | None:
    try:
        return json.loads((directory / LATEST).read_text())["meta"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _Damaged(Exception):
    """A checkpoint's files are missing, unreadable or do not match their recorded sha256."""


def _verified(meta_path: Path) -> tuple[dict[str, Any], Path]:
    """The metadata of the checkpoint `meta_path` and its tensor file, whose sha256 matches.

    Raises `_Damaged` with the reason, or `UserError` for a checkpoint of another format."""
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise UserError(f"checkpoint {meta_path} has format {meta.get('format')!r}, expected {FORMAT!r}")
        tensor_path = meta_path.parent / meta["tensors_file"]
        sha256 = meta["tensors_sha256"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _Damaged(f"{meta_path} is unreadable ({type(e).__name__}: {e})") from None
    try:
        if _sha256_file(tensor_path) != sha256:
            raise _Damaged(f"{tensor_path} is corrupt (sha256 mismatch)")
    except OSError as e:
        raise _Damaged(f"{tensor_path} is missing or unreadable ({e.strerror or e})") from None
    return meta, tensor_path


def _round_of(meta_path: Path) -> int | None:
    try:
        return int(meta_path.stem.removeprefix("round-"))
    except ValueError:
        return None


def _rounds(directory: Path) -> list[int]:
    """Rounds that have a checkpoint metadata file in `directory`, ascending."""
    return sorted(r for p in directory.glob("round-*.json") if (r := _round_of(p)) is not None)


def _damaged_error(directory: Path, reason: str, below: int | None) -> UserError:
    """The line for a damaged checkpoint; names the newest intact one older than round `below`."""
    for r in reversed(_rounds(directory)):
        if below is not None and r >= below:
            continue
        try:
            _verified(directory / f"round-{r:06d}.json")
        except (_Damaged, UserError):
            continue
        return UserError(
            f"checkpoint {reason}; the older checkpoint of round {r} beside it is intact: resume from it with "
            f"--set train.resume_round={r} (the rounds after it are trained again), or restore the damaged file"
        )
    return UserError(f"checkpoint {reason}; restore it or start with a new --run-dir")


def load_checkpoint(
    directory: Path, swarm_view: dict[str, Any] | None = None, round: int | None = None
) -> Checkpoint | None:
    """The latest checkpoint in `directory`, or that of `round` (``train.resume_round``); None if
    there is none. A damaged one raises `UserError`, which names an older intact checkpoint and
    how to resume from it when there is one; so does a checkpoint written with another config."""
    if round is None:
        pointer = directory / LATEST
        if not pointer.exists():
            return None
        name = _pointed_at(directory)
        if name is None:
            raise _damaged_error(directory, f"pointer {pointer} is unreadable", below=None)
        meta_path = directory / name
    else:
        meta_path = directory / f"round-{round:06d}.json"
        if not meta_path.exists():
            raise UserError(
                f"train.resume_round={round}: {directory} has no checkpoint of round {round} (it has rounds "
                f"{_rounds(directory) or 'none'}); pick one of those, or unset it to resume from the latest"
            )
    try:
        meta, tensor_path = _verified(meta_path)
    except _Damaged as e:
        raise _damaged_error(directory, str(e), below=_round_of(meta_path)) from None
    if swarm_view is not None and config_fields(meta.get("swarm_view")) != config_fields(swarm_view):
        diffs = diff_swarm_fields(swarm_view, meta.get("swarm_view") or {})
        raise UserError(
            f"checkpoint {meta_path} was written with a different config ({'; '.join(diffs[:4])}); "
            "use the original config or a new --run-dir"
        )
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError) as e:
        reason = f"{tensor_path} is not a valid safetensors file ({e})"
        raise _damaged_error(directory, reason, below=_round_of(meta_path)) from None
    return Checkpoint(round=meta["round"], step=meta["step"], tokens=meta["tokens"], tensors=tensors, meta=meta)
