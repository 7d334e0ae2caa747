"""A round planner: what one DiLoCo round costs a swarm of N nodes, before anyone runs it.

`diloco-p2p plan` prints, for N = 4 .. 1,024, the round's seconds, compute utilization, bytes per
node and the bottleneck: pure functions of the inputs and of constants fitted on real swarms over
shaped links (`Calibration`, checked by `benchmarks/planner/plan_check.py` on held-out rates).
Bytes are counted frame by frame from `wire`; time adds the slowest link's wire time, the last
reducer's tail, stream setup, CPU and round trips (`time_terms`); a round adds the slowest
node's inner steps, matchmaking, what overlap leaves exposed, and the cost of failures.
The model and its calibration: docs/architecture.md, "The planner's model".
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Any, ClassVar

from pydantic import BaseModel

from diloco_p2p.config import Config, OuterConfig, SyncConfig, overlap_modes
from diloco_p2p.config.compression import NAMES as CODEC_NAMES
from diloco_p2p.config.compression import codec
from diloco_p2p.swarm.collective import wire
from diloco_p2p.swarm.transport import streams

SCHEMES = ("auto", "butterfly", "grid", "sparse")
COMPRESSIONS = CODEC_NAMES  # declared once, with their sizes (`diloco_p2p.config.compression`)
OVERLAPS = overlap_modes.NAMES  # declared once, with the compute each hides behind
DEFAULT_NODES = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
_PREFIX = streams.LENGTH_PREFIX
_GROUP_ID = "0" * 64  # a group id is a sha256 hex digest (matchmaking)
MEMBER_LIST_BYTES = 190  # per member in the list the matchmaking leader sends to each member


@dataclass(frozen=True)
class Calibration:
    """Constants fitted on real swarms (`benchmarks/planner/plan_check.py --calibrate`, tbf links): the
    weights of `time_terms`, forming a group per member, noticing a dead member (`detect_s`), the outer
    step (`apply_s`). How each was fitted: docs/architecture.md, "The planner's model"."""

    flow_overhead: float = 1.0353
    flow_tail: float = 0.03175
    cpu_s_per_byte: float = 0.0
    setup_s: float = 0.001936
    per_message_s: float = 0.01804
    rtts: float = 4.0  # not measured: the test network has no delay
    matchmaking_per_member_s: float = 0.03259
    detect_s: float = 1.0
    apply_s: float = 0.0
    source: str = ("fitted by benchmarks/planner/plan_check.py calibrate (2-8 peers, 2,000,000 values, unshaped and 20+50 Mbit "
                   "tbf links, load average 0.6-1.5 on 2 cores; matchmaking: 2-node training rounds)")

@dataclass(frozen=True)
class Links:
    """Per-node link rates in Mbit/s: one rate for every node, or log-uniform over [lo, hi]."""

    lo: float
    hi: float

    def slowest(self, n: int) -> float:
        """The expected slowest of n nodes' rates (Blom's plotting position of the minimum)."""
        if self.lo == self.hi:
            return self.lo
        q = 0.625 / (n + 0.25)  # (1 - 0.375) / (n + 0.25): the first order statistic's position
        return math.exp(math.log(self.lo) + q * (math.log(self.hi) - math.log(self.lo)))


def _default(section: type[BaseModel], name: str) -> Any:
    """A config field's default: the planner's settings default to what a node would run."""
    return section.model_fields[name].default


@dataclass(frozen=True)
class Inputs:
    """What a round costs depends on: the model and the machines (params, step seconds, links,
    ...), which no config holds and which are checked here, and the swarm's settings, which the
    config holds, defaults and checks (`from_config`; `diloco-p2p plan` builds one from a config
    and its flags). Settings given here directly are taken as the config would have them."""

    params: int
    step_seconds: float
    inner_steps: int = _default(OuterConfig, "inner_steps")
    uplink: Links = Links(100.0, 100.0)
    downlink: Links = Links(100.0, 100.0)
    rtt_ms: float = 50.0
    fail_rate: float = 0.0
    step_spread: float = 0.0  # coefficient of variation of per-node compute speed
    dylu: bool = _default(OuterConfig, "dynamic_local_updates")  # slow nodes do fewer steps, nobody waits
    scheme: str = "auto"
    group: int = _default(SyncConfig, "target_group_size")  # butterfly size; a grid's row size
    compression: str = _default(SyncConfig, "compression")
    density: float = _default(SyncConfig, "topk_density")  # top-k
    overlap: str = _default(SyncConfig, "overlap")
    overlap_steps: int = _default(SyncConfig, "overlap_steps")  # overlap=inner: τ; 0: as soon as known
    fragments: int = _default(SyncConfig, "fragments")  # a round averages 1/P of the parameters
    moments: bool = _default(SyncConfig, "average_moments")  # a second all-reduce, of as many values
    chunk: int = wire.DEFAULT_CHUNK_ELEMENTS
    oversubscribe: float = 1.0  # CPU contention: how many times longer CPU work takes than on a dedicated box (1)

    MACHINE: ClassVar[tuple[str, ...]] = ("params", "step_seconds", "uplink", "downlink", "rtt_ms", "fail_rate",
                                          "step_spread", "chunk", "oversubscribe")

    @classmethod
    def from_config(cls, cfg: Config, *, scheme: str = "auto", **machine: Any) -> Inputs:
        """The round of a swarm running `cfg` on the model and machines `machine` describes
        (`MACHINE`'s fields; params and step_seconds at least)."""
        s = cfg.sync
        return cls(inner_steps=cfg.outer.inner_steps, dylu=cfg.outer.dynamic_local_updates, scheme=scheme,
                   group=s.target_group_size, compression=s.compression, density=s.topk_density,
                   overlap=s.overlap, overlap_steps=s.overlap_steps, fragments=s.fragments,
                   moments=s.average_moments, **machine)

    def machine(self) -> dict[str, Any]:
        """The fields no config holds, for `from_config`."""
        return {name: getattr(self, name) for name in self.MACHINE}

    def __post_init__(self):
        problems = [
            (self.params >= 1, f"params must be at least 1, got {self.params}"),
            (self.step_seconds > 0, f"step seconds must be > 0, got {self.step_seconds}"),
            (self.rtt_ms >= 0, f"rtt must be >= 0 ms, got {self.rtt_ms}"),
            (0 <= self.fail_rate < 1, f"failure rate must be in [0, 1), got {self.fail_rate}"),
            (self.step_spread >= 0, f"step spread must be >= 0, got {self.step_spread}"),
            (self.scheme in SCHEMES, f"scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}"),
            (self.fragments <= self.params, f"sync.fragments ({self.fragments}) must be at most the parameters"),
            (0 < self.chunk <= wire.MAX_CHUNK_ELEMENTS, f"chunk must be in 1..{wire.MAX_CHUNK_ELEMENTS}"),
            (self.scheme != "sparse" or codec(self.compression).sparse,
             "the sparse all-gather needs a sparse compression (topk2)"),
        ]
        for links in (self.uplink, self.downlink):
            problems.append((0 < links.lo <= links.hi, f"link rates must be > 0 Mbit/s and lo <= hi, got {links}"))
        for ok, message in problems:
            if not ok:
                raise ValueError(message)


# ----------------------------------------------------------------------------- bytes


def payload_size(numel: int, compression: str, density: float = 1.0) -> int:
    """Bytes of `numel` values in one frame of the given compression: its declared size, which is
    what the wire writes (`diloco_p2p.config.compression`)."""
    return codec(compression).size(numel, density)


def _frames(numel: int, compression: str, chunk: int, density: float = 1.0) -> int:
    """Bytes of the data frames (length prefixes included) that carry `numel` values."""
    full, tail = divmod(numel, chunk)
    total = full * (_PREFIX + payload_size(chunk, compression, density)) if full else 0
    return total + (_PREFIX + payload_size(tail, compression, density) if tail else 0)


def header_size(kind: str, k: int, n: int, chunk: int) -> int:
    """Bytes of one message's header frame, as `allreduce` packs it (a group id of 64 hex digits)."""
    base = {"kind": kind, "group": _GROUP_ID, "digest": "0" * 16}
    fields = {"part": k - 1, "n": n, "numel": math.ceil(n / k), "chunk": chunk, "comp": "fp16"}
    if kind == "scatter":
        base.update(fields, weight=1024.0, finite=True)
    elif kind == "gather":
        base.update(fields, empty=False, stream=True, contributors=list(range(k)), rejected={})
    elif kind == "mask":
        base.update(mask=[1] * k)
    elif kind == "contrib":  # the sparse all-gather's message, and its mask with a digest per member
        base.update(n=n, chunk=chunk, comp="topk2", density=0.01, weight=1024.0, finite=True)
    elif kind == "digest-mask":
        base.update(kind="mask", mask=[1] * k, contrib_digests=["0" * 32] * k)
    return _PREFIX + len(wire.pack_header(base))


@functools.lru_cache(maxsize=4096)  # pure; `recommend` asks for the same counts under many H and overlaps
def butterfly_bytes(n: int, k: int, compression: str, chunk: int = wire.DEFAULT_CHUNK_ELEMENTS,
                    member: int | None = None, density: float = 1.0) -> int:
    """Bytes `member` (default: the mean over members) sends in one butterfly: the scatter, its
    gathered part with its trailer, the masks. Top-k gathers the union of k supports, at most fp16."""
    if k < 2:
        return 0
    parts = [b - a for a, b in wire.partition(n, k)]
    gathered = 1 - (1 - density) ** k

    def gather_frames(numel: int) -> int:
        frames = _frames(numel, compression, chunk, gathered)
        return min(frames, _frames(numel, "fp16", chunk)) if codec(compression).sparse else frames

    headers = (k - 1) * sum(header_size(kind, k, n, chunk) for kind in ("scatter", "gather", "mask"))
    scatter = {m: _frames(m, compression, chunk, density) for m in set(parts)}
    gather = {m: gather_frames(m) for m in set(parts)}
    if member is not None:
        own = parts[member]
        return headers + sum(scatter[m] for m in parts) - scatter[own] + (k - 1) * (gather[own] + _PREFIX + 1)
    # over all members: each part is scattered by k-1 members and gathered to k-1 members
    total = sum((k - 1) * (scatter[m] + gather[m] + _PREFIX + 1) for m in parts)
    return headers + round(total / k)


@functools.lru_cache(maxsize=4096)
def sparse_bytes(n: int, k: int, chunk: int, density: float) -> int:
    """Bytes one member sends in the all-gather of top-k contributions (`swarm/collective/allgather.py`): its
    own to each other member, and a mask carrying a sha256 digest per member."""
    own = header_size("contrib", k, n, chunk) + _frames(n, "topk2", chunk, density)
    return (k - 1) * (own + header_size("digest-mask", k, n, chunk))


# ----------------------------------------------------------------------------- schemes


@dataclass(frozen=True)
class Level:
    """One collective step of a scheme: `k` members exchange `sent` bytes each over `messages` streams."""

    name: str
    k: int
    sent: int
    messages: int


def grid_shape(nodes: int, group: int) -> tuple[int, int]:
    """(rows R, the largest row's size) of the hierarchical all-reduce (`swarm/collective/hierarchy.py`):
    R = ceil(N / B) rows of near-equal size (`wire.partition` of the sorted members)."""
    rows = math.ceil(nodes / group)
    return rows, math.ceil(nodes / rows)


def levels(inp: Inputs, scheme: str, nodes: int) -> list[Level]:
    """The collective steps one round runs on `nodes` members under `scheme` (a concrete one); under
    sync.average_moments the same again, for the inner first moments (as many values as Δ)."""
    once = _levels(inp, scheme, nodes)
    return once + [Level(f"{x.name} (moments)", x.k, x.sent, x.messages) for x in once] if inp.moments else once


def _levels(inp: Inputs, scheme: str, nodes: int) -> list[Level]:
    n, comp, chunk, d = -(-inp.params // inp.fragments), inp.compression, inp.chunk, inp.density  # the largest part
    if nodes < 2:
        return []
    if scheme == "butterfly" or (scheme == "grid" and nodes <= inp.group):
        return [Level("butterfly", nodes, butterfly_bytes(n, nodes, comp, chunk, density=d), 3 * (nodes - 1))]
    if scheme == "sparse":
        return [Level("all-gather", nodes, sparse_bytes(n, nodes, chunk, d), 2 * (nodes - 1))]
    rows, size = grid_shape(nodes, inp.group)
    sizes = [hi - lo for lo, hi in wire.partition(nodes, rows)]  # rows differ by at most one member
    fp32_gather = len(set(sizes)) > 1 and not codec(comp).exact_reencode  # as `hierarchy` does

    def row_bytes(s: int) -> int:
        part = math.ceil(n / s)
        out = butterfly_bytes(n, s, comp, chunk, density=d)  # the column's result is gathered in fp32 below
        return out + ((s - 1) * (_frames(part, "fp32", chunk) - _frames(part, comp, chunk, d)) if fp32_gather else 0)

    def mean(f) -> int:  # over members: a row of s members counts s times
        return round(sum(s * f(s) for s in sizes) / nodes)

    mask = size + nodes  # 0/1 per interval and per member (its contribution entered), fp32
    column = mean(lambda s: butterfly_bytes(math.ceil(n / s), rows, comp, chunk, density=d))
    return [Level("row", size, mean(row_bytes), 3 * (size - 1)),
            Level("column", rows, column, 3 * (rows - 1)),
            Level("agreement across rows", rows, butterfly_bytes(mask, rows, "fp32", chunk), 3 * (rows - 1)),
            Level("agreement in the row", size, butterfly_bytes(mask, size, "fp32", chunk), 3 * (size - 1))]


def scheme_for(inp: Inputs, nodes: int) -> str:
    """The scheme a swarm runs: top-k goes by all-gather; dense is one butterfly up to the group size, a grid beyond."""
    if inp.scheme != "auto":
        return inp.scheme
    if codec(inp.compression).sparse:
        return "sparse"
    return "butterfly" if nodes <= inp.group else "grid"


# ----------------------------------------------------------------------------- time


def _mbit_seconds(nbytes: float, mbit: float) -> float:
    return nbytes * 8 / (mbit * 1e6)


def harmonic(n: int) -> float:
    """H(n) = 1 + 1/2 + ... + 1/n: the expected maximum of n unit exponentials (0 for n = 0)."""
    return sum(1 / i for i in range(1, n + 1))


TAIL_MBIT = 100.0  # the tail term's unit rate (it grows as 1/rate: docs/architecture.md, "The planner's model")
TAIL_FLOOR_MBIT = 20.0  # the slowest calibrated rate: below it the tail stays at its value there


def time_terms(level: Level, inp: Inputs, nodes: int) -> dict[str, float]:
    """The unit terms of one level's seconds, which `Calibration` weighs (`TERMS` names its field):
    wire, tail (wire x H(k-1) x 100 Mbit/s / max(rate, `TAIL_FLOOR_MBIT`)), setup, messages x o, cpu
    bytes x o, rtt. Why each: docs/architecture.md, "The planner's model"."""
    rate = min(inp.uplink.slowest(nodes), inp.downlink.slowest(nodes))
    busy = max(inp.oversubscribe, 1.0)  # CPU work takes that much longer beside other work
    wire_s = _mbit_seconds(level.sent, rate)
    tail = wire_s * harmonic(level.k - 1) * TAIL_MBIT / max(rate, TAIL_FLOOR_MBIT)
    return {"wire": wire_s, "tail": tail, "setup": 1.0,
            "messages": level.messages * busy, "cpu": 2 * level.sent * busy, "rtt": inp.rtt_ms / 1e3}


TERMS = {"wire": "flow_overhead", "tail": "flow_tail", "setup": "setup_s", "messages": "per_message_s",
         "cpu": "cpu_s_per_byte", "rtt": "rtts"}
CAUSES = {"wire": "link", "tail": "link", "setup": "latency/messages", "messages": "latency/messages",
          "rtt": "latency/messages", "cpu": "cpu"}


def level_seconds(level: Level, inp: Inputs, nodes: int, cal: Calibration) -> dict[str, float]:
    """Seconds of one level by cause: uplink/downlink (wire time and tail), cpu, latency/messages."""
    link = "uplink" if inp.uplink.slowest(nodes) <= inp.downlink.slowest(nodes) else "downlink"
    out: dict[str, float] = {}
    for term, x in time_terms(level, inp, nodes).items():
        cause = link if CAUSES[term] == "link" else CAUSES[term]
        out[cause] = out.get(cause, 0.0) + getattr(cal, TERMS[term]) * x
    return out


def matchmaking_seconds(inp: Inputs, nodes: int, cal: Calibration) -> float:
    """Forming the round's group: per-member work, and the leader sending the member list to each member."""
    if nodes < 2:
        return 0.0
    leader = _mbit_seconds(MEMBER_LIST_BYTES * nodes * (nodes - 1), inp.uplink.slowest(nodes))
    return cal.matchmaking_per_member_s * (nodes - 1) + leader + 2 * inp.rtt_ms / 1e3


def straggler_factor(nodes: int, spread: float) -> float:
    """Expected slowest of `nodes` compute times over the mean (lognormal speeds, Blom's position)."""
    if spread <= 0 or nodes < 2:
        return 1.0
    sigma = math.sqrt(math.log(1 + spread**2))
    z = NormalDist().inv_cdf((nodes - 0.375) / (nodes + 0.25))
    return math.exp(sigma * z - sigma**2 / 2)


@dataclass
class Prediction:
    nodes: int
    scheme: str
    round_seconds: float
    utilization: float
    bytes_sent: int  # per node per round
    messages: int  # streams a node opens per round
    allreduce_seconds: float
    exposed_seconds: float
    bottleneck: str
    parts: dict[str, float] = field(default_factory=dict)  # seconds by cause
    lands_after: int = 0  # overlap=inner: the inner step of the next round the average lands after (τ)

    def as_dict(self) -> dict:
        return asdict(self)


def predict_scheme(inp: Inputs, nodes: int, scheme: str, cal: Calibration) -> Prediction:
    """One scheme's round at `nodes` nodes (the model: docs/architecture.md, "The planner's model")."""
    compute = inp.inner_steps * inp.step_seconds
    slowest = compute if inp.dylu else compute * straggler_factor(nodes, inp.step_spread)
    parts: dict[str, float] = {}
    for level in levels(inp, scheme, nodes):
        for cause, s in level_seconds(level, inp, nodes, cal).items():
            parts[cause] = parts.get(cause, 0.0) + s
    p_any = 1 - (1 - inp.fail_rate) ** nodes
    allreduce = sum(parts.values()) + p_any * cal.detect_s
    comm = allreduce + matchmaking_seconds(inp, nodes, cal)
    parts["latency/messages"] = parts.get("latency/messages", 0.0) + comm - allreduce  # matchmaking
    parts["failures"] = p_any * cal.detect_s
    parts["stragglers"] = slowest - compute
    tau, hides = 0, overlap_modes.mode(inp.overlap).hides
    if hides == "steps":  # τ = 0: the first step after the average is known, at the latest H-1
        step = slowest / inp.inner_steps
        tau = inp.overlap_steps or min(inp.inner_steps - 1, max(1, math.ceil(comm / step - 1e-9)))
    if hides != "nothing":  # behind the next round's H (delayed, eager) or τ (inner) inner steps
        hidden = slowest if hides == "round" else slowest * tau / inp.inner_steps
        exposed = max(comm - hidden, 0.0)
        scale = exposed / comm if comm > 0 else 0.0
        parts = {c: (s * scale if c not in ("stragglers",) else s) for c, s in parts.items()}
    else:
        exposed = comm
    round_s = slowest + exposed + cal.apply_s
    rejoin = _mbit_seconds(8 * inp.params, inp.downlink.slowest(nodes))  # θ and momentum, fp32
    utilization = compute / round_s * max(0.0, 1 - inp.fail_rate * (1 + rejoin / round_s))
    parts = {c: s for c, s in parts.items() if s > 0}
    bottleneck = "compute" if utilization >= 0.9 or not parts else max(parts, key=parts.__getitem__)
    lv = levels(inp, scheme, nodes)
    return Prediction(nodes, scheme, round_s, utilization, sum(x.sent for x in lv), sum(x.messages for x in lv),
                      allreduce, exposed, bottleneck, {"compute": compute, **parts}, lands_after=tau)


def predict(inp: Inputs, nodes: int, cal: Calibration | None = None) -> Prediction:
    """The round at `nodes` nodes under the scheme the swarm would run (`scheme_for`)."""
    return predict_scheme(inp, nodes, scheme_for(inp, nodes), cal or Calibration())


def sweep(inp: Inputs, nodes: tuple[int, ...] = DEFAULT_NODES, cal: Calibration | None = None) -> list[Prediction]:
    return [predict(inp, n, cal) for n in nodes]
