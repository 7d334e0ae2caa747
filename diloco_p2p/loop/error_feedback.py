"""Error feedback for the lossy wires (``sync.error_feedback``): what was not sent is sent later.

With a compressor C a node sends C(Δ + e) and keeps e ← Δ + e − C(Δ + e), so every part of Δ
eventually reaches the swarm (Seide et al. 2014; Stich et al. 2018; SparseLoCo, Sarfi et al.
2025, arXiv:2508.15706); C is exactly what the receivers decode. ``sync.feedback_decay`` β decays
the buffer before it is offered; ``sync.feedback_carry`` γ starts a round's inner steps from
θ − γ·β·e. θ stays bit-identical: e only changes what a node offers. e is settled by how the
round ended, checkpointed, and reset when the node adopts the swarm's state.
The rules after each outcome, and why: docs/architecture.md, "Error feedback".
"""

from __future__ import annotations

import torch

from diloco_p2p.config import SyncConfig
from diloco_p2p.contract import RoundOutcome
from diloco_p2p.swarm.collective import codecs, wire


def sent_values(x: torch.Tensor, compression: str, group_size: int, *, density: float = 0.01,
                chunk: int = wire.DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """What the receivers decode of our contribution `x` in a group of `group_size` (see above)."""
    if compression in wire.SPARSE:
        return codecs.decode_chunks(codecs.encode_chunks(x, chunk, density), x.numel(), chunk, density)
    out = torch.empty(x.numel(), dtype=torch.float32)
    for lo, hi in wire.partition(x.numel(), max(group_size, 1)):
        out[lo:hi] = wire.roundtrip(x[lo:hi], compression, chunk)
    return out


class ErrorFeedback:
    """This process's residual e (flat fp32, the size of its share of Δ), or nothing when off."""

    def __init__(self, numel: int, cfg: SyncConfig, chunk: int = wire.DEFAULT_CHUNK_ELEMENTS):
        self.compression, self.density, self.chunk = cfg.compression, cfg.topk_density, chunk
        self.decay, self.carry = cfg.feedback_decay, cfg.carry
        self.error: torch.Tensor | None = torch.zeros(numel) if cfg.feedback_on else None
        self._owed: torch.Tensor | None = None  # the e inside the offer not settled yet

    @property
    def enabled(self) -> bool:
        return self.error is not None

    def start_offset(self) -> torch.Tensor | None:
        """Where this round's inner steps start, relative to θ: −γ·β·e (``sync.feedback_carry`` γ, see
        above); None at γ = 0 or with feedback off (from θ)."""
        if self.error is None or self.carry == 0.0:
            return None
        return self.error * (-self.carry * self.decay)

    def offer(self, delta: torch.Tensor, part: tuple[int, int] | None = None) -> torch.Tensor:
        """Δ + β·e: what this node hands to the all-reduce. e moves into the offer until `settle`
        (under ``sync.overlap`` the next round's Δ is taken before this one's average is known).
        With sync.fragments Δ is the values [lo, hi) of `part` and so is the e offered."""
        if self.error is None:
            return delta
        lo, hi = part or (0, self.error.numel())
        error = self.error[lo:hi]
        decayed = error if self.decay == 1.0 else error * self.decay
        offered, self._owed = delta + decayed, error.clone()
        error.zero_()
        return offered

    def settle(self, offered: torch.Tensor, outcome: RoundOutcome, part: tuple[int, int] | None = None) -> None:
        """Update e once the round in which we offered `offered` (= Δ + e, of `part`) has its outcome."""
        if self.error is None:
            return
        if outcome.status != "committed" and outcome.average is None:  # nothing applied: we still owe the old e
            self.withdraw(part)
            return
        self._owed = None  # applied: by the group (e is what it did not receive) or whole, alone (e = 0)
        if outcome.status == "committed":
            lo, hi = part or (0, self.error.numel())
            sent = sent_values(offered, self.compression, outcome.group_size, density=self.density, chunk=self.chunk)
            # a non-finite Δ was refused by every member: owe nothing of it
            self.error[lo:hi] += (offered - sent).nan_to_num_(0.0, 0.0, 0.0)

    def withdraw(self, part: tuple[int, int] | None = None) -> None:
        """The last offer will never be settled (a stop dropped its round): the e inside it is owed
        again, undecayed, and goes into the checkpoint."""
        owed, self._owed = self._owed, None
        if self.error is not None and owed is not None:
            lo, hi = part or (0, self.error.numel())
            self.error[lo:hi] += owed

    def reset(self) -> None:
        if self.error is not None:
            self.error.zero_()
            self._owed = None

    def load(self, error: torch.Tensor) -> None:
        if self.error is not None:
            if error.shape != self.error.shape:
                raise ValueError(f"error-feedback buffer of {error.numel()} values, expected {self.error.numel()}")
            self.error = error.to(torch.float32).clone()
