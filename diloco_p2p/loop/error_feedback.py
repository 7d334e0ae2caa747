"""Error feedback for the lossy wires (``sync.error_feedback``): what a node did not send this
round is added to its next pseudo-gradient.

With a compressor C, a node sends C(Δ + e) instead of C(Δ) and keeps e ← Δ + e − C(Δ + e),
so every part of Δ eventually reaches the swarm, only late (error feedback / memory: Seide et
al. 2014 for 1-bit SGD, Stich et al. 2018 "Sparsified SGD with memory", Lin et al. 2018 Deep
Gradient Compression; SparseLoCo, Sarfi et al. 2025, applies it to DiLoCo's pseudo-gradients
with top-k + 2-bit values, our ``topk2``). C(x) is exactly what the receivers decode of our
contribution: for the butterfly wires (int8, int4) the parts of `wire.partition(n, k)` encoded
chunk by chunk from each part's start (a block never straddles a part boundary, so C depends
on the group size k, which the round's outcome reports); for ``topk2`` the whole vector,
chunked (`codecs.encode_chunks`). fp32 and fp16 have nothing worth feeding back.

With ``sync.feedback_decay`` β < 1 the buffer decays before it is offered: the node offers
Δ + β·e and keeps Δ + β·e − C(Δ + β·e), SparseLoCo's e ← β·e + Δ, send C(e), e ← e − C(e)
(Sarfi et al. 2025, arXiv:2508.15706; β = 0.95 there). SparseLoCo runs it *instead of* outer
momentum (outer momentum 0, outer lr about 1): the buffer then holds, decayed, the directions
a node has not sent yet, as a momentum buffer holds, decayed, the ones already applied.
β = 1 is the plain rule above, bit for bit.

With ``sync.feedback_carry`` γ > 0 a round's inner steps start from θ − γ·β·e instead of θ: the
node's model keeps (a share γ of) the progress it has not sent yet. Plain error feedback restarts
every round from θ, so a coordinate that was not sent is trained again from where it was and its
Δ is owed once more, round after round (on a coordinate that H steps take to a nearby optimum the
residual grows by that distance each round, not by the distance once); with γ = 1 the offer is
θ − θ_local, the model's whole distance from θ, owed once. Δ is taken from the round's start
(`OuterState.pseudo_gradient`'s offset), so the offer stays Δ + β·e = θ − θ_local + (1−γ)·β·e.
Only with sync.overlap none and sync.fragments 1, whose rounds start from weights of their own;
unset, γ is 0.5 there under topk2 (below γ = 0 on every seed of every schedule measured:
`benchmarks/wire/results/compression_topk_carry.txt`) and 0 otherwise.

Bit-identical θ is untouched: e only changes what this node *offers* (and where it trains
from); θ moves by the agreed average, which every member computes from the same bytes.

After a round: committed, e as above (even if a reducer dropped a part or our contribution:
a simplification, the error of a dropped contribution is then lost, as without feedback);
alone or failed with our own Δ + e applied whole (``alone_policy: apply``), e = 0; with nothing
applied, e keeps its value (undecayed: for e that round did not happen), and so with a stop
while the round averages (the round is dropped, the checkpoint holds e: `withdraw`). Under
``sync.overlap`` the offer of round t is settled when its average arrives, before round t+1's
offer: e lives in the offer in between, so it is never offered twice. In a grid all-reduce
(`swarm.collective.hierarchy`) a member's parts are those of its row, not of the whole membership, so for int8/int4 the residual is computed with slightly different
block boundaries than were sent (topk2 always runs as one all-gather: exact). e is per process: on N local ranks each rank keeps its shard's e,
which checkpoints store in the 1-rank layout like the outer momentum. A node that adopts the
swarm's state (resync or join) resets e to 0: e holds what its *old* trajectory did not send,
pseudo-gradients taken from a θ the swarm no longer has (or never had: a diverged node), so
adding it would pull the swarm toward a state it left; and the state a node downloads is the
swarm's (θ, momentum), which holds no member's private residual.
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
