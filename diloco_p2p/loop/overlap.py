"""Communication hidden behind compute: ``sync.overlap``, one round's average in flight.

``delayed`` and ``eager`` (Kale, Douillard et al. 2025, arXiv:2502.12996) run round t's
all-reduce during round t+1's inner steps and land it at its end; ``inner`` (Streaming DiLoCo,
arXiv:2501.18512) lands it τ steps in and merges it into the weights being trained. Every member
keeps a bit-identical θ, so the state is split: the global (θ, m), driven by the averages only,
and an eager node's local correction (`EagerCorrection`), never hashed or sent. `Pipeline` holds
the flight, lands it and checkpoints it in the 1-rank layout; the last round drains it.
The algebra and the multi-rank rules: docs/architecture.md, "Overlap and fragments".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diloco_p2p.config import OuterConfig, overlap_modes
from diloco_p2p.contract import InFlight, RoundOutcome, begin_average, resolved

OVERLAPS = overlap_modes.NAMES  # declared once, with what each hides (`diloco_p2p.config.overlap_modes`)


def outer_update(theta: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, cfg: OuterConfig) -> None:
    """The outer optimizer's step in place, exactly `OuterOptimizer.step` without delayed
    Nesterov: m ← β·m + g; θ ← θ − η·(g + β·m) (Nesterov) or θ − η·m."""
    momentum.mul_(cfg.momentum).add_(grad)
    update = grad.add(momentum, alpha=cfg.momentum) if cfg.nesterov else momentum
    theta.sub_(update, alpha=cfg.lr)


class EagerCorrection:
    """A node's local correction (c, μ) to the global (θ, m), and the pending local term
    a_{t-1}·Δ_m^(t-1) (docs/architecture.md). All zero: the node trains from the global θ."""

    def __init__(self, numel: int, cfg: OuterConfig):
        self.cfg = cfg
        self.theta = torch.zeros(numel)
        self.momentum = torch.zeros(numel)
        self.pending = torch.zeros(numel)

    def step(self, local_term: torch.Tensor) -> None:
        """Algorithm 3 line 11's local part: d = a_t·Δ_m^(t) − a_{t-1}·Δ_m^(t-1), run through
        the outer optimizer from the correction's own state; `local_term` = a_t·Δ_m^(t)."""
        d = local_term.to(torch.float32) - self.pending
        outer_update(self.theta, self.momentum, d, self.cfg)
        self.pending = local_term.to(torch.float32).clone()

    def reset(self) -> None:
        """Drop the correction (a state adopted from the swarm, or the pipeline drained)."""
        for t in (self.theta, self.momentum, self.pending):
            t.zero_()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"overlap.theta": self.theta, "overlap.momentum": self.momentum, "overlap.pending": self.pending}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in self.state_tensors().items():
            if name in tensors:
                if tensors[name].shape != t.shape:
                    raise ValueError(f"{name} has {tensors[name].numel()} values, this model has {t.numel()}")
                t.copy_(tensors[name].to(torch.float32))


