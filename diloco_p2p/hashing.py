"""sha256 of a tensor's bytes, the hash every node publishes of its θ and checks of a peer's.

Members of a round must end with bit-identical θ; the sha256 of its bytes makes that checkable by
anyone (records, downloads, `diloco-p2p status`). Hashing θ costs a pass over it (4 GB at 1B
parameters), so past one 64 MiB chunk the hash is the sha256 of a tag and the chunks' digests in
order, computed on several threads (`benchmarks/gpu/gpu_outer.py`): the same bytes give the same hash
on any machine, whatever its thread count. It lives below both the loop and the swarm: both hash.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

HASH_CHUNK_BYTES = 64 << 20
_CHUNKED = b"diloco-p2p sha256 of 64 MiB chunks\n"


def tensor_sha256(flat: torch.Tensor) -> str:
    """sha256 of a CPU tensor's bytes; past one `HASH_CHUNK_BYTES` chunk, sha256 over a tag and the
    chunks' digests in order (a fixed layout: the same bytes give the same hash on any machine,
    whatever its thread count). hashlib releases the GIL, so the chunks hash in parallel."""
    data = memoryview(flat.detach().contiguous().numpy()).cast("B")  # no copy
    if data.nbytes <= HASH_CHUNK_BYTES:
        return hashlib.sha256(data).hexdigest()
    return combined_digest(chunk_digests(data, range(-(-data.nbytes // HASH_CHUNK_BYTES))))


def chunk_digests(data: memoryview, chunks: Sequence[int]) -> list[bytes]:
    """The sha256 digests of `data`'s `HASH_CHUNK_BYTES` chunks numbered `chunks`, in parallel."""
    def digest(i: int) -> bytes:
        return hashlib.sha256(data[i * HASH_CHUNK_BYTES:(i + 1) * HASH_CHUNK_BYTES]).digest()

    with ThreadPoolExecutor(min(len(chunks), os.cpu_count() or 1, 16)) as pool:
        return list(pool.map(digest, chunks))


def combined_digest(digests: Iterable[bytes]) -> str:
    """`tensor_sha256` of a tensor past one chunk, from its chunks' digests in order."""
    return hashlib.sha256(_CHUNKED + b"".join(digests)).hexdigest()
