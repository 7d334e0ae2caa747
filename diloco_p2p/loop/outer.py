"""The DiLoCo outer step: a small object of tensors, with no networking inside.

Δ = θ − θ_local (old minus new); the averaged Δ̄ takes an SGD step with Nesterov momentum,
as ``torch.optim.SGD(nesterov=True, dampening=0)`` would (DiLoCo, Douillard et al. 2023). θ and
m live in fp32 on the host as one flat buffer each, so the network layer hands an averaged flat
vector straight back; on a GPU the copies go through pinned buffers. Every peer that applies the
same Δ̄ to the same (θ, m) ends with bit-identical θ. ``outer.delayed_nesterov`` is AsyncDiLoCo's
delayed Nesterov (Liu et al. 2024). θ's hash is cached by `version` (`diloco_p2p.hashing`).
The step and its variants: docs/architecture.md, "The outer step".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from diloco_p2p import hashing
from diloco_p2p.config import OuterConfig
from diloco_p2p.config.schedule import outer_step


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors (any device or dtype) into one flat fp32 CPU vector."""
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


Part = tuple[int, int]  # [lo, hi) of the flat parameter vector (sync.fragments)


def _on_cuda(tensors: Iterable[torch.Tensor]) -> bool:
    return any(t.device.type == "cuda" for t in tensors)


