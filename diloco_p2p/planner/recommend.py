"""What `diloco-p2p plan` recommends: the settings that best raise predicted compute utilization.

The search tries every combination of the settings that change a round's cost in `plan`'s
model (the wire, the overlap, H, fragments, the grid's row size, averaging the inner moments),
keeps those the config accepts (each candidate is planned as `plan.Inputs.from_config` of that
config), and picks, among those reaching `TARGET` utilization at every N, the lowest estimated
quality cost (`QUALITY`: the project's measurements on the tiny preset, each naming its results
file), then the fewest changes. They come out as ``--set`` overrides. The costs rank candidates;
they do not predict a large model's loss; the moments lower it (`MOMENTS_GAIN`), so they are
offered even where the links reach `TARGET`. The search: docs/architecture.md, "The planner's model".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from diloco_p2p import config
from diloco_p2p.config import compression
from diloco_p2p.errors import UserError
from diloco_p2p.planner import plan

TARGET = 0.9
DENSE = compression.DENSE  # fewer bytes left to right, through the same all-reduce
H_FACTORS = (1, 2, 4, 8)
GROUPS = (8, 16, 32)
FRAGMENTS = (2, 5, 10)
TOPK_RECIPE = {"sync.topk_density": 0.034, "sync.feedback_decay": 0.9, "outer.lr": 2.0, "outer.momentum": 0.0}
H_DOUBLING_PCT = 1.2  # blocking at equal tokens, H 5 -> 10 -> 20 -> 50: +1.2, +2.4, +3.7%

# (percent, phrase): results files are under benchmarks/wire/results/ and benchmarks/overlap/results/
QUALITY = {
    "fp32": (0.0, "fp32: the reference"),
    "fp16": (0.0, "fp16: -0.00% vs fp32 (compression.txt)"),
    "int8": (0.01, "int8: +0.01% vs fp32 (compression.txt)"),
    "int4": (0.35, "int4 with error feedback: +0.35% vs fp32 (compression.txt)"),
    "topk2": (0.0, "topk2 at 3.4%, γ 0.5, its outer step: -2.0 to -0.5% vs fp32 (compression_topk_carry.txt)"),
    "eager": (4.5, "eager: +4.5% on the tiny preset, 0.1-2.4% in the paper at scale (overlap_sweep.txt)"),
    "fragments1": (0.2, "fragments, inner τ=1, rebase: +0.2% (overlap_fragments.txt)"),
    "fragments2": (1.0, "fragments, inner τ=2, rebase: +1.0% (README, Fragments)"),
    "group": (0.0, "row size: no cost (the grid's average is exact)"),
}
# (fewest nodes, percent of eval loss it takes off from there on, the least measured): sync.average_moments,
# tiny preset, Muon inside, 16 rounds (benchmarks/quality/results/quality_tiny_muon_ilr.json, 3 seeds;
# quality_tiny_m16_32.json, quality_tiny_m64.json); under 4 nodes unmeasured, so nothing is counted
MOMENTS_GAIN = ((4, 1.8), (8, 1.4))
MOMENTS_PHRASE = "-1.8% at 4 nodes, -1.4 to -3.3% at 8 to 64 (quality_tiny_muon_ilr.json, quality_tiny_m16_32.json, " \
    "quality_tiny_m64.json)"
INNER = [  # (largest τ/H, percent, phrase) for inner without fragments (overlap_sweep.txt)
    (0.1, 0.3, "+0.3% at τ = 0.1 H"),
    (0.2, 1.0, "+0.2 to +1.1% at τ = 0.2 H"),
    (0.5, 2.0, "+1.5 to +2.5% at τ = 0.4-0.5 H"),
    (1.0, 4.5, "not measured past 0.5 H: taken as eager's +4.5%"),
]


@dataclass
class Candidate:
    inputs: plan.Inputs
    fields: dict[str, Any]  # the config's dotted fields this candidate sets
    predictions: list[plan.Prediction]
    cost: float = 0.0
    phrases: tuple[str, ...] = ()
    sets: tuple[str, ...] = ()  # `a.b=v` for each field that differs from the baseline

    @property
    def lowest(self) -> float:
        return min(p.utilization for p in self.predictions)

    @property
    def approach(self) -> str:
        i = self.inputs
        return "fragments" if i.fragments > 1 else i.overlap


@dataclass
class Advice:
    baseline: Candidate
    best: Candidate | None  # None: nothing raises the baseline's lowest utilization
    alternatives: list[Candidate]  # other approaches that also reach TARGET at every N
    why: str  # when best is None or misses TARGET: the cause at the worst N


def fields_of(inp: plan.Inputs) -> dict[str, Any]:
    """The config fields `inp` stands for (`plan`'s `--inner-steps` is a round's, as outer.inner_steps)."""
    out: dict[str, Any] = {"outer.inner_steps": inp.inner_steps, "sync.compression": inp.compression,
                           "sync.overlap": inp.overlap, "sync.fragments": inp.fragments,
                           "sync.target_group_size": inp.group, "outer.dynamic_local_updates": inp.dylu,
                           "sync.average_moments": inp.moments}
    if inp.compression == "topk2":
        out["sync.topk_density"] = inp.density
    if inp.overlap == "inner":
        out["sync.overlap_steps"] = inp.overlap_steps
    return out


def tree_of(fields: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in fields.items():
        config.apply_override(tree, key.split("."), value)
    return tree


def validated(fields: dict[str, Any]) -> config.Config | None:
    """The config `fields` (dotted) give, or None where the config refuses them."""
    try:
        return config.validate_config(tree_of(fields))
    except UserError:
        return None


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def moments_gain(nodes: tuple[int, ...]) -> float:
    """What `sync.average_moments` takes off the eval loss (percent) at the fewest of `nodes`."""
    return next((pct for least, pct in reversed(MOMENTS_GAIN) if least <= min(nodes)), 0.0)


def _options(base: plan.Inputs, nodes: tuple[int, ...]):
    """(fields a candidate sets, H over the baseline's) for every combination; the moments only blocking, at our H."""
    moments = [False, True] if moments_gain(nodes) > 0 else [False]
    h0 = base.inner_steps * base.fragments  # inner steps between two syncs of the same values
    wires = [c for c in DENSE if DENSE.index(c) >= DENSE.index(base.compression)] if base.compression in DENSE \
        else list(DENSE)
    groups = sorted({base.group, *GROUPS}) if max(nodes) > min(base.group, *GROUPS) else [base.group]
    for comp in [*wires, "topk2"]:
        extra = dict(TOPK_RECIPE) if comp == "topk2" else {"sync.error_feedback": True} if comp == "int4" else {}
        for factor in H_FACTORS:
            h = h0 * factor
            shared = {"sync.compression": comp, "outer.inner_steps": h, "sync.fragments": 1, "sync.overlap": "none"}
            schedules: list[dict[str, Any]] = [{}]  # blocking
            if comp != "topk2" and not base.dylu:
                schedules += [{"sync.overlap": "inner", "sync.overlap_steps": 0}, {"sync.overlap": "eager"}]
                schedules += [{"sync.overlap": "inner", "sync.overlap_steps": tau, "sync.fragments": p,
                               "outer.inner_steps": h // p, "sync.overlap_merge": "rebase"}
                              for p in FRAGMENTS for tau in (1, 2) if h % p == 0 and h // p > tau]
            for schedule in schedules:
                for group in (groups if comp != "topk2" else [base.group]):
                    for m in (moments if not schedule and comp != "topk2" and factor == 1 else [False]):
                        yield {**shared, **extra, **schedule, "sync.target_group_size": group,
                               "sync.average_moments": m}, h / h0


def _cost(c: Candidate, base: Candidate, h_factor: float) -> tuple[float, tuple[str, ...]]:
    """The candidate's quality cost (percent, summed; the moments' gain counts below 0) and a phrase for each change."""
    i, b = c.inputs, base.inputs
    total, phrases = QUALITY[i.compression][0], []
    gain = moments_gain(tuple(p.nodes for p in c.predictions))
    total -= gain if i.moments else 0.0
    if i.moments != b.moments:
        phrases.append(f"the inner moments averaged each round: {MOMENTS_PHRASE}" if i.moments else
                       f"sync.average_moments off (it needs a blocking round on a dense wire): loses the {gain:.1f}% it takes off")
    if i.compression != b.compression or (i.compression == "topk2" and c.sets):
        phrases.append(QUALITY[i.compression][1])
    if h_factor > 1:
        total += H_DOUBLING_PCT * math.log2(h_factor)
        phrases.append(f"H {b.inner_steps * b.fragments} -> {i.inner_steps * i.fragments}: fewer outer steps, "
                       f"+{H_DOUBLING_PCT * math.log2(h_factor):.1f}% (+{H_DOUBLING_PCT}% a doubling, overlap_sweep.txt)")
    overlap: list[str] = []
    if i.fragments > 1:
        pct, phrase = QUALITY[f"fragments{i.overlap_steps}"]
        total += pct
        overlap.append(phrase.replace("fragments", f"fragments {i.fragments}", 1))
    elif i.overlap == "eager":
        total += QUALITY["eager"][0]
        overlap.append(QUALITY["eager"][1])
    elif i.overlap == "inner":
        share = max(p.lands_after for p in c.predictions) / i.inner_steps
        _, pct, phrase = next(row for row in INNER if share <= row[0])
        total += pct
        overlap.append(f"inner, landing by {share:.2f} H at the largest N: {phrase} (overlap_sweep.txt)")
    if (i.overlap, i.overlap_steps, i.fragments) != (b.overlap, b.overlap_steps, b.fragments):
        phrases += overlap  # its cost counts in the total either way
    if i.group != b.group:
        phrases.append(QUALITY["group"][1])
    return total, tuple(phrases if c.sets else ())


def recommend(base: plan.Inputs, nodes: tuple[int, ...] = plan.DEFAULT_NODES,
              cal: plan.Calibration | None = None) -> Advice:
    """The best settings for `base`'s links over `nodes` (see the module docstring)."""
    cal = cal or plan.Calibration()
    baseline = Candidate(base, fields_of(base), plan.sweep(base, nodes, cal))
    if baseline.lowest >= TARGET:  # only the moments can still gain: the same settings with them on
        options = [({"sync.average_moments": True}, 1.0)] if not base.moments and moments_gain(nodes) > 0 else []
    else:
        options = list(_options(base, nodes))
    found: list[Candidate] = []
    for fields, h_factor in options:
        cfg = validated({**baseline.fields, **fields})  # what the user's config becomes with the lines pasted
        if cfg is None:
            continue
        inp = plan.Inputs.from_config(cfg, **base.machine())
        c = Candidate(inp, fields, plan.sweep(inp, nodes, cal))
        c.sets = tuple(f"{k}={_value(v)}" for k, v in sorted(fields.items()) if baseline.fields.get(k) != v
                       and not (k == "sync.overlap_steps" and v == 0 and "sync.overlap_steps" not in baseline.fields))
        c.cost, c.phrases = _cost(c, baseline, h_factor)
        found.append(c)
    reach = sorted((c for c in found if c.lowest >= TARGET), key=lambda c: (round(c.cost, 3), len(c.sets), -c.lowest))
    if baseline.lowest >= TARGET:
        return Advice(baseline, reach[0] if reach else None, [], "")
    if reach:
        best, others = reach[0], []
        for c in reach[1:]:
            if c.approach != best.approach and all(c.approach != o.approach for o in others) and len(others) < 2:
                others.append(c)
        return Advice(baseline, best, others, "")
    best = max(found, key=lambda c: (round(c.lowest, 3), -c.cost, -len(c.sets)), default=None)
    if best is None or best.lowest <= baseline.lowest:
        return Advice(baseline, None, [], why_not(baseline))
    return Advice(baseline, best, [], why_not(best))


def why_not(c: Candidate) -> str:
    """What keeps `c` below TARGET at its worst N: the largest cost besides compute, and the H that
    would reach TARGET with the round's exposed seconds as they are (compute >= 9 x exposed)."""
    worst = min(c.predictions, key=lambda p: p.utilization)
    cause = max((k for k in worst.parts if k != "compute"), key=worst.parts.__getitem__, default="compute")
    step = c.inputs.step_seconds
    need = math.ceil(TARGET / (1 - TARGET) * (worst.round_seconds - worst.parts["compute"]) / step)
    return (f"at N={worst.nodes:,} {cause} still takes {worst.parts.get(cause, 0.0):.0f} s of a "
            f"{worst.round_seconds:.0f} s round; at those exposed seconds H >= {need:,} steps would reach it")


def render(advice: Advice) -> list[str]:
    """The lines `plan` prints after its table."""
    base = advice.baseline
    if advice.best is None:
        if base.lowest >= TARGET:
            return [f"Utilization is at least {TARGET} at every N: nothing to change."]
        return [f"No setting tried raises the lowest utilization ({base.lowest:.2f}): {advice.why}."]
    best = advice.best
    head = (f"Recommended: utilization >= {TARGET} at every N; quality cost about {best.cost:+.1f}% (summed, "
            "measured on the tiny preset):" if best.lowest >= TARGET else
            f"No setting tried reaches {TARGET} at every N ({advice.why}); the closest:")
    lines = [head, "  " + _sets(best)]
    lines += [f"  {'N':>6}" + "".join(f"{p.nodes:>6}" for p in base.predictions),
              f"  {'now':>6}" + "".join(f"{p.utilization:>6.2f}" for p in base.predictions),
              f"  {'then':>6}" + "".join(f"{p.utilization:>6.2f}" for p in best.predictions)]
    lines += [f"  {p}" for p in best.phrases]
    if advice.alternatives:
        lines.append(f"Also >= {TARGET} at every N:")
        lines += [f"  {_sets(c)}  (lowest {c.lowest:.2f}, about {c.cost:+.1f}%)" for c in advice.alternatives]
    return lines


def _sets(c: Candidate) -> str:
    return " ".join(f"--set {s}" for s in c.sets)
