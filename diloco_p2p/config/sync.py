"""`sync`: averaging with the swarm, its fields declared by concern.

The wire, error feedback, the round's group, robust aggregation, joining and admission, then
overlap and fragments: one base class each, one flat section for the user (`SyncConfig`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from diloco_p2p.config.compression import CODECS
from diloco_p2p.config.compression import NAMES as CODEC_NAMES
from diloco_p2p.config.overlap_modes import MODES, OverlapMode
from diloco_p2p.config.overlap_modes import NAMES as OVERLAP_NAMES
from diloco_p2p.config.section import Section


class AdmissionConfig(Section):
    mode: Literal["open", "closed"] = Field(
        "open",
        description="`open`: any peer that knows the run id may train (the demo); `closed`: only `peers` and "
        "holders of a token signed by `owner_key` (see `diloco-p2p admit`); everyone else's matchmaking, "
        "all-reduce and state streams are refused and their records ignored.",
    )
    peers: list[str] = Field(default_factory=list, description="Peer ids (base58) admitted to a closed run.")
    owner_key: str | None = Field(
        None, description="The run owner's public key (`ssh-rsa ...`, printed by `diloco-p2p admit`): its "
        "admission tokens admit their peer to a closed run.",
    )
    token_path: str | None = Field(
        None, description="This node's admission token (a file written by `diloco-p2p admit`), published in its "
        "progress record so the other nodes of a closed run admit it.",
    )

    @model_validator(mode="after")
    def _closed_has_members(self) -> AdmissionConfig:
        if self.mode == "closed" and not self.peers and not self.owner_key:
            raise ValueError("sync.admission: a closed run needs `peers` or an `owner_key` (nobody could join)")
        return self


class WireSettings(Section):
    """The wire: the pseudo-gradients' format and how fast the all-reduce writes them."""

    compression: Literal[CODEC_NAMES] = Field(
        "fp16", description="Wire format of pseudo-gradients in the all-reduce (accumulation is fp32): fp32, fp16, "
        "int8 or int4 (blockwise absmax) through the butterfly, or topk2 (top-k values per 65,536-value block, 2 bits each) "
        "through a sparse all-gather (for small groups)."
    )
    topk_density: float = Field(
        0.03, gt=0, le=1, description="Fraction of the values each block keeps under compression topk2 (0.03: 59x "
        "fewer bytes than fp16 in a pair, 39x in a group of 3)."
    )
    average_moments: bool = Field(
        False, description="After each committed round, also average the inner optimizers' first moments (Muon's "
        "momentum, AdamW's exp_avg) with the round's group, in a second all-reduce on the same wire and under the "
        "same checks, so the next round starts from the momentum data-parallel would hold: twice the bytes of a "
        "round, for 1.4 to 4.3 points less gap to data-parallel at 8 nodes on the tiny model (docs/recipes.md). "
        "A failed or partial one leaves each node its own. With sync.overlap none, sync.fragments 1 and a dense "
        "compression. Every node of a run must use the same, and the same inner.optimizer."
    )
    link_mbit: float | None = Field(
        None, gt=0, description="This node's uplink in Mbit/s, if known: the all-reduce then writes at `sync.pace` of it, and each round record carries `wire_ratio`, the all-reduce's seconds over the time its bytes take at this rate (1.0 = line rate). Unset: no ratio."
    )
    pace: float = Field(
        0.97, ge=0, le=1, description="With `sync.link_mbit` set, the all-reduce writes at most this fraction of it (all streams together), so the uplink's queue stays short and the ACKs of what the node receives are not held behind its own data (docs/benchmarks.md, 'All-reduce on shaped links'). 0: no cap. A link_mbit above the real uplink only makes the cap loose; one below it slows the node."
    )


class FeedbackSettings(Section):
    """Error feedback: what a lossy wire did not send, owed in later rounds (`diloco_p2p.loop.error_feedback`)."""

    error_feedback: bool | None = Field(
        None, description="Keep what the lossy wire did not send (int8, int4, topk2) and add it to the next "
        "round's pseudo-gradient (checkpointed); unset = on for topk2 only."
    )
    feedback_decay: float = Field(
        1.0, ge=0, le=1, description="β of the error feedback: a node offers Δ + β·e (SparseLoCo's decaying "
        "buffer, meant with outer.momentum 0); 1 = everything unsent is owed in full. Only what a node offers "
        "changes, so nodes of a run may differ."
    )
    feedback_carry: float | None = Field(
        None, ge=0, le=1, description="γ: each round's inner steps start from θ − γ·β·e instead of θ, so the "
        "node's model keeps that share of the progress it has not sent yet and does not learn it again "
        "(the offer is then θ − θ_local + (1−γ)·β·e); 0 = every round from θ. Needs error feedback, sync.overlap "
        "none and sync.fragments 1; unset = 0.5 where those hold under topk2, else 0. Only what a node offers "
        "changes, so nodes of a run may differ."
    )


