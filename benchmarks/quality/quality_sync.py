"""The gap against all-reduces: how far M DiLoCo replicas end above data-parallel as a function of
how often they average, with AdamW and with Muon inside (each against data-parallel with the same
optimizer), from runs `quality.py` stored. Runs nothing.

Takes every stored run of one seed and M with a plain outer step (β 0) and a constant H or the QSR
schedule, groups them by inner optimizer and outer lr η, and prints each group's gap by number of
all-reduces; the PNG draws the same (log x). With AdamW, averaging after every step still leaves
a gap (the replicas' normalized steps on a quarter of the batch each); with Muon it does not, and
what is left is drift between all-reduces.

    python benchmarks/quality/quality_sync.py [--m 4] [--seed 0] [--lrs 1 1.3] [--png benchmarks/quality/results/quality_sync.png]
        [benchmarks/quality/results/quality_tiny_sweep.json benchmarks/quality/results/quality_tiny_muon_outer.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.*

from benchmarks.plots import finish  # noqa: E402
from benchmarks.quality.quality import best_dp  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DEFAULT = [RESULTS / "quality_tiny_sweep.json", RESULTS / "quality_tiny_muon_outer.json"]
LRS = [1.0, 1.3]
PLAIN = re.compile(r"^(\d+):(?:H=(\d+):|sched=qsr:h0=(\d+):)?lr=([0-9.]+):mom=0$")


def points(state: dict, m: int, seed: int) -> dict[tuple[str, float], list[tuple[int, float, str]]]:
    """(inner optimizer, η) -> [(all-reduces, gap vs data-parallel, schedule)] of the plain-outer-step runs."""
    optimizer = "muon" if "inner.optimizer=muon" in state["args"]["overrides"] else "adamw"
    out: dict[tuple[str, float], list[tuple[int, float, str]]] = {}
    for r in state["results"].values():
        match = PLAIN.match(r.get("spec", ""))
        if r.get("kind") != "diloco" or r["seed"] != seed or not match or int(match[1]) != m:
            continue
        schedule = f"qsr from {match[3]}" if match[3] else f"H={match[2] or state['args']['h']}"
        gap = r["final"] / best_dp(state["results"], m, seed)["final"] - 1
        out.setdefault((optimizer, float(match[4])), []).append((r["allreduces"], gap, schedule))
    return {k: sorted(v) for k, v in out.items()}


def collect(files: list[Path] = DEFAULT, m: int = 4, seed: int = 0, lrs: list[float] = LRS
            ) -> dict[tuple[str, float], list]:
    """Every file's plain-outer-step runs of `m` and `seed` at the outer lrs `lrs`, by (optimizer, η)."""
    groups: dict[tuple[str, float], list[tuple[int, float, str]]] = {}
    for f in files:
        for key, pts in points(json.loads(Path(f).read_text()), m, seed).items():
            if key[1] in lrs:
                groups[key] = sorted(groups.get(key, []) + pts)
    return groups


def report(groups: dict[tuple[str, float], list], m: int = 4, seed: int = 0) -> str:
    lines = [f"M={m}, seed {seed}: gap vs data-parallel with the same inner optimizer, by all-reduces",
             f"{'inner':<6} {'η':>4}  all-reduces  gap     schedule"]
    for (optimizer, lr), pts in sorted(groups.items()):
        lines += [f"{optimizer:<6} {lr:>4g}  {n:>11}  {gap:>+6.1%}  {schedule}" for n, gap, schedule in pts]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", type=Path, default=DEFAULT)
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lrs", type=float, nargs="+", default=LRS, help="the outer lrs η to show")
    p.add_argument("--png", type=Path, default=RESULTS / "quality_sync.png")
    args = p.parse_args()
    groups = collect(args.files, args.m, args.seed, args.lrs)
    print(report(groups, args.m, args.seed))
    plot(groups, args.png, args.m, args.seed)
    print(f"plot: {args.png}")


def plot(groups: dict, png: Path, m: int = 4, seed: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, ((optimizer, lr), pts) in enumerate(sorted(groups.items())):
        color, style = f"C{i}", "-" if optimizer == "muon" else "--"
        constant = [(n, g) for n, g, s in pts if s.startswith("H=")]
        ax.plot([n for n, _ in constant], [100 * g for _, g in constant], style, marker="o", color=color,
                label=f"{optimizer} inside, η {lr:g}, constant H")
        qsr = [(n, g) for n, g, s in pts if s.startswith("qsr")]
        ax.plot([n for n, _ in qsr], [100 * g for _, g in qsr], "s", color=color, markersize=8, fillstyle="none",
                label=f"{optimizer} inside, η {lr:g}, QSR schedule")
    ax.axvline(32, color="grey", alpha=0.5, linestyle=":")
    ax.text(33, ax.get_ylim()[1] * 0.95, "2 x 16 all-reduces", color="grey", fontsize=8, va="top")
    ax.set_xscale("log")
    ticks = sorted({n for pts in groups.values() for n, _, s in pts if s.startswith("H=")})
    ax.set_xticks(ticks, [str(n) for n in ticks], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("all-reduces over the run (480 inner steps per replica)")
    ax.set_ylabel("eval loss above data-parallel, same optimizer (%)")
    ax.set_title(f"M = {m}, seed {seed}: the gap against how often the replicas average", fontsize=10)
    finish(fig, ax, png, legend_size=7)


if __name__ == "__main__":
    main()
