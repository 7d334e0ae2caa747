"""Robust aggregation of one part's contributions, and the checks members run on a reducer.

Pure functions of tensors and bytes: the all-reduce and the replica simulator
(`diloco_p2p.planner.simulate`) both reduce through `reduce_part` / `reduce_chunk`, so what a
benchmark measures in-process is what the swarm computes. A reducer bounds and caps token
weights, holds each sender to the norm it stated, and reduces by the rule of `sync.aggregation`
(`mean`, `trimmed_mean`, `centered_clip`), in fp32 in member order, leaving out a contribution that
points against the others' (`opposed`: a sign flip). Members exchange digests and norms of what
they gathered (`suspect_parts`): a part a reducer forged, scaled up or shrank is dropped on every
member and the reducer named, on evidence a minority of liars cannot make up.
The rules, their papers and measurements: docs/protocol/allreduce.md
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from diloco_p2p.config.sync import RobustSettings
from diloco_p2p.swarm.collective import wire

AGGREGATIONS = ("mean", "trimmed_mean", "centered_clip", "radial")
NORM_TOLERANCE = 1e-4  # relative: a claimed norm vs the one recomputed from the same bytes (fp64 sums)
# Relative slack of an average's norm after it is encoded once more: fp16 rounds each value within
# 2^-11; int8 per-block absmax errs by <= absmax/254 per value, <= sqrt(1024)/254 of a block's norm.
# A wire format not listed (e.g. a coarser one added later) gets the loosest slack.
NORM_SLACK = {"fp32": 1e-6, "fp16": 1e-3, "int8": 0.13}
DEFAULT_SLACK = 1.0
NO_DIRECTION = 1e-5  # `radial`: unit directions summing to under this x their total weight have cancelled


@dataclass(frozen=True)
class Robust:
    """How a reducer aggregates its part (see the module docstring); the defaults are today's mean."""

    aggregation: str = "mean"
    trim_fraction: float = 0.25
    clip_radius: float = 1.0
    max_norm_ratio: float | None = None
    weight_cap: float | None = None
    opposed_cosine: float | None = None  # `opposed`: None leaves every direction in
    min_part_ratio: float | None = None  # `small_parts`: None believes every part's scale

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if not 0 <= self.trim_fraction < 0.5 or not self.clip_radius > 0:
            raise ValueError("trim_fraction must be in [0, 0.5) and clip_radius > 0")
        for name in ("max_norm_ratio", "weight_cap"):
            value = getattr(self, name)
            if value is not None and not value >= 1:
                raise ValueError(f"{name} must be >= 1 or None")
        if self.opposed_cosine is not None and not -1 < self.opposed_cosine < 1:
            raise ValueError("opposed_cosine must be in (-1, 1) or None")
        if self.min_part_ratio is not None and not 0 < self.min_part_ratio < 1:
            raise ValueError("min_part_ratio must be in (0, 1) or None")

    @property
    def whole_part(self) -> bool:
        """Whether the rule needs every contribution complete before the first value is reduced."""
        return self.aggregation in ("centered_clip", "radial")


MEAN = Robust()


def robust_of(sync: RobustSettings) -> Robust:
    """The rule and bounds of the config's robust aggregation (``sync.aggregation``, ``trim_fraction``, ...)."""
    return Robust(sync.aggregation, sync.trim_fraction, sync.clip_radius, sync.max_norm_ratio, sync.weight_cap,
                  sync.opposed_cosine, sync.min_part_ratio)


# ----------------------------------------------------------------------------- norms


sumsq = wire.sumsq  # the sum of squares every norm here is made of


def part_sumsq(values: torch.Tensor, chunk: int) -> float:
    """Σx² of a part's values as the members sum it for the reducer check (`suspect_parts`): exactly,
    chunk by chunk in order, as the chunks land. The same float on every member, whichever way the
    part reached it (streamed, or whole)."""
    total = 0.0
    for a, b in wire.chunk_ranges(values.numel(), chunk):
        total += sumsq(values[a:b])
    return total