class GroupSettings(Section):
    """A round's group: how many, how long matchmaking and the all-reduce may take, a round with no group."""

    min_group_size: int = Field(2, ge=1, description="Fewest peers that make a group; fewer = the round ends alone.")
    target_group_size: int = Field(
        16, ge=1,
        description="Largest round averaged by one butterfly all-reduce; every node at a round joins one group, and "
        "a larger one averages on a grid of sub-groups of about this size (the same result, fewer messages).",
    )
    matchmaking_timeout: float = Field(
        15.0, gt=0, description="The most seconds a round's group waits for a live peer that has not joined yet; once 4 "
        "rounds are measured it waits only the swarm's usual wait plus a margin (the adaptive deadline: median + 4 "
        "deviations + 0.5 s, at least 1.5 s). A peer that missed a round is not waited for at all."
    )
    allreduce_timeout: float = Field(
        60.0, gt=0, description="The most seconds the all-reduce may take; peers silent past it are left out. Once 4 "
        "all-reduces are measured the deadline is the usual time plus a wide margin (median + 6 deviations + 2 s, at "
        "least 5 s)."
    )
    alone_policy: Literal["apply", "skip"] = Field(
        "apply",
        description="A round with no group: `apply` our own pseudo-gradient (M=1 DiLoCo), `skip` drops it.",
    )

    @model_validator(mode="after")
    def _group_bounds(self) -> GroupSettings:
        if self.target_group_size < self.min_group_size:
            raise ValueError("sync.target_group_size must be >= sync.min_group_size")
        return self


class RobustSettings(Section):
    """How reducers bound and combine the contributions to a part (`diloco_p2p.swarm.collective.aggregate`)."""

    aggregation: Literal["mean", "trimmed_mean", "centered_clip", "radial"] = Field(
        "mean", description="How a reducer combines the contributions to its part: `mean` (token-weighted), `trimmed_mean` (per coordinate, drop the `trim_fraction` of values farthest from the median: Xie et al. 2018's mean around the median) or `centered_clip` (Karimireddy et al. 2021, around the coordinatewise median); the robust rules count members, not tokens. `radial`: the token-weighted mean of the contributions' directions at the weighted mean of their norms (Decoupled DiLoCo's radial-directional averaging), which does not shrink as M grows."
    )
    trim_fraction: float = Field(
        0.25, ge=0, lt=0.5, description="`trimmed_mean`: fraction of the contributions dropped per coordinate (rounded down), those farthest from the coordinatewise median."
    )
    clip_radius: float = Field(
        1.0, gt=0, description="`centered_clip`: the clipping radius as a multiple of the lower median of the contributions' distances to the center."
    )
    max_norm_ratio: float | None = Field(
        8.0, ge=1, description="Reject a contribution whose norm (stated by its sender, checked against its data) exceeds this multiple of the lower median of the norms offered for the same part; null: no bound."
    )
    max_weight_ratio: float = Field(
        16.0, gt=1, description="Reject a weight above this multiple of the lower median of the weights offered for the same part (a peer claiming to have trained far more than the others)."
    )
    weight_cap: float | None = Field(
        4.0, ge=1, description="Cap each accepted weight at this multiple of the lower median of the weights offered for the same part before averaging (one peer carries at most this many members' say); null: weights as claimed."
    )
    opposed_cosine: float | None = Field(
        0.0, gt=-1, lt=1, description="A reducer leaves out of its part a contribution whose cosine with the other contributions' mean direction is below this (a sign-flipped pseudo-gradient), the lowest first, while the part has at least 3; the sender is named (`opposed`), and counted when most parts name it, but not kept out of later groups (the rule and its measured margins: docs/protocol/allreduce.md); null: no direction check."
    )
    min_part_ratio: float | None = Field(
        0.5, gt=0, lt=1, description="Every member drops a part whose average is smaller, relative to its contributors' norms, than this fraction of the round's other parts (a reducer that shrank its part) and names its reducer (the rule and its measured margins: docs/protocol/allreduce.md); null: no check."
    )


class StateSettings(Section):
    """Joining and resyncing: whose state to adopt, how it is fetched, who may take part at all."""

    resync_quorum: int = Field(
        2, ge=1,
        description="Distinct peers that must report a (round, θ hash) before a node adopts it by resync or join; "
        "while some state has this many, records of states with fewer move nobody (a lone record claiming a later "
        "round is ignored while two honest nodes agree); with none, every record counts (a swarm of one).",
    )
    state_timeout: float = Field(
        3600.0, gt=0, description="Seconds a resync or join may spend downloading the swarm's state (θ and momentum: 8 bytes per parameter); a donor silent for 10 s is left for the next one well before this."
    )
    state_donors: int = Field(
        4, ge=1, description="Donors a resync or join streams the state from at once, in verified stripes (docs/architecture.md, 'Joining'); 1: one donor at a time."
    )
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="Who may take part in the run (open or closed)."
    )


