"""Communication hidden behind compute: ``sync.overlap`` (Kale, Douillard et al., "Eager Updates
for Overlapped Communication and Computation in DiLoCo", 2025, arXiv:2502.12996;
``shared/papers/eager-updates-overlapped-diloco.txt``).

With ``sync.overlap: none`` a round ends with a blocking all-reduce of its pseudo-gradient Δ.
With ``delayed`` or ``eager`` the all-reduce of round t's Δ_m^(t) runs in the background during
round t+1's inner steps (`begin_average`); at the end of round t+1 the node waits for it (the
only communication the loop still sees: ``exposed_seconds``) and applies it. In the paper's
notation, with Δ^(t) = (1/M) Σ_m Δ_m^(t) the all-reduced outer gradient:

- ``delayed`` (§2.2, Algorithm 2 line 10):  θ^(t) = OuterOpt(θ^(t-1), Δ^(t-1)).
- ``eager`` (§2.3, Algorithm 3 lines 11-12):
      Δ̃_m^(t) = Δ^(t-1) + (1/M)·(Δ_m^(t) − Δ_m^(t-1))
                (= (1/M)·Δ_m^(t) + (1/M)·Σ_{m'≠m} Δ_{m'}^(t-1): the fresh local Δ stands in
                 for its own stale share of the average);
      θ_m^(t)  = OuterOpt(θ_m^(t-1), Δ̃_m^(t)).

In the paper each worker's θ_m is its own and never synchronized. Here every member must end
each round with bit-identical θ (``params_sha256``), so the worker state is split in two. The
outer optimizer (SGD, Nesterov or heavy-ball momentum: m ← β·m + g; θ ← θ − η·(g + β·m)) is
linear in (θ, m, g), so running it on g = Δ^(t-1) + d_m^(t), d_m^(t) = a_t·Δ_m^(t) − a_{t-1}·Δ_m^(t-1),
from the shared start (θ^(0), 0) gives exactly

      (θ_m, m_m) = (θ, m) + (c_m, μ_m),

where (θ, m) is the *global* state, driven by the all-reduced Δ^(t-1) only (Algorithm 2's
sequence: identical on every member, hashed and served to joiners), and (c_m, μ_m) the node's
*local correction*, the same optimizer run from (0, 0) on d_m alone (`EagerCorrection`). An eager
node trains round t+1 from θ + c_m; ``delayed`` is the same with c_m = 0. a_t is the node's
share of the average, 1/M in the paper; a swarm's groups vary, so a_t = 1/M with M the size of
our last group (``sync.min_group_size`` before the first). Whatever a_t, the corrections
telescope: Σ_s d^(s) = a_t·Δ_m^(t), the "pending" local term kept for the next round.

``inner`` is the inner-step overlap of Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512; the
Eager Updates paper compares against it as "1-inner-step overlap"): round t's average lands τ inner
steps into round t+1 (``sync.overlap_steps``; 0: as soon as it is known, at the latest after H−1
steps), not at its end. The global θ takes round t's outer step then, as ``delayed`` would take it
at the end of the round, so θ, its hash and what joiners are served are ``delayed``'s exactly; the
weights being trained do not restart from θ but carry on from where round t ended, and at the
landing take the new θ in part:

      θ_local ← α·θ_local + (1 − α)·θ        (α = ``sync.overlap_mix``; Streaming DiLoCo's merge)

so round t+1's Δ = θ − θ_local holds its H steps, the first τ of them from before the landing. The
staleness is τ steps instead of a round; what the all-reduce hides is τ steps of compute instead
of H (`diloco_p2p.planner.plan`). With ``sync.overlap_merge: rebase`` the τ steps' progress is moved onto
the new θ instead, as if round t's outer step had come before them (only their gradients are stale):

      θ_local ← θ + (θ_local − θ_local at the end of round t)

which drops nothing of them; it does better than the mix at τ = 1 and worse at τ ≈ H/2, where
the stale gradients add up (`benchmarks/overlap/overlap_sweep.py`). τ, α and the merge are the node's own:
they change its Δ, never the swarm's θ.

With ``sync.fragments`` = P (Streaming DiLoCo's fragments) round r's Δ, average, outer step and
landing cover only part (r − 1) mod P of the parameters (`Fragments.part`): its all-reduce carries 1/P
of the bytes, so it hides behind about 1/P of the steps, and the other parts carry on training
untouched. Each part still sees P rounds of steps between its syncs.

The last round of a run (train.max_rounds) drains the pipeline: it waits for round t-1's average,
applies it, then averages its own Δ blocking and applies that too, so the run ends on a θ that
holds every round's Δ and no local correction.

On a node of N local ranks (`diloco_p2p.local.fsdp`) every rank runs this pipeline on its own shard:
Δ, the average, the outer step and (c_m, μ_m) are elementwise, so the shards together are the
1-rank pipeline. Each rank averages its shard through its own swarm endpoint
(`diloco_p2p.swarm.multirank`) as in the blocking path; only the outcome is made node-wide, with
small collectives among the ranks, and those must not run in the background thread, where they
would interleave with FSDP's collectives on the loop's thread. So a flight may carry a
node-wide step (`InFlight.node_result`) that `Pipeline.take` runs on the loop's thread, at the
same point on every rank. Checkpoints hold the pipeline's tensors in the 1-rank layout
(`Pipeline.state_tensors` and `Pipeline.load` take the layout's converters).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diloco_p2p.config import OuterConfig
from diloco_p2p.contract import InFlight, RoundOutcome, begin_average, resolved

OVERLAPS = ("none", "delayed", "eager", "inner")


def outer_update(theta: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, cfg: OuterConfig) -> None:
    """The outer optimizer's step in place, exactly `OuterOptimizer.step` without delayed
    Nesterov: m ← β·m + g; θ ← θ − η·(g + β·m) (Nesterov) or θ − η·m."""
    momentum.mul_(cfg.momentum).add_(grad)
    update = grad.add(momentum, alpha=cfg.momentum) if cfg.nesterov else momentum
    theta.sub_(update, alpha=cfg.lr)


class EagerCorrection:
    """A node's local correction (c, μ) to the global (θ, m), and the pending local term
    a_{t-1}·Δ_m^(t-1) (module docstring). All zero: the node trains from the global θ."""

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
    """A node's overlap state: the average in flight and, for ``eager``, the local correction.

    The loop's overlap modes (`diloco_p2p.loop.rounds`) call `take` at the end of round t (under
    ``inner`` τ steps into it) for round t-1's average, apply what it returns to the global θ,
    then `correct` and `begin` round t's. The node publishes round t (its record and state) only
    once round t's average is known, and the state then carries it (`served_tensors`): θ of
    round t does not hold it yet, and a joiner adopting that state applies it in its first round
    as the members do (`adopt`), so it ends that round with their θ.
    """

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
