"""The state blob: safetensors bytes of named tensors with our JSON metadata (no pickle).

A joiner checks a blob before it allocates a tensor of it (`Layout`: every name, dtype and shape
against its own model's state, the size capped) and before it adopts it (every value finite; the
whole state hashing to the `state_sha256` the swarm vouches for in its progress records). What
goes in it and why the bytes are deterministic: docs/protocol/state-transfer.md
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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


# safetensors' names of the dtypes a state holds
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32"}
MAX_HEADER_SLACK = 64 << 10  # a state's JSON header and metadata: a few hundred bytes per tensor


@dataclass(frozen=True)
class Layout:
    """What a state for this model may hold: tensor name -> (safetensors dtype, shape); the
    `required` names must be there, the others may; a `bounded` one is 1-D of at most its
    shape's size (a fragment's average). Built from the node's own state, so a peer's state is
    checked against the model this node runs, not against what the peer says."""

    tensors: Mapping[str, tuple[str, tuple[int, ...]]]
    required: frozenset[str]
    bounded: frozenset[str] = frozenset()

    @classmethod
    def of(cls, required: Mapping[str, torch.Tensor], optional: Mapping[str, torch.Tensor] | None = None,
           bounded: tuple[str, ...] = ()) -> Layout:
        """The layout of the tensors `required` (their dtype and shape) and `optional`."""
        both = {**(optional or {}), **required}
        return cls({n: (_DTYPES.get(t.dtype, str(t.dtype)), tuple(t.shape)) for n, t in both.items()},
                   frozenset(required), frozenset(bounded))

    def max_size(self) -> int:
        """The most bytes a state of this layout can take (every optional tensor present)."""
        sizes = {"F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2}
        data = sum(sizes.get(d, 8) * _numel(shape) for d, shape in self.tensors.values())
        return 8 + MAX_HEADER_SLACK + data

    def mismatch(self, header: Mapping[str, Any]) -> str | None:
        """Why a safetensors header does not fit this layout (None: it fits)."""
        names = {n for n in header if n != "__metadata__"}
        if missing := sorted(self.required - names):
            return f"it lacks {', '.join(missing)}"
        if extra := sorted(names - set(self.tensors)):
            return f"it holds tensors this model has not ({', '.join(extra[:3])})"
        for name in sorted(names):
            entry = header[name]
            want_dtype, want_shape = self.tensors[name]
            if not isinstance(entry, dict):
                return f"its {name} has no dtype and shape"
            shape = entry.get("shape")
            fits = isinstance(shape, list) and (
                tuple(shape) == want_shape if name not in self.bounded
                else len(shape) == 1 and isinstance(shape[0], int) and 0 <= shape[0] <= _numel(want_shape))
            if entry.get("dtype") != want_dtype or not fits:
                return (f"its {name} is {entry.get('dtype')} {shape}, this model's is {want_dtype} "
                        f"{list(want_shape)}")
        return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def unpack_state(blob: bytes | bytearray | memoryview, layout: Layout | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Inverse of `pack_state`. Raises `StateError` for anything that is not a complete
    diloco-p2p state (truncated, garbage, a safetensors file without our metadata) or, given a
    `layout`, not one of this model (checked on the header, before any tensor is allocated), or
    holding a value that is not finite."""
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
    if layout is not None and (why := layout.mismatch(header)):
        raise StateError(f"state is not one of this model: {why}")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own Rust-side error types
        raise StateError(f"state tensors do not load: {' '.join(str(e).split()) or type(e).__name__}") from None
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise StateError(f"state tensor {name} holds NaN or Inf")
    return tensors, meta


THETA = "outer.theta"  # the tensor whose sha256 is a node's params hash (`OuterOptimizer.params_sha256`)


def theta_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """The params hash of a state, as every node computes it of its own θ (`tensor_sha256`)."""
    return tensor_sha256(tensors[THETA])


_STATE_TAG = "diloco-p2p state v1"


def state_sha256(tensors: Mapping[str, torch.Tensor], round: int, averaged_round: int | None,
                 known: Mapping[str, str] | None = None) -> str:
    """The hash of a whole state: its round, the round its θ was last averaged in, and every
    tensor's name, dtype, shape and `tensor_sha256` (θ, the outer momentum, the delayed-Nesterov
    buffer, the average in flight...). Members of a round hold the same state, so they publish
    the same hash; a joiner adopts a state only if it hashes to the one the swarm vouches for.
    `known`: hashes already computed (θ's is cached by the outer optimizer)."""
    known = known or {}
    rows = [[name, str(t.dtype).removeprefix("torch."), list(t.shape),
             known.get(name) or tensor_sha256(t.detach().cpu().contiguous().reshape(-1))]
            for name, t in sorted(tensors.items())]
    text = json.dumps([_STATE_TAG, round, averaged_round, rows], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


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
                 vouched: Callable[[int, str], bool] | None = None, layout: Layout | None = None,
                 state_hash: Callable[[int, str], str | None] | None = None):
        self.round, self.params_hash, self.max_round, self.vouched = round, params_hash, max_round, vouched
        self.layout, self.state_hash = layout, state_hash
        self.unpacked: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None

    def __call__(self, blob: bytes, announced: Any = None) -> tuple[str, bool] | None:
        try:
            tensors, meta = unpack_state(blob, self.layout)
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
        averaged = meta.get("averaged_round")
        if averaged is not None and (not isinstance(averaged, int) or isinstance(averaged, bool)
                                     or not 0 <= averaged <= got):
            return f"its state claims θ averaged in round {averaged!r}, not one of rounds 0..{got}", True
        vouched_state = self.state_hash(got, theta) if self.state_hash is not None else None
        if vouched_state is not None:
            whole = state_sha256(tensors, got, averaged, known={THETA: theta})
            if whole != vouched_state:
                return (f"its state of round {got} (θ {theta[:12]}, matching) hashes to {whole[:12]}, not the "
                        f"{vouched_state[:12]} the swarm vouches for: another momentum or buffer than the swarm's"), True
        self.unpacked = tensors, meta
        return None