class OverlapSettings(Section):
    """Hiding the all-reduce behind compute, and averaging a part of θ a round (`diloco_p2p.loop.overlap`)."""

    overlap: Literal[OVERLAP_NAMES] = Field(
        "none",
        description="Hide the all-reduce behind compute: `none` blocks on it each round; `delayed` and `eager` "
        "average round t's pseudo-gradient during round t+1's inner steps and apply it at the end of round t+1, "
        "`eager` with the local correction of the Eager Updates paper (arXiv:2502.12996); `inner` applies it "
        "after the first `sync.overlap_steps` inner steps of round t+1 and merges it into the weights being "
        "trained (Streaming DiLoCo's inner-step overlap). Every node of a run must use the same.",
    )
    overlap_steps: int = Field(
        0, ge=0,
        description="Under sync.overlap=inner: τ, the inner steps of round t+1 that round t's all-reduce runs "
        "behind (τ · step time >= the all-reduce's time hides it: `diloco-p2p plan`); 0 = as soon as the "
        "average is known, at the latest after H-1 steps. May differ between nodes.",
    )
    overlap_mix: float = Field(
        0.75, ge=0.0, le=1.0,
        description="Under sync.overlap=inner: α, the share of the weights trained meanwhile kept when round t's "
        "outer step lands (θ_local <- α·θ_local + (1-α)·θ; 0 drops the τ steps). May differ between nodes.",
    )
    overlap_merge: Literal["mix", "rebase"] = Field(
        "mix",
        description="Under sync.overlap=inner: how round t's outer step enters the weights trained meanwhile: `mix` "
        "takes the new θ in part (sync.overlap_mix); `rebase` moves the τ steps' progress onto it (θ_local <- θ + "
        "θ_local - where round t ended: nothing of them is dropped, their gradients are τ steps stale; best at small "
        "τ, as with sync.fragments; keeps a copy of the values averaged). May differ between nodes.",
    )
    fragments: int = Field(
        1, ge=1,
        description="Streaming DiLoCo's fragments (arXiv:2501.18512): the parameters are cut into this many "
        "contiguous parts and round r averages only part (r-1) mod P, so each round sends 1/P of the bytes and "
        "each part syncs every P rounds (set outer.inner_steps to H/P for a part to see H steps); the weights "
        "being trained are never reset to θ. 1: every round averages everything. With sync.overlap none or "
        "inner; on N local ranks each rank averages its shard's values of the part. Every node of a run must use "
        "the same.",
    )

    @property
    def overlap_mode(self) -> OverlapMode:
        """`sync.overlap`'s declaration (`diloco_p2p.config.overlap_modes`)."""
        return MODES[self.overlap]


# pydantic lists the fields of the last base first: the reference (docs/config.md) reads wire ... overlap.
class SyncConfig(OverlapSettings, StateSettings, RobustSettings, GroupSettings, FeedbackSettings, WireSettings):
    """`sync`: one flat section (the keys users write), its fields declared by concern in the bases
    above, so a component may take the one concern it reads (e.g. `RobustSettings`); the checks and
    properties that span concerns are here."""

    @property
    def feedback_on(self) -> bool:
        """Whether error feedback runs (`diloco_p2p.loop.error_feedback`): a lossy wire, and unset = topk2 only."""
        on = self.compression == "topk2" if self.error_feedback is None else self.error_feedback
        return on and CODECS[self.compression].feedback

    @model_validator(mode="after")
    def _concerns_fit(self) -> SyncConfig:
        if CODECS[self.compression].sparse and self.aggregation != "mean":  # each member reduces (`allgather`)
            raise ValueError(f"sync.compression {self.compression} averages by all-gather with the mean only; set "
                             "sync.aggregation=mean")
        if self.average_moments and not (self._starts_from_theta and not CODECS[self.compression].sparse):
            why = (f"sync.compression={self.compression} (sparse)" if CODECS[self.compression].sparse else
                   f"sync.overlap={self.overlap} and sync.fragments={self.fragments}")
            raise ValueError(f"sync.average_moments averages the round just committed, blocking and dense, not with "
                             f"{why}; set sync.average_moments=false, or sync.overlap=none, sync.fragments=1 "
                             "and a dense compression")
        if self.feedback_carry and not self.feedback_on:
            raise ValueError("sync.feedback_carry carries the error feedback's residual: it needs sync.compression "
                             "topk2 (or int8/int4 with sync.error_feedback=true); set sync.feedback_carry=0")
        if self.feedback_carry and not self._starts_from_theta:
            raise ValueError("sync.feedback_carry > 0 runs with sync.overlap=none and sync.fragments=1 (their rounds "
                             "start from weights of their own); set sync.feedback_carry=0")
        return self

    @property
    def _starts_from_theta(self) -> bool:
        return self.overlap_mode.blocking and self.fragments == 1

    @property
    def carry(self) -> float:
        """γ in force (`sync.feedback_carry`): as set, or unset 0.5 under topk2 with error feedback
        where rounds start from θ (`benchmarks/wire/results/compression_topk_carry.txt`), else 0."""
        if self.feedback_carry is not None:
            return self.feedback_carry
        return 0.5 if self.compression == "topk2" and self.feedback_on and self._starts_from_theta else 0.0
