"""`inner`, `outer` and `train`: the inner steps, the DiLoCo outer step, and the loop around them.

The loop's settings are its length, device, precision, evaluation and checkpoints.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from diloco_p2p.config.section import Section


class InnerConfig(Section):
    lr: float = Field(4e-4, gt=0, description="Peak AdamW learning rate of the inner steps.")
    batch_size: int = Field(8, gt=0, description="Sequences per micro-batch.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches accumulated into one inner step.")
    seq_len: int = Field(128, gt=1, description="Tokens per training sequence.")
    warmup_steps: int = Field(100, ge=0, description="Linear warmup steps before the cosine decay.")
    total_steps: int | None = Field(
        None, gt=0, description="Length of the cosine schedule in inner steps; unset = train.max_rounds * outer.inner_steps."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor as a fraction of `inner.lr`.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this value (0 = off).")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="The inner optimizer: `adamw`, or `muon` (MuLoCo, Thérien et al. 2025): Muon on the "
        "hidden layers' 2-D weight matrices, AdamW on the embeddings, lm_head and norms. Chosen per node (θ moves "
        "only by the swarm's average); on a node of several local ranks each FSDP-sharded matrix is orthogonalized whole.",
    )
    muon_lr: float | None = Field(
        None, gt=0, description="Peak Muon learning rate under inner.optimizer=muon, on the same schedule; unset = "
        "`inner.lr` (the update is scaled to AdamW's RMS, torch's `match_rms_adamw`); 4-8x `inner.lr` did better on "
        "the tiny, small and 35m models (docs/recipes.md).",
    )
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon's Nesterov momentum under inner.optimizer=muon.")


class OuterConfig(Section):
    inner_steps: int = Field(500, gt=0, description="H: inner steps between two outer steps.")
    lr: float = Field(0.7, ge=0, description="Outer SGD learning rate (1.0 with momentum 0 = plain averaging).")
    momentum: float = Field(0.9, ge=0, lt=1, description="Outer SGD momentum.")
    nesterov: bool = Field(True, description="Use Nesterov momentum in the outer step.")
    dynamic_local_updates: bool = Field(
        False,
        description="Dynamic local updates (AsyncDiLoCo): a node slower than the fastest of its last group runs "
        "proportionally fewer inner steps (at least 1), so the group reaches the all-reduce together.",
    )
    delayed_nesterov: int | None = Field(
        None, ge=1,
        description="Delayed Nesterov (AsyncDiLoCo): sum N outer steps' averaged Δ in a buffer, apply plain SGD "
        "between, and the Nesterov step on the buffer every N-th outer step; unset = Nesterov every step.",
    )
    dn_momentum_fraction: float = Field(
        0.0, ge=0,
        description="c of delayed Nesterov: the fraction of the momentum applied between its flushes (at most 1/N).",
    )
    recipe: Literal["manual", "auto"] = Field(
        "manual",
        description="`auto` sets every outer field below that the config leaves unset (H's schedule, its start, "
        "outer.lr, outer.momentum, the outer warmup) from outer.nodes, train.max_rounds and inner.optimizer, by the table that "
        "benchmarks/quality/quality.py measured (`diloco_p2p.config.recipe`); `manual` uses the fields as given.",
    )
    nodes: int = Field(
        4, ge=1, description="The number of nodes the run plans for (M); only outer.recipe=auto reads it.",
    )
    h_schedule: Literal["constant", "ramp", "qsr"] = Field(
        "constant",
        description="H of each round: `constant` = outer.inner_steps; `ramp` doubles from outer.h_start each round up "
        "to outer.inner_steps (post-local SGD); `qsr` grows it from outer.h_start as the cosine lr decays (H ∝ 1/lr², "
        "Gu et al. 2023). The run still takes train.max_rounds x outer.inner_steps inner steps; the shorter early "
        "rounds add all-reduces (`diloco_p2p.config.schedule`).",
    )
    h_start: int = Field(1, gt=0, description="H of the first round under outer.h_schedule ramp or qsr.")
    warmup_rounds: int = Field(
        0, ge=0,
        description="Outer warmup: over the first this many rounds outer.lr moves linearly from outer.lr_start and "
        "outer.momentum from 0 to their values (0 = off).",
    )
    lr_start: float | None = Field(
        None, ge=0, description="outer.lr of the first round under outer.warmup_rounds; unset = outer.lr.",
    )

    @model_validator(mode="after")
    def _dn_fraction(self) -> OuterConfig:
        if self.delayed_nesterov and self.dn_momentum_fraction > 1 / self.delayed_nesterov:
            raise ValueError("outer.dn_momentum_fraction must be at most 1 / outer.delayed_nesterov")
        if self.h_start > self.inner_steps:
            raise ValueError(f"outer.h_start ({self.h_start}) must be at most outer.inner_steps ({self.inner_steps})")
        return self

    @property
    def scheduled(self) -> bool:
        """Whether H, η or β change from round to round (`diloco_p2p.config.schedule`)."""
        return self.h_schedule != "constant" or self.warmup_rounds > 0


class TrainConfig(Section):
    max_rounds: int = Field(
        10, gt=0,
        description="The run's length in rounds of outer.inner_steps: it takes max_rounds x outer.inner_steps inner "
        "steps; under outer.h_schedule the early rounds are shorter, so it takes more rounds (`diloco_p2p.config.schedule.rounds`).",
    )
    eval_batches: int = Field(
        8, ge=0, description="Held-out batches of 8 windows scored after each round (0 = no eval); a fixed set, "
        "the same on every node whatever `inner.batch_size` is.",
    )
    eval_every: int = Field(1, gt=0, description="Evaluate every this many rounds (and after the last).")
    checkpoint_every: int = Field(1, gt=0, description="Write a local checkpoint every this many rounds.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="`auto` uses CUDA when present.")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="`auto` = bf16 autocast on CUDA, fp32 on CPU."
    )
    compile: bool = Field(
        False, description="Compile the model's forward with `torch.compile` (the first steps take longer while "
        "it compiles; see `benchmarks/gpu/gpu_inner.py` for what it gains).",
    )
    num_threads: int | None = Field(
        None, gt=0,
        description="torch CPU threads; unset = the machine's cores shared among the training processes running "
        "on it (re-checked every round), so nodes on one machine do not oversubscribe it.",
    )
    resume_round: int | None = Field(
        None, ge=0,
        description="Resume from this round's local checkpoint instead of the latest (e.g. when the latest is "
        "corrupt); unset = the latest.",
    )
