"""The state blob: safetensors bytes of named tensors with our JSON metadata (no pickle).

See `diloco_p2p.swarm.state` for what goes in it and why the bytes are deterministic.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import safetensors.torch
import torch

from diloco_p2p.hashing import tensor_sha256

MAX_SAFETENSORS_HEADER = 100 << 20  # what safetensors itself accepts
_HEADER_LENGTH = 8  # safetensors starts with its JSON header's length, 8 bytes little-endian


class StateError(ValueError):
    """A state blob that is not a well-formed diloco-p2p state."""


def pack_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> bytes:
    """Safetensors bytes of `tensors` with `meta` as JSON under the ``diloco`` metadata key.

    Tensors are stored as they are (dtype and shape; non-contiguous or GPU tensors are copied to
    contiguous CPU tensors first); `meta` must be JSON-serializable without NaN/Inf."""
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a mapping, not {type(meta).__name__}")
    flat = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    return safetensors.torch.save(flat, metadata={"diloco": json.dumps(dict(meta), sort_keys=True, allow_nan=False)})


def unpack_state(blob: bytes | bytearray | memoryview) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Inverse of `pack_state`. Raises `StateError` for anything that is not a complete
    diloco-p2p state (truncated, garbage, a safetensors file without our metadata)."""
    data = bytes(blob)
    if len(data) < _HEADER_LENGTH:
        raise StateError(f"state of {len(data)} bytes is truncated: no safetensors header")
    n = int.from_bytes(data[:_HEADER_LENGTH], "little")
    if n > MAX_SAFETENSORS_HEADER or _HEADER_LENGTH + n > len(data):
        raise StateError(f"state of {len(data)} bytes is truncated or not safetensors (header length {n})")
    try:
        header = json.loads(data[_HEADER_LENGTH : _HEADER_LENGTH + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StateError("state is not safetensors: its header is not JSON") from None
    raw_meta = header.get("__metadata__", {}).get("diloco") if isinstance(header, dict) else None
    if not isinstance(raw_meta, str):
        raise StateError("not a diloco-p2p state: the safetensors metadata has no 'diloco' entry")
    try:
        meta = json.loads(raw_meta)
    except json.JSONDecodeError:
        raise StateError("state metadata 'diloco' is not JSON") from None
    if not isinstance(meta, dict):
        raise StateError("state metadata 'diloco' is not a JSON object")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own Rust-side error types
        raise StateError(f"state tensors do not load: {' '.join(str(e).split()) or type(e).__name__}") from None
    return tensors, meta


THETA = "outer.theta"  # the tensor whose sha256 is a node's params hash (`OuterOptimizer.params_sha256`)


def theta_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """The params hash of a state, as every node computes it of its own θ (`tensor_sha256`)."""
    return tensor_sha256(tensors[THETA])


class StateCheck:
    """A joiner's check of a downloaded blob, beyond its sha256 (which only proves that the donor
    sent the bytes it announced). The state must be what the donor announced (its round, and θ
    hashing to the announced `params_hash`): otherwise the donor lied (``lied``). And it must be
    one the swarm vouches for, not merely what the donor claims: exactly (`round`,
    `params_hash`) when given, or a later round whose (round, θ hash) `vouched` accepts (the
    swarm moved on during the download), never past `max_round`. Called with each blob
    (`fetch_state(verify=...)`): returns (why it is refused, whether the donor lied), or None
    and keeps the unpacked state in `unpacked`."""

    def __init__(self, round: int | None, params_hash: str | None, max_round: int | None,
                 vouched: Callable[[int, str], bool] | None = None):
        self.round, self.params_hash, self.max_round, self.vouched = round, params_hash, max_round, vouched
        self.unpacked: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None

    def __call__(self, blob: bytes, announced: Any = None) -> tuple[str, bool] | None:
        try:
            tensors, meta = unpack_state(blob)
        except StateError as e:
            return str(e), True
        got = meta.get("round")
        if not isinstance(got, int) or isinstance(got, bool) or got < 0:
            return f"its state has no round ({got!r})", True
        if THETA not in tensors:
            return f"its state has no {THETA}", True
        theta = theta_sha256(tensors)
        if announced is not None and got != announced.round:
            return f"it announced round {announced.round} and served a state of round {got}", True
        if announced is not None and announced.params_hash not in (None, theta):
            return f"it announced θ {announced.params_hash[:12]} and served θ {theta[:12]}", True
        if self.max_round is not None and got > self.max_round:
            return f"its state is of round {got}, past train.max_rounds {self.max_round}", False
        exact = self.round is None or (got == self.round and self.params_hash in (None, theta))
        later = self.vouched is not None and self.round is not None and got > self.round and self.vouched(got, theta)
        if not exact and not later:
            wanted = f"round {self.round}" + (f" θ {self.params_hash[:12]}" if self.params_hash else "")
            return f"its round {got} θ {theta[:12]} is not the {wanted} the swarm vouches for", False
        self.unpacked = tensors, meta
        return None