class OuterOptimizer:
    """Global parameters θ, Nesterov momentum m, and the outer SGD step on them."""

    def __init__(self, params: Sequence[torch.Tensor], cfg: OuterConfig):
        self.cfg = cfg
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        # pinned when the model is on a GPU: θ → GPU and the weights → host as non-blocking copies
        self.pinned = _on_cuda(params) and torch.cuda.is_available()
        self.theta = self._host(flatten(params))
        self.momentum = torch.zeros_like(self.theta)
        self._staging: torch.Tensor | None = None  # the trained weights, copied back for Δ
        # Delayed Nesterov only: the buffer of Δ̄ since the last flush, and outer steps taken.
        self.dn_buffer = torch.zeros_like(self.theta) if cfg.delayed_nesterov else None
        self.dn_steps = 0
        self.version = 0  # bumped whenever θ changes
        self._hash: tuple[int, str] | None = None
        # Past one hash chunk: each chunk's digest, and the chunks changed since (None: all).
        self._digests: list[bytes] = []
        self._stale: set[int] | None = None

    @property
    def numel(self) -> int:
        return self.theta.numel()

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.pinned and not t.is_pinned() else t

    def gather(self, local_params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The model's (local) parameters as one flat fp32 host vector, in a buffer reused every
        round (pinned on a GPU): one queue of non-blocking copies, then one wait."""
        if self._staging is None:
            self._staging = self._host(torch.empty_like(self.theta))
        for p, chunk in zip(local_params, self._staging.split(self.numels), strict=True):
            chunk.view(p.shape).copy_(p.detach(), non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.synchronize()
        return self._staging

    def pseudo_gradient(self, local_params: Sequence[torch.Tensor], offset: torch.Tensor | None = None,
                        part: Part | None = None) -> torch.Tensor:
        """Δ = θ − θ_local, as a flat fp32 vector; from θ + offset when the round started there;
        only the values [lo, hi) of `part` (sync.fragments)."""
        local = self.gather(local_params)
        start = self.theta if offset is None else self.theta + offset
        lo, hi = part or (0, self.numel)
        return start[lo:hi] - local[lo:hi]

    def step(self, avg_delta: torch.Tensor, part: Part | None = None, round: int | None = None) -> None:
        """Apply one outer SGD(+Nesterov) step with the averaged pseudo-gradient Δ̄; to θ[lo:hi]
        and its momentum only when Δ̄ is that `part`'s (sync.fragments: each part steps on its own).
        η and β are round `round`'s under outer.warmup_rounds (`diloco_p2p.config.schedule.outer_step`)."""
        lo, hi = part or (0, self.numel)
        if avg_delta.shape != (hi - lo,):
            raise ValueError(f"averaged pseudo-gradient has shape {tuple(avg_delta.shape)}, expected {(hi - lo,)}")
        if not np.isfinite(avg_delta.detach().to("cpu", torch.float32).numpy()).all():  # numpy's: ~10x torch's
            # The network layer rejects non-finite contributions; this is the last line of defence.
            raise ValueError("averaged pseudo-gradient is not finite; refusing to apply it to the global parameters")
        delta = avg_delta.to(torch.float32)
        if self.dn_buffer is not None:
            assert part is None  # config: fragments need delayed Nesterov unset
            self._delayed_step(delta)
        else:
            lr, beta = outer_step(self.cfg, round) if round else (self.cfg.lr, self.cfg.momentum)
            self._momentum_step(delta, self.cfg.nesterov, lo, hi, lr, beta)
        self._changed(lo, hi)

    def _changed(self, lo: int, hi: int) -> None:
        """θ[lo:hi] changed: a new version, and the hash chunks it spans are stale."""
        self.version += 1
        if self._stale is not None and hi > lo:
            size = self.theta.element_size()
            self._stale.update(range(lo * size // hashing.HASH_CHUNK_BYTES, (hi * size - 1) // hashing.HASH_CHUNK_BYTES + 1))

    def _momentum_step(self, grad: torch.Tensor, nesterov: bool, lo: int = 0, hi: int | None = None,
                       lr: float | None = None, beta: float | None = None) -> None:
        """m ← β·m + g, then θ ← θ − η·(g + β·m), or θ ← θ − η·m without Nesterov (on [lo, hi)).
        On whole vectors: slicing it through a small scratch buffer instead of one θ-sized temporary
        was slower at 1B parameters (1.2-1.4 s against 0.7 s on 16 threads, `benchmarks/gpu/gpu_outer.py`)."""
        beta = self.cfg.momentum if beta is None else beta
        lr = self.cfg.lr if lr is None else lr
        momentum, theta = self.momentum[lo:hi], self.theta[lo:hi]  # views: the steps write through
        momentum.mul_(beta).add_(grad)
        theta.sub_(grad.add(momentum, alpha=beta) if nesterov else momentum, alpha=lr)

    def _delayed_step(self, delta: torch.Tensor) -> None:
        """Delayed Nesterov (docs/architecture.md, "The outer step")."""
        assert self.dn_buffer is not None and self.cfg.delayed_nesterov
        self.dn_buffer.add_(delta)
        self.dn_steps += 1
        if self.dn_steps % self.cfg.delayed_nesterov == 0:
            self._momentum_step(self.dn_buffer, True)
            self.dn_buffer.zero_()
        else:
            self.theta.sub_(delta.add(self.momentum, alpha=self.cfg.dn_momentum_fraction), alpha=self.cfg.lr)

    def copy_into(self, params: Sequence[torch.Tensor], offset: torch.Tensor | None = None,
                  part: Part | None = None) -> None:
        """Load θ (+ offset: an eager node's local correction) into the model's (local) parameters,
        whatever their device and dtype; only θ[lo:hi] with `part` (sync.fragments)."""
        if part is not None:
            self.mix_into(params, 0.0, part)
            return
        theta = self.theta if offset is None else self._host(self.theta + offset)
        with torch.no_grad():
            for p, chunk in zip(params, theta.split(self.numels), strict=True):
                p.copy_(chunk.view(p.shape), non_blocking=self.pinned)
        if self.pinned:  # θ changes on the host next round: the copies must have read it by then
            torch.cuda.synchronize()

    def mix_into(self, params: Sequence[torch.Tensor], alpha: float, part: Part | None = None) -> None:
        """θ_local ← α·θ_local + (1−α)·θ in the model's (local) parameters (sync.overlap=inner), on
        the values [lo, hi) of the flat layout only with `part` (sync.fragments; α = 0 copies)."""
        if part is None:
            with torch.no_grad():
                for p, chunk in zip(params, self.theta.split(self.numels), strict=True):
                    p.lerp_(chunk.view(p.shape).to(p), 1.0 - alpha)
            return
        self.write_into(params, self.theta[part[0]:part[1]], part[0], alpha)

    def write_into(self, params: Sequence[torch.Tensor], values: torch.Tensor, lo: int = 0, alpha: float = 0.0) -> None:
        """Values [lo, lo + len(values)) of the flat layout into the model's parameters (mixed:
        θ_local ← α·θ_local + (1−α)·values)."""
        with torch.no_grad():
            for flat, a, b in self._spans(params, lo, lo + values.numel()):
                chunk = values[a - lo:b - lo].to(flat)
                flat.copy_(chunk) if alpha == 0.0 else flat.lerp_(chunk, 1.0 - alpha)

    def shift_into(self, params: Sequence[torch.Tensor], shift: torch.Tensor, part: Part | None = None) -> None:
        """θ_local ← θ_local + shift on the values [lo, hi) of `part` (all: any local layout)."""
        if part is None:
            with torch.no_grad():
                for p, chunk in zip(params, shift.split(self.numels), strict=True):
                    p.add_(chunk.view(p.shape).to(p))
            return
        with torch.no_grad():
            for flat, a, b in self._spans(params, part[0], part[1]):
                flat.add_(shift[a - part[0]:b - part[0]].to(flat))

    def _spans(self, params: Sequence[torch.Tensor], lo: int, hi: int) -> Iterator[tuple[torch.Tensor, int, int]]:
        """For each parameter holding values of [lo, hi) of the flat layout: a writable view of
        them and their range [a, b) in the layout (a parameter's values, or on N local ranks its
        shard's rows, are contiguous)."""
        start = 0
        for p, n in zip(params, self.numels, strict=True):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                yield p.detach().view(-1)[a - start:b - start], a, b
            start += n

    def params_sha256(self) -> str:
        """sha256 of θ's bytes (cached until θ changes): `tensor_sha256(θ)`, where past one chunk
        only the chunks changed since the last hash are hashed again (under sync.fragments a step
        changes 1/P of θ)."""
        if self._hash is None or self._hash[0] != self.version:
            self._hash = (self.version, self._sha256())
        return self._hash[1]

    def _sha256(self) -> str:
        data = memoryview(self.theta.detach().numpy()).cast("B")
        if data.nbytes <= hashing.HASH_CHUNK_BYTES:
            return hashing.tensor_sha256(self.theta)
        count = -(-data.nbytes // hashing.HASH_CHUNK_BYTES)
        if self._stale is None or len(self._digests) != count:
            self._digests, self._stale = [b""] * count, set(range(count))
        stale = sorted(self._stale)
        if stale:
            for i, digest in zip(stale, hashing.chunk_digests(data, stale), strict=True):
                self._digests[i] = digest
        self._stale = set()
        return hashing.combined_digest(self._digests)

    def snapshot(self, part: Part | None = None) -> dict[str, torch.Tensor]:
        """A copy of θ and momentum on `part` (all of them without), to `restore` if a stop drops
        the outer step about to be taken (sync.overlap)."""
        lo, hi = part or (0, self.numel)
        return {"lo": torch.tensor(lo), "theta": self.theta[lo:hi].clone(), "momentum": self.momentum[lo:hi].clone()}

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        """θ and momentum back to a `snapshot`."""
        lo = int(snapshot["lo"])
        hi = lo + snapshot["theta"].numel()
        self.theta[lo:hi], self.momentum[lo:hi] = snapshot["theta"], snapshot["momentum"]
        self._changed(lo, hi)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        state = {"outer.theta": self.theta, "outer.momentum": self.momentum}
        if self.dn_buffer is not None:
            state["outer.dn_buffer"] = self.dn_buffer
            state["outer.dn_steps"] = torch.tensor([self.dn_steps], dtype=torch.int64)
        return state

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        theta, momentum = tensors["outer.theta"], tensors["outer.momentum"]
        if theta.shape != self.theta.shape or momentum.shape != self.momentum.shape:
            raise ValueError(
                f"outer state has {theta.numel()} parameters, this model has {self.theta.numel()}"
            )
        self.theta = self._host(theta.to(torch.float32).clone())
        self.momentum = momentum.to(torch.float32).clone()
        if self.dn_buffer is not None:  # a state without them (a checkpoint): an empty buffer
            buffer = tensors.get("outer.dn_buffer")
            ok = buffer is not None and buffer.shape == self.theta.shape
            self.dn_buffer = buffer.to(torch.float32).clone() if ok else torch.zeros_like(self.theta)
            steps = tensors.get("outer.dn_steps")
            self.dn_steps = int(steps.reshape(-1)[0]) if ok and steps is not None and steps.numel() == 1 else 0
        self.version, self._stale = self.version + 1, None