class Pipeline:
    """A node's overlap state: the average in flight and, for ``eager``, the local correction. The
    overlap modes (`diloco_p2p.loop.rounds`) call `take` for round t-1's average at the end of round
    t (``inner``: τ steps in), then `correct` and `begin`; a joiner applies the served average in
    its first round (`adopt`)."""

    def __init__(self, mode: str, numel: int, cfg: OuterConfig, group: int, steps: int = 0):
        self.mode = mode
        # overlap=inner: the inner step of the next round after which the average lands (τ; 0: once known)
        self.lands_after = steps if mode == "inner" else None
        self.correction = EagerCorrection(numel, cfg) if mode == "eager" else None
        self.group = max(1, group)  # M of a_t = 1/M: our last group's size
        self.inflight: InFlight | None = None
        self._abandoned: InFlight | None = None

    def start_point(self, theta: torch.Tensor) -> torch.Tensor:
        """The θ the node trains from: the global θ, plus the correction when eager."""
        return theta if self.correction is None else theta + self.correction.theta

    def local_offset(self) -> torch.Tensor | None:
        """c_m, what the start point adds to θ (None: nothing)."""
        return None if self.correction is None else self.correction.theta

    def take(self) -> InFlight | None:
        """The average in flight, once done and made node-wide (None when none is: the first
        round of a run). On N local ranks every rank calls it at the same point of the loop."""
        flight, self.inflight = self.inflight, None
        if flight is not None:
            flight.node_result()
        return flight

    def learn(self, outcome: RoundOutcome) -> None:
        """Our share of the next average is 1/M with M the group that just averaged."""
        if outcome.status == "committed":
            self.group = max(1, outcome.contributors or outcome.group_size)

    def correct(self, delta: torch.Tensor) -> None:
        if self.correction is not None:
            self.correction.step(delta / self.group)

    def begin(self, sync, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> None:
        self.settle()
        self.inflight = begin_average(sync, round, delta, weight, params_hash)

    def settle(self) -> None:
        """Wait out an average whose result was dropped: one averaging at a time per sync."""
        if self._abandoned is not None:
            try:
                self._abandoned.result()
            except Exception:  # noqa: S110 - its result is dropped anyway
                pass
            self._abandoned = None

    def drop(self) -> None:
        """The node adopts the swarm's state: our round in flight and our correction no longer apply."""
        if self.inflight is not None and not self.inflight.done():
            self._abandoned = self.inflight
        self.inflight = None
        if self.correction is not None:
            self.correction.reset()

    def inflight_done(self, wait: bool = False) -> bool:
        """Whether the average in flight (if any) is known; `wait` for it first."""
        if self.inflight is not None and wait:
            self.inflight.result()
        return self.inflight is None or self.inflight.done()

    def served_tensors(self) -> dict[str, torch.Tensor]:
        """What a joiner needs beyond θ and momentum: the known average of the round in flight."""
        flight = self.inflight
        if flight is None or not flight.done() or flight.result().average is None or \
                flight.result().status != "committed":
            return {}
        return {"overlap.average": flight.result().average,
                "overlap.average_round": torch.tensor([flight.round], dtype=torch.int64)}

    def adopt(self, tensors: dict[str, torch.Tensor], round: int, numel: int) -> None:
        """Take over a served state's in-flight average (see the class docstring), if it has one
        for `round` (the state's round) of the right size."""
        self.drop()
        average, rnd = tensors.get("overlap.average"), tensors.get("overlap.average_round")
        if average is None or rnd is None or rnd.numel() != 1 or int(rnd.reshape(-1)[0]) != round \
                or average.numel() != numel or not bool(torch.isfinite(average).all()):
            return
        self.inflight = resolved(round, torch.zeros(0), 0.0, "", RoundOutcome(
            status="committed", average=average.to(torch.float32).reshape(-1).clone(), group_size=self.group))

    # -- checkpoints ---------------------------------------------------------------------------

    def state_tensors(self, to_full: Callable[[torch.Tensor], torch.Tensor | None] = lambda t: t
                      ) -> tuple[dict[str, torch.Tensor | None], dict[str, float | int]]:
        """The pending local Δ (the round in flight, to average again on resume) and the correction,
        each through `to_full` (on N local ranks `ShardLayout.to_full`: a collective, in the same
        order on every rank, whose result only rank 0 gets)."""
        tensors = dict(self.correction.state_tensors()) if self.correction is not None else {}
        meta: dict[str, float | int] = {"group": self.group}
        if self.inflight is not None and self.inflight.delta.numel():
            tensors["overlap.inflight_delta"] = self.inflight.delta
            meta.update(inflight_round=self.inflight.round, inflight_weight=self.inflight.weight)
        return {name: to_full(t) for name, t in tensors.items()}, meta

    def load(self, tensors: dict[str, torch.Tensor], meta: dict,
             to_local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> tuple[int, torch.Tensor, float] | None:
        """Restore from a checkpoint (the 1-rank layout, sliced by `to_local` on N local ranks);
        the round in flight to start again, if any."""
        self.group = int(meta.get("group", self.group))
        ours = {name: to_local(t.reshape(-1)) for name, t in tensors.items() if name in _PER_PARAMETER}
        if self.correction is not None:
            self.correction.load_state_tensors(ours)
        delta = ours.get("overlap.inflight_delta")
        if delta is None or "inflight_round" not in meta:
            return None
        return int(meta["inflight_round"]), delta.to(torch.float32).reshape(-1).clone(), float(meta["inflight_weight"])


# The pipeline's checkpoint tensors with one value per parameter (full in the 1-rank layout).
_PER_PARAMETER = ("overlap.theta", "overlap.momentum", "overlap.pending", "overlap.inflight_delta")
