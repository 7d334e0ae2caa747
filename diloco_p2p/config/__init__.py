"""The configuration tree: one pydantic v2 model per component, loaded from YAML or TOML.

Precedence is defaults < file < ``--set a.b=value`` overrides. Every model forbids unknown
keys so a typo fails loudly, and every field carries a description: the config
reference (docs/config.md) is generated from these descriptions (``tests/unit/test_readme.py`` keeps it in
sync). Each component receives only its own sub-config. The module is long (~530 lines) because
those descriptions are the user's reference; the checks that span sections are at the end.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from diloco_p2p.errors import UserError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelConfig(_Section):
    preset: Literal["tiny", "small", "35m", "150m", "1b"] = Field(
        "tiny", description="Llama-architecture size preset; the fields below override it."
    )
    pretrained_path: str | None = Field(
        None, description="Local directory with a transformers model (`from_pretrained`); replaces the preset."
    )
    tokenizer_path: str | None = Field(
        None, description="Local tokenizer directory; unset = the built-in byte-level tokenizer (no download)."
    )
    hidden_size: int | None = Field(None, gt=0, description="Override the preset's hidden size.")
    intermediate_size: int | None = Field(None, gt=0, description="Override the preset's MLP width.")
    num_hidden_layers: int | None = Field(None, gt=0, description="Override the preset's number of blocks.")
    num_attention_heads: int | None = Field(None, gt=0, description="Override the preset's attention heads.")
    num_key_value_heads: int | None = Field(None, gt=0, description="Override the preset's key/value heads.")
    max_position_embeddings: int | None = Field(None, gt=0, description="Override the preset's context size.")
    extra: dict[str, Any] = Field(
        default_factory=dict, description="More `LlamaConfig` fields of the built-in Llama: rope_theta, rms_norm_eps, "
        "initializer_range, tie_word_embeddings (any other architecture: model.pretrained_path)."
    )


SWARM_PREFIX = "swarm:"  # data.path=swarm:<dataset id>: fetch that prepared corpus from the swarm


class DataConfig(_Section):
    path: str | None = Field(
        None,
        description="A corpus prepared by `diloco-p2p prepare` (a directory with manifest.json, memory-mapped), or "
        "a text file, a directory, a JSONL or Parquet file (prepared once into the run directory); "
        "swarm:<dataset id> = a prepared corpus fetched from the swarm's peers as training needs it; "
        "unset = the embedded default corpus (the Python standard library's sources).",
    )
    eval_fraction: float = Field(
        0.02, gt=0, lt=0.5, description="Share of the corpus held out for evaluation; the same split on every node."
    )
    order_key: str | None = Field(
        None,
        description="Key that fixes this node's training order; unset = the node's identity, so nodes see "
        "different data without coordinating.",
    )
    max_bytes: int | None = Field(
        None, gt=0, description="Read at most this many bytes of the corpus (quick experiments)."
    )
    dataset_id: str | None = Field(
        None,
        description="Id of a prepared corpus (its manifest's hash), filled from `data.path`'s manifest.json; every "
        "node of a run must have the same one. Set it to pin a run to one dataset; with no data.path, the node "
        "fetches that corpus from the swarm's peers (as with data.path=swarm:<id>).",
        pattern=r"^[0-9a-f]{64}$",
    )
    cache_bytes: int | None = Field(
        None, gt=0, description="Disk kept for the shards of a corpus fetched from the swarm; past it, shards the "
        "node has finished with are deleted. Unset = keep every shard.",
    )
    serve: bool = Field(True, description="Serve the shards of the prepared corpus this node holds to its peers.")
    fetch_timeout: float = Field(
        60.0, gt=0, description="Seconds to find a peer serving the corpus's manifest or a shard, and fetch it.",
    )
    prefetch_shards: int = Field(
        2, ge=1, description="Shards of a corpus from the swarm fetched ahead of the node's data position.",
    )

    @model_validator(mode="before")
    @classmethod
    def _dataset_id_from_manifest(cls, data: Any) -> Any:
        """A prepared `path` names its dataset: its id joins the fields the swarm agrees on."""
        if isinstance(data, dict) and str(data.get("path") or "").startswith(SWARM_PREFIX):
            dataset = str(data["path"])[len(SWARM_PREFIX):]
            if data.get("dataset_id") not in (None, dataset):
                raise ValueError(f"data.path names dataset {dataset} but data.dataset_id is {data['dataset_id']}")
            return {**data, "path": None, "dataset_id": dataset}
        if isinstance(data, dict) and data.get("path") and not data.get("dataset_id"):
            try:
                manifest = json.loads((Path(data["path"]) / "manifest.json").read_text())
                data = {**data, "dataset_id": str(manifest["id"])}
            except (OSError, ValueError, KeyError, TypeError):
                pass  # not a prepared corpus (or a damaged one: opening it says so)
        return data


class InnerConfig(_Section):
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


class OuterConfig(_Section):
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
        "outer.lr, outer.momentum, the outer warmup) from outer.nodes and train.max_rounds, by the table that "
        "benchmarks/quality.py measured (`diloco_p2p.config.recipe`); `manual` uses the fields as given.",
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


class TrainConfig(_Section):
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
        "it compiles; see `benchmarks/gpu_inner.py` for what it gains).",
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


class AdmissionConfig(_Section):
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


class SyncConfig(_Section):
    compression: Literal["fp32", "fp16", "int8", "int4", "topk2"] = Field(
        "fp16", description="Wire format of pseudo-gradients in the all-reduce (accumulation is fp32): fp32, fp16, "
        "int8 or int4 (blockwise absmax) through the butterfly, or topk2 (top-k values per 65,536-value block, 2 bits each) "
        "through a sparse all-gather (for small groups)."
    )
    topk_density: float = Field(
        0.03, gt=0, le=1, description="Fraction of the values each block keeps under compression topk2 (0.03: 59x "
        "fewer bytes than fp16 in a pair, 39x in a group of 3)."
    )
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
    link_mbit: float | None = Field(
        None, gt=0, description="This node's uplink in Mbit/s, if known: the all-reduce then writes at `sync.pace` of it, and each round record carries `wire_ratio`, the all-reduce's seconds over the time its bytes take at this rate (1.0 = line rate). Unset: no ratio."
    )
    pace: float = Field(
        0.97, ge=0, le=1, description="With `sync.link_mbit` set, the all-reduce writes at most this fraction of it (all streams together), so the uplink's queue stays short and the ACKs of what the node receives are not held behind its own data (docs/benchmarks.md, 'All-reduce on shaped links'). 0: no cap. A link_mbit above the real uplink only makes the cap loose; one below it slows the node."
    )
    state_timeout: float = Field(
        3600.0, gt=0, description="Seconds a resync or join may spend downloading the swarm's state (θ and momentum: 8 bytes per parameter); a donor silent for 10 s is left for the next one well before this."
    )
    state_donors: int = Field(
        4, ge=1, description="Donors a resync or join streams the state from at once, in verified stripes (docs/architecture.md, 'Joining'); 1: one donor at a time."
    )
    max_weight_ratio: float = Field(
        16.0, gt=1, description="Reject a weight above this multiple of the lower median of the weights offered for the same part (a peer claiming to have trained far more than the others)."
    )
    weight_cap: float | None = Field(
        4.0, ge=1, description="Cap each accepted weight at this multiple of the lower median of the weights offered for the same part before averaging (one peer carries at most this many members' say); null: weights as claimed."
    )
    aggregation: Literal["mean", "trimmed_mean", "centered_clip"] = Field(
        "mean", description="How a reducer combines the contributions to its part: `mean` (token-weighted), `trimmed_mean` (per coordinate, drop the `trim_fraction` of values farthest from the median: Xie et al. 2018's mean around the median) or `centered_clip` (Karimireddy et al. 2021, around the coordinatewise median); the robust rules count members, not tokens."
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
    alone_policy: Literal["apply", "skip"] = Field(
        "apply",
        description="A round with no group: `apply` our own pseudo-gradient (M=1 DiLoCo), `skip` drops it.",
    )
    resync_quorum: int = Field(
        2, ge=1,
        description="Distinct peers that must report a (round, θ hash) before a node adopts it by resync or join; "
        "while some state has this many, records of states with fewer move nobody (a lone record claiming a later "
        "round is ignored while two honest nodes agree); with none, every record counts (a swarm of one).",
    )
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="Who may take part in the run (open or closed)."
    )
    overlap: Literal["none", "delayed", "eager", "inner"] = Field(
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
    def feedback_on(self) -> bool:
        """Whether error feedback runs (`diloco_p2p.loop.error_feedback`): a lossy wire, and unset = topk2 only."""
        on = self.compression == "topk2" if self.error_feedback is None else self.error_feedback
        return on and self.compression in ("int8", "int4", "topk2")

    @model_validator(mode="after")
    def _group_bounds(self) -> SyncConfig:
        if self.target_group_size < self.min_group_size:
            raise ValueError("sync.target_group_size must be >= sync.min_group_size")
        if self.compression == "topk2" and self.aggregation != "mean":  # every member reduces by itself (`allgather`)
            raise ValueError("sync.compression topk2 averages by all-gather with the mean only; set sync.aggregation=mean")
        if self.feedback_carry and not self.feedback_on:
            raise ValueError("sync.feedback_carry carries the error feedback's residual: it needs sync.compression "
                             "topk2 (or int8/int4 with sync.error_feedback=true); set sync.feedback_carry=0")
        if self.feedback_carry and not self._starts_from_theta:
            raise ValueError("sync.feedback_carry > 0 runs with sync.overlap=none and sync.fragments=1 (their rounds "
                             "start from weights of their own); set sync.feedback_carry=0")
        return self

    @property
    def _starts_from_theta(self) -> bool:
        return self.overlap == "none" and self.fragments == 1

    @property
    def carry(self) -> float:
        """γ in force (`sync.feedback_carry`): as set, or unset 0.5 under topk2 with error feedback
        where rounds start from θ (`benchmarks/results/compression_topk_carry.txt`), else 0."""
        if self.feedback_carry is not None:
            return self.feedback_carry
        return 0.5 if self.compression == "topk2" and self.feedback_on and self._starts_from_theta else 0.0


class P2PConfig(_Section):
    initial_peers: list[str] = Field(
        default_factory=list, description="Multiaddrs of DHT peers to join (e.g. a seed); empty = train solo."
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"], description="Multiaddrs this node listens on."
    )
    announce_maddrs: list[str] = Field(
        default_factory=list, description="Multiaddrs other peers should dial (public address behind NAT)."
    )
    identity_path: str | None = Field(
        None, description="Private key file fixing the peer id; unset = `<run-dir>/identity.key`."
    )
    connect_timeout: float = Field(
        20.0, gt=0, description="Seconds to wait for the initial peers before giving up with an error."
    )
    reachability: Literal["auto", "public", "private"] = Field(
        "auto", description="Whether other peers can dial this node: `auto` asks an initial peer to dial it back "
        "at start; `private` (behind NAT, nothing inbound) averages through public peers and reduces no part.",
    )


class MetricsConfig(_Section):
    host: str = Field("127.0.0.1", description="Address the Prometheus endpoint binds to.")
    port: int = Field(
        0, ge=-1, lt=65536,
        description="Prometheus endpoint port (0 = off; -1 = any free port, written to `<run-dir>/metrics_port`).",
    )


class LogConfig(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    json_format: bool = Field(False, description="One JSON object per log line, for log shippers.")


class Config(_Section):
    run_id: str = Field(
        "diloco", min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description="Names the run; namespaces every DHT key."
    )
    seed: int = Field(0, description="Fixes the initial parameters; must be equal on every node of a run.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The language model.")
    data: DataConfig = Field(default_factory=DataConfig, description="The training corpus.")
    inner: InnerConfig = Field(default_factory=InnerConfig, description="The inner AdamW steps.")
    outer: OuterConfig = Field(default_factory=OuterConfig, description="The DiLoCo outer step.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The training loop.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Averaging with the swarm.")
    p2p: P2PConfig = Field(default_factory=P2PConfig, description="The DHT and libp2p transport.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="The Prometheus endpoint.")
    log: LogConfig = Field(default_factory=LogConfig, description="Logging.")

    # Fields that must be equal on every node of a swarm: they fix the parameters' shapes and
    # values, the outer trajectory and the wire format. Everything else (batch size, data path,
    # ports) may differ between volunteers.
    # A prepared corpus's `data.dataset_id` too (absent when unset: a plain-text or default
    # corpus may differ between volunteers, and older checkpoints stay resumable).
    SWARM_FIELDS: ClassVar[tuple[str, ...]] = (
        "run_id", "seed", "model", "outer", "sync.compression", "inner.seq_len", "data.dataset_id",
        "sync.topk_density",  # only under compression topk2: other runs keep their hash
        "sync.overlap",  # absent when none: older runs keep their hash
        "sync.fragments",  # fixes each round's part of the parameters; absent at 1
        "sync.target_group_size",  # fixes the all-reduce's grid (`swarm.collective.hierarchy`); absent at 16, the default
        # How reducers aggregate and bound contributions (`swarm.collective.aggregate`); absent at the defaults.
        "sync.aggregation", "sync.trim_fraction", "sync.clip_radius", "sync.max_norm_ratio", "sync.weight_cap",
        "sync.max_weight_ratio",
    )
    _VIEW_DEFAULTS: ClassVar[dict[str, Any]] = {
        "sync.aggregation": "mean", "sync.trim_fraction": 0.25, "sync.clip_radius": 1.0, "sync.max_norm_ratio": 8.0,
        "sync.weight_cap": 4.0, "sync.max_weight_ratio": 16.0,
        # The outer schedules (`diloco_p2p.config.schedule`): absent while off, so runs from before keep their hash.
        "outer.h_schedule": "constant", "outer.h_start": 1, "outer.warmup_rounds": 0, "outer.lr_start": None,
    }
    # outer.recipe and outer.nodes only choose the fields above: the values they chose are hashed.
    _VIEW_INPUTS: ClassVar[tuple[str, ...]] = ("outer.recipe", "outer.nodes")

    @model_validator(mode="after")
    def _overlap_fits(self) -> Config:
        # The eager correction runs the outer step on its own input (diloco_p2p.loop.overlap): a plain
        # (Nesterov) momentum step, and H known when the round in flight is averaged.
        if self.sync.overlap != "none" and self.outer.delayed_nesterov:
            raise ValueError("sync.overlap needs outer.delayed_nesterov unset (the overlapped step is plain Nesterov)")
        if self.sync.overlap != "none" and self.outer.dynamic_local_updates:
            raise ValueError("sync.overlap and outer.dynamic_local_updates cannot be combined")
        if self.sync.overlap == "inner" and max(self.sync.overlap_steps, 1) >= self.outer.inner_steps:
            raise ValueError(f"sync.overlap=inner needs sync.overlap_steps ({self.sync.overlap_steps}) below "
                             f"outer.inner_steps ({self.outer.inner_steps}) and H >= 2: the average lands inside "
                             "the next round")
        if self.sync.fragments > 1 and self.sync.overlap not in ("none", "inner"):
            raise ValueError(f"sync.fragments={self.sync.fragments} runs with sync.overlap none or inner, not "
                             f"{self.sync.overlap}")
        if self.sync.fragments > 1 and self.outer.delayed_nesterov:
            raise ValueError("sync.fragments > 1 needs outer.delayed_nesterov unset (each part takes its own step)")
        if self.outer.scheduled and (self.sync.overlap != "none" or self.sync.fragments > 1 or self.outer.delayed_nesterov
                                     or self.outer.dynamic_local_updates):
            raise ValueError("outer.h_schedule and outer.warmup_rounds run with sync.overlap=none, sync.fragments=1, "
                             "outer.delayed_nesterov unset and outer.dynamic_local_updates=false; set "
                             "outer.h_schedule=constant and outer.warmup_rounds=0")
        return self

    @model_validator(mode="before")
    @classmethod
    def _recipe(cls, data: Any) -> Any:
        """outer.recipe=auto: the outer fields the config leaves unset, from `diloco_p2p.config.recipe`."""
        outer = data.get("outer") if isinstance(data, dict) else None
        if isinstance(outer, dict) and outer.get("recipe") == "auto":
            from diloco_p2p.config.recipe import recipe

            train = data.get("train") if isinstance(data.get("train"), dict) else {}
            sync = data.get("sync") if isinstance(data.get("sync"), dict) else {}
            fields = OuterConfig.model_fields
            try:
                schedules = (sync.get("overlap", "none") == "none" and int(sync.get("fragments", 1)) == 1
                             and not outer.get("delayed_nesterov") and not outer.get("dynamic_local_updates"))
                chosen = recipe(int(outer.get("nodes", fields["nodes"].default)),
                                int(train.get("max_rounds", TrainConfig.model_fields["max_rounds"].default)),
                                int(outer.get("inner_steps", fields["inner_steps"].default)), schedules)
            except (TypeError, ValueError):
                return data  # a malformed input: the field's own check names it
            data = {**data, "outer": {**chosen, **outer}}
        return data

    def swarm_view(self) -> dict[str, Any]:
        """The flattened fields that must agree across the swarm, by dotted path."""
        flat = _flatten(self.model_dump(mode="json"))
        return {k: v for k, v in flat.items() if any(k == f or k.startswith(f + ".") for f in self.SWARM_FIELDS)
                and not (k == "data.dataset_id" and v is None) and not (k == "sync.overlap" and v == "none")
                and not (k == "sync.target_group_size" and v == 16) and not (k == "sync.fragments" and v == 1)
                and not (k in self._VIEW_DEFAULTS and v == self._VIEW_DEFAULTS[k]) and k not in self._VIEW_INPUTS
                and not (k == "sync.topk_density" and self.sync.compression != "topk2")}

    def swarm_hash(self) -> str:
        """sha256 over `swarm_view()`; peers with a different hash are refused."""
        blob = json.dumps(self.swarm_view(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def diff_swarm_fields(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Dotted paths whose values differ between two `swarm_view()` dicts, as 'path: ours != theirs'."""
    keys = sorted(set(ours) | set(theirs))
    return [f"{k}: {ours.get(k)!r} != {theirs.get(k)!r}" for k in keys if ours.get(k) != theirs.get(k)]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key != "extra":
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"config file {path} does not exist; pass an existing YAML or TOML file to --config")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"config file {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {_one_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of sections, not {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse one ``a.b=value``; the value is read as YAML so numbers, booleans and lists work."""
    if "=" not in item:
        raise UserError(f"--set {item!r} has no '='; write it as --set section.field=value")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise UserError(f"--set {item!r} has an empty field name; write it as --set section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_override(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"--set {'.'.join(path)}: {part} is a value, not a section")
        node = child
    node[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build the config from defaults, then the file (if any), then ``--set`` overrides.

    An invalid value is attributed to the ``--set`` argument that gave it, else to the file."""
    tree: dict[str, Any] = _read_file(Path(path)) if path else {}
    sources: dict[tuple[str, ...], str] = {}
    for item in overrides:
        keys, value = parse_override(item)
        apply_override(tree, keys, value)
        sources[tuple(keys)] = f"--set {item}"
    return validate_config(tree, source=str(path) if path else "config", sources=sources)


def validate_config(tree: dict[str, Any], source: str = "config",
                    sources: dict[tuple[str, ...], str] | None = None) -> Config:
    """`Config` from a tree, or `UserError` naming the field and where its value came from:
    `source`, unless `sources` (a field path -> the argument that set it) covers the field."""
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(str(p) for p in err["loc"])
        where = ".".join(loc) or "(top level)"
        source = _source_of(loc, sources or {}, source)
        if err["type"] == "extra_forbidden":
            raise UserError(
                f"{source}: unknown field {where!r}; check the spelling against the config reference in docs/config.md"
            ) from None
        raise UserError(f"{source}: field {where!r}: {err['msg']} (got {err.get('input')!r})") from None


def _source_of(loc: tuple[str, ...], sources: dict[tuple[str, ...], str], default: str) -> str:
    """The last ``--set`` that gave the field at `loc`, a value inside it, or the section holding it
    (a cross-field check fails on the section); else `default`."""
    hits = [arg for keys, arg in sources.items() if keys[:len(loc)] == loc or loc[:len(keys)] == keys]
    return hits[-1] if hits else default


def save_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def config_reference() -> str:
    """The config reference of docs/config.md, generated from the models so it cannot drift."""
    lines = ["| field | default | description |", "| --- | --- | --- |"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            ann = info.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = info.default_factory() if info.default_factory else info.default
            shown = json.dumps(default) if default is not None else "unset"
            lines.append(f"| `{prefix}{name}` | `{shown}` | {info.description} |")

    walk(Config, "")
    return "\n".join(lines)
