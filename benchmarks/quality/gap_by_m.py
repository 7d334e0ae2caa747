"""The gap to data-parallel against the swarm's size M: every quality table's DiLoCo rows, by lever.

Reads `quality.py` result files (each DiLoCo run against the best data-parallel run of its M and
seed in the same file), sorts each row into a series by its outer step and extras (`SERIES`), and
prints, per series and M, the mean gap over seeds; the PNG plots it against M (log scale):

    python benchmarks/quality/gap_by_m.py --png benchmarks/quality/results/gap_by_m.png \\
        benchmarks/quality/results/quality_tiny_levers.json benchmarks/quality/results/quality_tiny_m16_32.json ...
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.plots import finish  # noqa: E402
from benchmarks.quality.quality import best_dp, mean  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DEFAULT = [*(RESULTS / f"quality_{f}.json" for f in ("tiny_levers", "tiny_m16_32", "tiny_m64", "tiny_moments", "tiny_muon_ilr", "small", "small_muon_ilr",
                                                       "small_dp_muon", "35m", "35m_dp_muon")),
           Path(__file__).parents[1] / "gpu" / "results" / "h200_35m_m8.json"]
# a row's spec (its M, Muon lr and inner.lr stripped) -> its series; rows that match none (other H, rules) are left out
SERIES = [
    (r"(recipe=auto|sched=qsr:h0=8:lr=1\.0:mom=0)", "η 1, β 0"),
    (r"sched=qsr:h0=8:lr=1\.3:mom=0", "η 1.3, β 0"),
    (r"sched=qsr:h0=8:lr=1\.0:mom=0\.5", "η 1, β 0.5"),
    (r"sched=qsr:h0=8:lr=1\.0:mom=0:moments", "η 1, β 0, first moments averaged"),
    (r"sched=qsr:h0=8:lr=1\.0:mom=0\.5:moments", "η 1, β 0.5, first moments averaged"),
]


def series_of(spec: str, outer: dict | None = None) -> str | None:
    """A row's series. A `recipe=auto` row is labelled by the outer step it ran (`outer`, which quality.py
    records), else by η 1, β 0: what the recipe chose with Muon inside before the slow momentum."""
    rest = spec.split(":", 1)[1] if ":" in spec else ""
    if rest in ("recipe=auto", "recipe=auto:moments") and outer:
        rest = f"sched=qsr:h0=8:lr={outer['lr']:.1f}:mom={outer['momentum']:g}" + rest.removeprefix("recipe=auto")
    return next((label for pattern, label in SERIES if re.fullmatch(pattern, rest)), None)


def gaps(paths: list[Path]) -> dict[tuple[str, str, int], list[float]]:
    """(model, series, M) -> the gap of each seed's run that had Muon inside, against the best
    data-parallel Muon run of its M and seed in any file of the same `horizon` (model, length, inner.lr)."""
    states = [json.loads(path.read_text()) for path in paths]
    dp: dict[tuple, list[dict]] = {}
    for state in states:
        a = state["args"]
        if "inner.optimizer=muon" in a["overrides"]:
            for r in state["results"].values():
                if r.get("kind") == "dp":
                    dp.setdefault(horizon(a), []).append(r)
    out: dict[tuple[str, str, int], dict[int, float]] = {}
    for state in states:
        a = state["args"]
        pool = {f"{i}": r for i, r in enumerate(dp.get(horizon(a), []))}
        for r in state["results"].values():
            spec = r.get("spec", "")
            muon = "opt=muon" in spec or ("inner.optimizer=muon" in a["overrides"] and "opt=adamw" not in spec)
            own = re.search(r":ilr=([0-9.e-]+)", spec)  # the row's own inner.lr, else its file's
            ilr = own[1] if own else horizon(a)[-1]
            spec = re.sub(r":opt=muon(:mlr=[0-9.e-]+)?|:ilr=[0-9.e-]+", "", spec)
            label = series_of(spec, r.get("outer")) if r.get("kind") == "diloco" else None
            if not muon or label is None or not any(d["dp_M"] == r["M"] and d["seed"] == r["seed"]
                                                    for d in pool.values()):
                continue
            gap = r["final"] / best_dp(pool, r["M"], r["seed"])["final"] - 1
            label += f", inner.lr {ilr}" if ilr else ""
            out.setdefault((horizon(a)[0], label, r["M"]), {}).setdefault(r["seed"], gap)
    return {k: list(v.values()) for k, v in out.items()}


def horizon(args: dict) -> tuple:
    """A file's model (its config's name), horizon and `inner.lr` override (the AdamW part's lr under
    Muon, both sides: a study of its own): the runs whose gaps compare."""
    ilr = next((o.split("=", 1)[1] for o in args["overrides"] if o.startswith("inner.lr=")), None)
    return Path(args["config"]).stem.removesuffix("-cpu"), args["rounds"], args["h"], args.get("warm_start", 0), ilr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="*", type=Path, default=DEFAULT)
    p.add_argument("--png", type=Path, default=RESULTS / "gap_by_m.png")
    args = p.parse_args()
    table = gaps([f for f in args.files if f.exists()])
    print(report(table))
    plot(table, args.png)
    print(f"plot: {args.png}")


def rows_of(table: dict) -> list[tuple[str, str]]:
    order = [label for _, label in SERIES]
    def key(row: tuple[str, str]) -> tuple:
        label, _, ilr = row[1].partition(", inner.lr ")
        return row[0], float(ilr or 0), order.index(label)

    return sorted({(model, label) for model, label, _ in table}, key=key)


def report(table: dict) -> str:
    """Mean gap (seeds in brackets) per model and series, by M."""
    ms = sorted({m for _, _, m in table})
    lines = [f"{'model':<6} {'series':<52}" + "".join(f"{'M=' + str(m):>14}" for m in ms)]
    for model, label in rows_of(table):
        cells = [table.get((model, label, m)) for m in ms]
        lines.append(f"{model:<6} {label:<52}" + "".join(f"{mean(c):>+10.1%} ({len(c)})" if c else f"{'-':>14}"
                                                          for c in cells))
    return "\n".join(lines)


def plot(table: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (model, label) in enumerate(rows_of(table)):
        points = sorted((m, mean(g)) for (mo, la, m), g in table.items() if (mo, la) == (model, label))
        ax.plot([m for m, _ in points], [100 * g for _, g in points], "o-" if model == "tiny" else "s--",
                color=plt.cm.tab20(i % 20), label=f"{model}: {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M, nodes (each replica batch b; data-parallel at batch M·b, equal tokens)")
    ax.set_ylabel("final eval loss above data-parallel Muon (%)")
    finish(fig, ax, png)


if __name__ == "__main__":
    main()