def encoded_norm(x: torch.Tensor, chunk: int, compression: str) -> float:
    """L2 norm of `x` as a receiver decodes it, summed chunk by chunk as the reducer checks it (inf
    if not finite), for a norm without the bytes (`wire.decoded_sumsq`)."""
    x = x.detach().reshape(-1)
    total = 0.0
    for a, b in wire.chunk_ranges(x.numel(), chunk):
        total += wire.decoded_sumsq(x[a:b], compression)
    return math.sqrt(total) if math.isfinite(total) else math.inf


def norm_matches(claimed: float | None, sum_of_squares: float) -> bool:
    """Whether a claimed norm (None: nothing claimed) agrees with the recomputed sum of squares."""
    if claimed is None:
        return True
    actual = math.sqrt(sum_of_squares)
    return abs(claimed - actual) <= NORM_TOLERANCE * max(claimed, actual) + 1e-30


def accept_norms(norms: dict[int, float | None], max_ratio: float | None) -> tuple[list[int], list[int]]:
    """(accepted, refused for "norm") members, sorted: with a bound, a norm above `max_ratio` times
    the lower median of the norms offered is refused, and so is a contribution that stated none."""
    if max_ratio is None:
        return sorted(norms), []
    stated = [n for n in norms.values() if n is not None]
    reference = wire.lower_median(stated) if stated else 0.0
    refused = [j for j in sorted(norms) if norms[j] is None or norms[j] > max_ratio * reference]
    return [j for j in sorted(norms) if j not in refused], refused


def capped_weights(weights: dict[int, float], cap: float | None) -> dict[int, float]:
    """Each weight capped at `cap` × the lower median of `weights` (None: as given)."""
    if cap is None or not weights:
        return dict(weights)
    ceiling = cap * wire.lower_median(list(weights.values()))
    return {j: min(w, ceiling) for j, w in weights.items()}


# ----------------------------------------------------------------------------- directions


OPPOSED_MIN = 3  # contributors a part needs before a direction can be told from its victim's


