"""The DiLoCo outer step: a small object of tensors, with no networking inside.

DiLoCo (Douillard et al., 2023; see ``shared/papers/diloco-reference-page.txt``) keeps global
parameters θ and runs H inner AdamW steps from them on each worker. The *pseudo-gradient*
is old minus new, Δ = θ − θ_local (the sign matters: the flipped sign walks away from the
workers and diverges). The workers' Δ are averaged, and an outer SGD step with Nesterov
momentum is applied to θ, exactly as ``torch.optim.SGD(nesterov=True, dampening=0)`` would
with Δ̄ as the gradient:

    m ← β·m + Δ̄
    θ ← θ − η·(Δ̄ + β·m)          (without Nesterov: θ ← θ − η·m)

θ and m live in fp32 on the host (never on the GPU: they are touched once per round), as one
flat buffer each so the network layer can hand an averaged flat vector straight back. Every
peer that applies the same Δ̄ to the same (θ, m) ends with bit-identical θ, which
`params_sha256` makes checkable. With η = 1 and β = 0 the step is plain parameter averaging.

Delayed Nesterov (AsyncDiLoCo, Liu et al. 2024; ``shared/papers/review-diloco-opendiloco-asyncdiloco.txt``,
MATH ENTRY 4), with ``outer.delayed_nesterov = N``: each step's Δ̄ goes into a buffer b; on
steps 1..N-1 of each cycle θ ← θ − η·(Δ̄ + c·m) (plain SGD, c = ``outer.dn_momentum_fraction``),
and on the N-th the momentum step uses the buffer and empties it:

    m ← β·m + b;   θ ← θ − η·(b + β·m);   b ← 0

The buffer and the step count are part of the outer state (`state_tensors`) so a joiner that
adopts the swarm's state flushes in step with it.

Hashing θ costs a pass over it (4 GB at 1B parameters), so the hash is cached by `version`,
which changes whenever θ does: θ is hashed once per distinct value, not once per caller.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from diloco_p2p.config import OuterConfig


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors (any device or dtype) into one flat fp32 CPU vector."""
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def dylu_steps(speeds: Mapping[str, float], me: str, h: int) -> int:
    """Dynamic local updates (AsyncDiLoCo, Liu et al. 2024; review MATH ENTRY 6): the fastest
    member runs H inner steps, a slower one ⌊v/max v · H⌋ (at least 1), so all reach the
    all-reduce together; the token weighting of the average accounts for the fewer steps.
    H when our speed or the group's is unknown."""
    fastest = max(speeds.values(), default=0.0)
    mine = speeds.get(me, 0.0)
    if not (fastest > 0 and mine > 0):
        return h
    return max(1, min(h, math.floor(mine / fastest * h)))


def tensor_sha256(flat: torch.Tensor) -> str:
    return hashlib.sha256(flat.contiguous().numpy().tobytes()).hexdigest()


class OuterOptimizer:
    """Global parameters θ, Nesterov momentum m, and the outer SGD step on them."""

    def __init__(self, params: Sequence[torch.Tensor], cfg: OuterConfig):
        self.cfg = cfg
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        self.theta = flatten(params)
        self.momentum = torch.zeros_like(self.theta)
        # Delayed Nesterov only: the buffer of Δ̄ since the last flush, and outer steps taken.
        self.dn_buffer = torch.zeros_like(self.theta) if cfg.delayed_nesterov else None
        self.dn_steps = 0
        self.version = 0  # bumped whenever θ changes
        self._hash: tuple[int, str] | None = None

    @property
    def numel(self) -> int:
        return self.theta.numel()

    def pseudo_gradient(self, local_params: Sequence[torch.Tensor], offset: torch.Tensor | None = None) -> torch.Tensor:
        """Δ = θ − θ_local, as a flat fp32 vector; from θ + offset when the round started there."""
        start = self.theta if offset is None else self.theta + offset
        return start - flatten(local_params)

    def step(self, avg_delta: torch.Tensor) -> None:
        """Apply one outer SGD(+Nesterov) step with the averaged pseudo-gradient Δ̄."""
        if avg_delta.shape != self.theta.shape:
            raise ValueError(f"averaged pseudo-gradient has shape {tuple(avg_delta.shape)}, expected {self.theta.shape}")
        if not torch.isfinite(avg_delta).all():
            # The network layer rejects non-finite contributions; this is the last line of defence.
            raise ValueError("averaged pseudo-gradient is not finite; refusing to apply it to the global parameters")
        delta = avg_delta.to(torch.float32)
        beta, lr = self.cfg.momentum, self.cfg.lr
        if self.dn_buffer is not None:
            self._delayed_step(delta)
        else:
            self.momentum.mul_(beta).add_(delta)
            update = delta.add(self.momentum, alpha=beta) if self.cfg.nesterov else self.momentum
            self.theta.sub_(update, alpha=lr)
        self.version += 1

    def _delayed_step(self, delta: torch.Tensor) -> None:
        """Delayed Nesterov (see the module docstring)."""
        assert self.dn_buffer is not None and self.cfg.delayed_nesterov
        beta, lr = self.cfg.momentum, self.cfg.lr
        self.dn_buffer.add_(delta)
        self.dn_steps += 1
        if self.dn_steps % self.cfg.delayed_nesterov == 0:
            self.momentum.mul_(beta).add_(self.dn_buffer)
            self.theta.sub_(self.dn_buffer.add(self.momentum, alpha=beta), alpha=lr)
            self.dn_buffer.zero_()
        else:
            self.theta.sub_(delta.add(self.momentum, alpha=self.cfg.dn_momentum_fraction), alpha=lr)

    def copy_into(self, params: Sequence[torch.Tensor], offset: torch.Tensor | None = None) -> None:
        """Load θ (+ offset: an eager node's local correction) into the model's (local) parameters,
        whatever their device and dtype."""
        theta = self.theta if offset is None else self.theta + offset
        with torch.no_grad():
            for p, chunk in zip(params, theta.split(self.numels), strict=True):
                p.copy_(chunk.view(p.shape))

    def mix_into(self, params: Sequence[torch.Tensor], alpha: float) -> None:
        """θ_local ← α·θ_local + (1−α)·θ in the model's (local) parameters (sync.overlap=inner)."""
        with torch.no_grad():
            for p, chunk in zip(params, self.theta.split(self.numels), strict=True):
                p.lerp_(chunk.view(p.shape).to(p), 1.0 - alpha)

    def params_sha256(self) -> str:
        """sha256 of θ's bytes (cached until θ changes)."""
        if self._hash is None or self._hash[0] != self.version:
            self._hash = (self.version, tensor_sha256(self.theta))
        return self._hash[1]

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
        self.theta = theta.to(torch.float32).clone()
        self.momentum = momentum.to(torch.float32).clone()
        if self.dn_buffer is not None:  # a state without them (a checkpoint): an empty buffer
            buffer = tensors.get("outer.dn_buffer")
            ok = buffer is not None and buffer.shape == self.theta.shape
            self.dn_buffer = buffer.to(torch.float32).clone() if ok else torch.zeros_like(self.theta)
            steps = tensors.get("outer.dn_steps")
            self.dn_steps = int(steps.reshape(-1)[0]) if ok and steps is not None and steps.numel() == 1 else 0
        self.version += 1
