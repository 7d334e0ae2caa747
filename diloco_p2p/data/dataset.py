"""Windows of a token stream: a fixed held-out split and a per-node training order, O(1) memory.

The stream is cut into windows of ``seq_len + 1`` tokens; a window is held out by a hash of its
index alone, so every node holds out the same ones, and the eval set does not change with
``inner.batch_size``. The training order is a keyed permutation per epoch (a Feistel network,
cycle-walked: Black and Rogaway, CT-RSA 2002), keyed by the node's order key, not the run's
seed, so nodes see different data without coordinating; a corpus fetched from the swarm is read
shard by shard (`BlockedOrder`). Nothing is stored per window, and the position is checkpointed,
so a resumed run neither repeats nor skips a batch. How: docs/architecture.md, "Data".
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from diloco_p2p.data.manifest import Manifest
from diloco_p2p.errors import UserError

EVAL_BATCH = 8  # windows per eval batch, whatever inner.batch_size is
_M64 = (1 << 64) - 1


class TokenSource(Protocol):
    def __len__(self) -> int: ...

    def slice(self, start: int, stop: int) -> np.ndarray: ...


class ArraySource:
    """A token stream held in memory."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def slice(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop]


class ShardSource:
    """The token stream of a prepared corpus, its shards memory-mapped read-only."""

    def __init__(self, manifest: Manifest):
        self.maps = [np.memmap(manifest.path(s), dtype=manifest.dtype, mode="r") for s in manifest.shards]
        self.starts = [0]
        for m in self.maps:
            self.starts.append(self.starts[-1] + len(m))

    def __len__(self) -> int:
        return self.starts[-1]

    def slice(self, start: int, stop: int) -> np.ndarray:
        stop = min(stop, len(self))
        i = bisect.bisect_right(self.starts, start) - 1
        local = start - self.starts[i]
        if stop <= self.starts[i + 1]:
            return self.maps[i][local : local + stop - start]
        parts = [self.maps[i][local:]]
        while self.starts[i + 1] < stop:  # a window across a shard boundary
            i += 1
            parts.append(self.maps[i][: stop - self.starts[i]])
        return np.concatenate(parts)


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of `x`."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class KeyedPermutation:
    """A pseudo-random permutation of range(n) keyed by `key`, O(1) memory, O(1) per lookup."""

    def __init__(self, n: int, key: str):
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        digest = hashlib.sha256(key.encode()).digest()
        self.keys = [int.from_bytes(digest[8 * r : 8 * r + 8], "little") for r in range(4)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __getitem__(self, i: int) -> int:
        y = self._encrypt(i)
        while y >= self.n:  # cycle-walk: stays a permutation of range(n)
            y = self._encrypt(y)
        return y


class BlockedOrder:
    """One epoch's window order over shards: shard by shard in a keyed order, each shard's windows
    (those that start in it) in a keyed order of their own; O(shards) memory."""

    def __init__(self, n_windows: int, starts: list[int], seq_len: int, key: str):
        self.key = key
        n = len(starts) - 1
        self.first = [min(n_windows, -(-s // seq_len)) for s in starts[:-1]] + [n_windows]
        perm = KeyedPermutation(n, f"{key}:shards") if n > 1 else [0]
        self.shards = [perm[j] for j in range(n)]
        self.cum = [0]
        for s in self.shards:
            self.cum.append(self.cum[-1] + self.first[s + 1] - self.first[s])
        self._inner: tuple[int, KeyedPermutation] | None = None

    def block(self, offset: int) -> int:
        """The position in `shards` of the block holding `offset`."""
        return bisect.bisect_right(self.cum, offset) - 1

    def __getitem__(self, offset: int) -> int:
        j = self.block(offset)
        s = self.shards[j]
        if self._inner is None or self._inner[0] != s:
            self._inner = (s, KeyedPermutation(self.first[s + 1] - self.first[s], f"{self.key}:{s}"))
        return self.first[s] + self._inner[1][offset - self.cum[j]]


def is_eval(index: np.ndarray | int, fraction: float) -> np.ndarray | bool:
    # Knuth's multiplicative hash spreads held-out windows evenly through the corpus.
    h = (np.asarray(index, dtype=np.uint64) * np.uint64(2654435761)) % np.uint64(2**32)
    return h < np.uint64(int(fraction * 2**32))


@dataclass
class DataPosition:
    """Where this node is in its training order; saved in every checkpoint."""

    epoch: int = 0
    offset: int = 0


class TokenDataset:
    def __init__(self, source: TokenSource, seq_len: int, eval_fraction: float, order_key: str,
                 blocked: bool = False):
        self.source, self.seq_len, self.eval_fraction, self.order_key = source, seq_len, eval_fraction, order_key
        self.blocked = blocked  # the shard-blocked order of a corpus fetched from the swarm (`BlockedOrder`)
        self.n_windows = (len(source) - 1) // seq_len
        if not self._has_both_splits():
            raise UserError(
                f"corpus too small: {len(source)} tokens give {self.n_windows} windows of inner.seq_len={seq_len}; "
                "use more text or a shorter inner.seq_len"
            )
        self.position = DataPosition()
        self._order: KeyedPermutation | BlockedOrder | None = None
        self._peeked: dict[int, BlockedOrder] = {}
        self._peek_lock = threading.Lock()

    def _has_both_splits(self) -> bool:
        """At least one training and one held-out window (found by looking at the first few)."""
        seen: set[bool] = set()
        for start in range(0, self.n_windows, 4096):
            seen.update(bool(e) for e in is_eval(np.arange(start, min(start + 4096, self.n_windows)),
                                                  self.eval_fraction))
            if len(seen) == 2:
                return True
        return False

    def describe(self) -> str:
        held = round(self.n_windows * self.eval_fraction)
        return f"{len(self.source):,} tokens, {self.n_windows:,} windows (~{held:,} held out)"

    def _window(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return self.source.slice(start, start + self.seq_len + 1)

    def _batch(self, windows: list[int]) -> torch.Tensor:
        return torch.from_numpy(np.stack([self._window(i) for i in windows]).astype(np.int64))

    def _epoch_order(self, epoch: int) -> KeyedPermutation | BlockedOrder:
        if self._order is None or self._order_epoch != epoch:
            self._order, self._order_epoch = self._make_order(epoch), epoch
        return self._order

    def _make_order(self, epoch: int) -> KeyedPermutation | BlockedOrder:
        if self.blocked:
            return BlockedOrder(self.n_windows, self.source.starts, self.seq_len,  # type: ignore[attr-defined]
                                f"{self.order_key}:{epoch}")
        return KeyedPermutation(self.n_windows, f"{self.order_key}:{epoch}")

    def _peek(self, epoch: int) -> BlockedOrder:
        """Epoch `epoch`'s blocked order for `upcoming_shards`, cached apart from the training
        thread's (`_epoch_order`), which another thread must not swap under it."""
        with self._peek_lock:
            order = self._peeked.get(epoch)
            if order is None:
                order = self._make_order(epoch)
                assert isinstance(order, BlockedOrder)
                self._peeked = {e: o for e, o in self._peeked.items() if e >= epoch - 1}
                self._peeked[epoch] = order
            return order

    def upcoming_shards(self, blocks: int) -> list[int]:
        """The shards that the current block and the next `blocks` read, in the order needed
        (a block's last window may run into the next shard); only in the blocked order."""
        position = self.position  # read by the prefetch thread: a hint, never written here
        epoch, offset = position.epoch, position.offset
        if offset >= self.n_windows:
            epoch, offset = epoch + 1, 0
        order = self._peek(epoch)
        out: list[int] = []
        j = order.block(offset)
        n_shards = len(order.shards)
        for _ in range(blocks + 1):
            if j >= n_shards:
                epoch, j = epoch + 1, 0
                order = self._peek(epoch)
            s = order.shards[j]
            for t in (s, s + 1):
                if t < n_shards and t not in out:
                    out.append(t)
            j += 1
        return out

    def next_windows(self, n: int) -> list[int]:
        """The indices of the next `n` training windows; advances the position."""
        windows: list[int] = []
        while len(windows) < n:
            if self.position.offset >= self.n_windows:
                self.position = DataPosition(self.position.epoch + 1, 0)
            i = self._epoch_order(self.position.epoch)[self.position.offset]
            self.position.offset += 1
            if not is_eval(i, self.eval_fraction):
                windows.append(i)
        return windows

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """The next `batch_size` training windows, shape (batch, seq_len + 1); advances the position."""
        return self._batch(self.next_windows(batch_size))

    def eval_batches(self, n_batches: int) -> list[torch.Tensor]:
        """`n_batches` held-out batches of `EVAL_BATCH` windows, the first in corpus order:
        identical on every node, whatever its batch size."""
        wanted, windows = n_batches * EVAL_BATCH, []
        for start in range(0, self.n_windows, 4096):
            index = np.arange(start, min(start + 4096, self.n_windows))
            windows += index[is_eval(index, self.eval_fraction)].tolist()
            if len(windows) >= wanted:
                break
        windows = windows[:wanted]
        return [self._batch(windows[i : i + EVAL_BATCH]) for i in range(0, len(windows), EVAL_BATCH)]