def gram(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The contributions' inner products x_i·x_j in member order: fp32 within it, fp64 out."""
    stacked = torch.stack(list(values)).float()
    return (stacked @ stacked.T).double()


def chunk_gram(contribs: Sequence[bytes], numel: int, compression: str) -> torch.Tensor:
    """`gram` of one chunk's encoded contributions, in member order, as the reducer decodes them."""
    return gram([wire.decode(data, numel, compression) for data in contribs])


def direction_scores(g: torch.Tensor, members: Sequence[int]) -> dict[int, float]:
    """Each member's cosine with the sum of the others' unit vectors (weights and norms steer
    nothing), that sum counted at least as long as orthogonal ones' (docs/protocol/allreduce.md)."""
    idx = list(members)
    sub = g[idx][:, idx]
    scale = sub.diagonal().clamp_min(0).sqrt()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    c = torch.where((scale[:, None] > 0) & (scale[None, :] > 0), sub / safe[:, None] / safe[None, :], 0)
    scores = {}
    for a, i in enumerate(idx):
        others = [b for b in range(len(idx)) if b != a]
        dot = float(c[a, others].sum())
        ref = max(float(c[others][:, others].sum()), float(sum(bool(scale[b] > 0) for b in others)))
        scores[i] = dot / math.sqrt(ref) if scale[a] > 0 else 0.0
    return scores


def opposed(g: torch.Tensor, members: Sequence[int], threshold: float | None) -> list[int]:
    """Members left out, sorted: while `OPPOSED_MIN` remain, the lowest `direction_scores` (ties:
    lower index) if below `threshold`, then the rest scored again (a flip never takes one along)."""
    out: list[int] = []
    remaining = sorted(members)
    while threshold is not None and len(remaining) >= OPPOSED_MIN:
        scores = direction_scores(g, remaining)
        worst = min(remaining, key=lambda j: (scores[j], j))
        if not scores[worst] < threshold:
            break
        out.append(worst)
        remaining.remove(worst)
    return sorted(out)


# ----------------------------------------------------------------------------- rules


def trimmed_mean(values: Sequence[torch.Tensor], trim_fraction: float) -> torch.Tensor:
    """Coordinatewise mean of the m - b values nearest the median, b = floor(trim_fraction·m) (Xie et
    al. 2018). Ties keep the lower member index and sums run in distance order: a function of the bytes."""
    m = len(values)
    b = min(int(math.floor(trim_fraction * m)), (m - 1) // 2)
    stacked = torch.stack(list(values))
    if b == 0:
        return stacked.sum(dim=0, dtype=torch.float32) / float(m)
    ordered = stacked.sort(dim=0).values
    median = (ordered[(m - 1) // 2] + ordered[m // 2]) / 2
    nearest = (stacked - median).abs().sort(dim=0, stable=True).indices[: m - b]
    return stacked.gather(0, nearest).sum(dim=0, dtype=torch.float32) / float(m - b)


def coordinate_median(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The coordinatewise lower median (one of the values at each coordinate)."""
    ordered = torch.stack(list(values)).sort(dim=0).values
    return ordered[(len(values) - 1) // 2].clone()


def centered_clip(values: Sequence[torch.Tensor], clip_radius: float) -> torch.Tensor:
    """One step of centered clipping around the coordinatewise median (Karimireddy et al. 2021)."""
    center = coordinate_median(values)
    deviations = [v - center for v in values]
    norms = [math.sqrt(sumsq(d)) for d in deviations]
    tau = clip_radius * wire.lower_median(norms)
    out = torch.zeros_like(center)
    for d, norm in zip(deviations, norms, strict=True):
        scale = 1.0 if norm <= tau else tau / norm
        out.add_(d, alpha=scale)
    return center + out / float(len(values))


def radial(weights: Sequence[float], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The weighted mean direction at the weighted mean norm (docs/protocol/allreduce.md, `radial`)."""
    norms = [math.sqrt(sumsq(v)) for v in values]
    total = float(sum(weights))
    radius = sum(w * n for w, n in zip(weights, norms, strict=True)) / total
    direction = torch.zeros_like(values[0])
    for weight, v, norm in zip(weights, values, norms, strict=True):
        if norm > 0:
            direction.add_(v, alpha=weight / norm)
    length = math.sqrt(sumsq(direction))
    # Directions that cancel leave fp32 rounding noise (an add with alpha may fuse multiply and add):
    # scaled up to the radius it would be a full-size step in a random direction, so it is zero.
    return direction.mul_(radius / length) if length > NO_DIRECTION * total else direction.zero_()


def combine(robust: Robust, weights: Sequence[float], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The rule over decoded contributions in member-index order (weights already capped)."""
    if robust.aggregation == "radial":
        return radial(weights, values)
    if robust.aggregation == "trimmed_mean":
        return trimmed_mean(values, robust.trim_fraction)
    if robust.aggregation == "centered_clip":
        return centered_clip(values, robust.clip_radius)
    acc, total = torch.zeros_like(values[0]), 0.0
    for weight, v in zip(weights, values, strict=True):
        total += weight
        acc.add_(v, alpha=weight)
    return acc.div_(total)


def _finish(out: torch.Tensor, compression: str) -> tuple[bytes, torch.Tensor] | None:
    encoded = wire.encode(out, compression)
    values = wire.decode(encoded, out.numel(), compression)
    return (encoded, values) if wire.is_finite(values) else None


def reduce_chunk(
    robust: Robust, contribs: Sequence[tuple[float, bytes]], numel: int, compression: str
) -> tuple[bytes, torch.Tensor] | None:
    """One chunk of a coordinatewise rule: (weight, encoded chunk) in member order -> (encoded
    result, decoded values) or None when not finite. ``mean`` is `wire.reduce_chunk` exactly."""
    if robust.aggregation == "mean":
        return wire.reduce_chunk(contribs, numel, compression)
    if robust.whole_part:
        raise ValueError(f"{robust.aggregation} reduces whole parts (reduce_part), not chunks")
    values = [wire.decode(data, numel, compression) for _, data in contribs]
    return _finish(combine(robust, [w for w, _ in contribs], values), compression)


def part_gram(members: Sequence[int], chunks: dict[int, list[bytes]], ranges: Sequence[tuple[int, int]],
              compression: str) -> torch.Tensor:
    """`gram` of whole parts (rows in `members` order), summed chunk by chunk as the stream sums it."""
    g = torch.zeros(len(members), len(members), dtype=torch.float64)
    for c, (a, b) in enumerate(ranges):
        g += chunk_gram([chunks[j][c] for j in members], b - a, compression)
    return g


def reduce_part(
    robust: Robust,
    contribs: dict[int, tuple[float, list[bytes]]],
    norms: dict[int, float | None],
    max_weight_ratio: float,
    numel: int,
    chunk: int,
    compression: str,
) -> tuple[list[int], dict[int, str], list[bytes] | None, torch.Tensor | None]:
    """The part from complete contributions (member -> (weight, encoded chunks)); `norms` are the
    stated ones (already checked against the data). Returns (accepted, refused -> reason, encoded
    result chunks, decoded result); the last two None when nothing usable remains."""
    accepted, heavy = wire.accept_weights({j: w for j, (w, _) in contribs.items()}, max_weight_ratio)
    refused = {j: "weight" for j in heavy}
    accepted, far = accept_norms({j: norms.get(j) for j in accepted}, robust.max_norm_ratio)
    refused.update({j: "norm" for j in far})
    ranges = wire.chunk_ranges(numel, chunk)
    if robust.opposed_cosine is not None and len(accepted) >= OPPOSED_MIN:
        g = part_gram(accepted, {j: contribs[j][1] for j in accepted}, ranges, compression)
        flipped = opposed(g, list(range(len(accepted))), robust.opposed_cosine)
        refused.update({accepted[i]: "opposed" for i in flipped})
        accepted = [j for i, j in enumerate(accepted) if i not in flipped]
    if not accepted:
        return [], refused, None, None
    weights = capped_weights({j: contribs[j][0] for j in accepted}, robust.weight_cap)
    encoded, values = [], torch.zeros(numel, dtype=torch.float32)
    if robust.whole_part:
        whole = [torch.cat([wire.decode(d, b - a, compression) for (a, b), d in zip(ranges, contribs[j][1],
                                                                                   strict=True)])
                 for j in accepted]
        out = combine(robust, [weights[j] for j in accepted], whole) if numel else torch.zeros(0)
        pieces = [_finish(out[a:b], compression) for a, b in ranges]
    else:
        pieces = [reduce_chunk(robust, [(weights[j], contribs[j][1][c]) for j in accepted], b - a, compression)
                  for c, (a, b) in enumerate(ranges)]
    for (a, b), piece in zip(ranges, pieces, strict=True):
        if piece is None:
            return [], refused, None, None
        encoded.append(piece[0])
        values[a:b] = piece[1]
    return accepted, refused, encoded, values


# ----------------------------------------------------------------------------- checking reducers


DIGEST_HEX = 32  # a part's digest in a mask: 128 bits of sha256 (a reducer would need a collision)


def part_digest(contributors: Sequence[int]) -> hashlib._Hash:
    """A running sha256 of one gathered part: its announced contributors, then its encoded chunks;
    a mask carries the first `DIGEST_HEX` hex digits."""
    return hashlib.sha256(("contributors:" + ",".join(map(str, contributors)) + "\n").encode())


def stated(norm: float) -> float | None:
    """A norm as a scatter's last frame and a mask state it: 7 significant digits (well inside
    `NORM_TOLERANCE`), None if not finite."""
    return float(f"{norm:.7g}") if math.isfinite(norm) else None


def norm_bound(norms: Sequence[float], max_norm_ratio: float | None, compression: str) -> float:
    """The largest norm an aggregate of contributions with these stated norms can have (module
    docstring), each norm capped by the norm bound, plus the wire format's slack."""
    if max_norm_ratio is not None and norms:
        ceiling = max_norm_ratio * wire.lower_median(list(norms))
        norms = [min(n, ceiling) for n in norms]
    return math.sqrt(sum(n * n for n in norms)) * (1 + NORM_SLACK.get(compression, DEFAULT_SLACK)) + 1e-12


class Suspect(NamedTuple):
    """A part to drop, why, and whether its reducer is proven to have lied (`suspect_parts`)."""

    why: str
    proven: bool


def suspect_parts(
    parts: Sequence[int],
    digests: dict[int, Sequence[str | None]],
    norms: dict[int, Sequence[float | None]],
    contributors: dict[int, Sequence[int]],
    average_norms: dict[int, float],
    max_norm_ratio: float | None,
    compression: str,
    min_part_ratio: float | None = None,
) -> dict[int, Suspect]:
    """Parts to drop, with why, from the masks' `digests` and `norms` (ours included), the
    `contributors` each reducer announced and our `average_norms`: other bytes to other members, an
    average larger than its contributors allow, or (`small_parts`) one implausibly small; blaming a
    reducer (`Suspect.proven`) takes evidence fewer than half of the members could not make up."""
    caught: dict[int, Suspect] = {}
    for p in parts:
        stated_digests = {j: d[p] for j, d in digests.items() if p < len(d) and d[p] is not None}
        if len(set(stated_digests.values())) > 1:
            own = stated_digests.get(p)
            others = [d for j, d in stated_digests.items() if j != p]
            proven = own is not None and 2 * sum(d != own for d in others) > len(others)
            caught[p] = Suspect(f"sent different bytes of part {p} to different members "
                                f"({len(set(stated_digests.values()))} digests)", proven)
            continue
        stated = [norms[c][p] for c in contributors.get(p, []) if c in norms and p < len(norms[c])]
        if not stated or len(stated) < len(contributors.get(p, [])) or any(n is None for n in stated):
            continue
        values = sorted(float(n) for n in stated if n is not None)
        bound = norm_bound(values, max_norm_ratio, compression)
        if average_norms[p] > bound:
            raised = max_norm_ratio * values[-1] if max_norm_ratio is not None else math.inf
            liars = (len(values) - 1) // 2
            proof = norm_bound([raised] * liars + values[liars:], None, compression)
            caught[p] = Suspect(f"its average of part {p} has norm {average_norms[p]:.4g} > {bound:.4g} its "
                                f"contributors allow", average_norms[p] > proof)
    left = [p for p in parts if p not in caught]
    caught.update(small_parts(left, norms, {p: contributors.get(p, []) for p in left}, average_norms, min_part_ratio))
    return caught


def small_parts(
    parts: Sequence[int],
    norms: dict[int, Sequence[float | None]],
    contributors: dict[int, Sequence[int]],
    average_norms: dict[int, float],
    min_ratio: float | None,
) -> dict[int, Suspect]:
    """Parts whose ||average|| / (lower median of stated norms) is below `min_ratio` × the other
    parts' lower median (a reducer shrank it); proven with two other parts and references no liar
    can tilt against the reducer: its smallest stated norm, the others' largest (docs/protocol/allreduce.md)."""
    if min_ratio is None:
        return {}
    ratios: dict[int, tuple[float, float, float]] = {}  # part -> (ratio, its floor for the proof, its ceiling)
    for p in parts:
        stated = [norms[c][p] if c in norms and p < len(norms[c]) else None for c in contributors.get(p, [])]
        if not stated or any(n is None or not math.isfinite(n) for n in stated):
            continue
        values = sorted(float(n) for n in stated if n is not None)
        if values[0] <= 0 or not math.isfinite(average_norms.get(p, math.nan)):
            continue
        ratios[p] = (average_norms[p] / wire.lower_median(values), average_norms[p] / values[0],
                     average_norms[p] / values[-1])
    caught: dict[int, Suspect] = {}
    for p, (ratio, floor, _) in ratios.items():
        others = [q for q in ratios if q != p]
        if not others:
            continue
        reference = wire.lower_median([ratios[q][0] for q in others])
        if ratio < min_ratio * reference:
            proven = len(others) >= 2 and floor < min_ratio * wire.lower_median([ratios[q][2] for q in others])
            caught[p] = Suspect(f"its average of part {p} is {ratio / reference:.3g} of the scale of the round's other "
                                f"parts (||average|| over its contributors' norms; below {min_ratio:g})", proven)
    return caught
