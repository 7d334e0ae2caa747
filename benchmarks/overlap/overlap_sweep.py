"""``sync.overlap`` against blocking at equal tokens over outer settings and round lengths: does
another outer lr / momentum or another H bring eager (or inner, with its τ and α) within 1% of blocking?

Every run is one `benchmarks/wire/compression.py` run (`diloco-p2p simulate`, M replicas in one
process, the swarm's arithmetic, fp32 wire) on `configs/tiny-cpu.yaml`. A setting is
MODE:OUTER_LR:MOMENTUM:ROUNDSxH, e.g. ``eager:0.7:0.3:40x5``, with MODE ``inner-TAU-ALPHA`` for
``sync.overlap=inner`` with ``sync.overlap_steps=TAU`` and ``sync.overlap_mix=ALPHA`` (e.g.
``inner-5-0.75:0.7:0.3:40x10``; ALPHA ``rebase``: ``sync.overlap_merge=rebase``), and an optional fifth field WIRE (default fp32; ``int4+ef``: the
int4 wire with error feedback, e.g. ``inner-2-0.5:0.7:0.3:40x10:int4+ef``), and MODE/P for Streaming DiLoCo's
``sync.fragments=P`` (e.g. ``inner-1-0.5/5:0.7:0.3:200x2``: each part syncs every 10 steps, as 40x10 does); each overlapped run is compared
with blocking (``none``) at the same outer setting and schedule (when in the grid) and with the
best blocking run at the same total inner steps. Runs are kept in --json and skipped when
present (--resume); --report only prints the table.

    python benchmarks/overlap/overlap_sweep.py [--settings none:0.7:0.3:40x5 eager:0.7:0.3:40x5 ...]
                                       [--seed N] [--resume] [--report] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.*

from benchmarks.wire.compression import run, wire_overrides  # noqa: E402

DEFAULT = [f"{mode}:0.7:0.3:{s}" for s in ("80x5", "40x10", "16x25", "8x50") for mode in ("none", "eager")]


def overrides(setting: str) -> list[str]:
    mode, lr, mom, schedule, *wire = setting.split(":")
    rounds, h = schedule.split("x")
    mode, _, fragments = mode.partition("/")  # MODE/P: sync.fragments=P
    mode, *inner = mode.split("-")  # inner-TAU-ALPHA: sync.overlap_steps and sync.overlap_mix
    merge = ["sync.overlap_merge=rebase"] if inner and inner[1] == "rebase" else [f"sync.overlap_mix={x}" for x in inner[1:]]
    extra = [f"sync.overlap_steps={inner[0]}", *merge] if inner else []
    extra += [f"sync.fragments={fragments}"] if fragments else []
    return [*extra, f"sync.overlap={mode}", f"outer.lr={lr}", f"outer.momentum={mom}", f"train.max_rounds={rounds}",
            f"outer.inner_steps={h}", f"train.eval_every={max(1, int(rounds) // 4)}",
            f"train.checkpoint_every={rounds}", "train.num_threads=1", *wire_overrides(wire[0] if wire else "fp32")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--settings", nargs="+", default=DEFAULT, help="MODE:OUTER_LR:MOMENTUM:ROUNDSxH, in this order")
    p.add_argument("--resume", action="store_true", help="keep the runs already in --json, run the missing ones")
    p.add_argument("--report", action="store_true", help="only print the table from --json")
    p.add_argument("--seed", type=int, default=0, help="the run's seed (initial parameters); runs of seed N > 0 "
                   "go to overlap_sweep_seedN.json unless --json says otherwise")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--means", nargs="+", type=Path, metavar="JSON",
                   help="only print, per setting, each seed's difference to blocking and the mean over these files "
                        "(one seed each)")
    p.add_argument("--png", type=Path, default=None, help="with --means: each seed's difference to blocking, per setting")
    args = p.parse_args()
    if args.means:
        per_seed = [json.loads(f.read_text())["results"] for f in args.means]
        print(means(per_seed))
        if args.png:
            plot_means(per_seed, args.png)
        return
    if args.json is None:
        args.json = Path(f"benchmarks/overlap/results/overlap_sweep{f'_seed{args.seed}' if args.seed else ''}.json")
    state = json.loads(args.json.read_text()) if (args.resume or args.report) and args.json.exists() else {}
    results: dict = state.get("results", {})
    for setting in [] if args.report else args.settings:
        if setting in results:
            continue
        with tempfile.TemporaryDirectory(prefix="diloco-overlap-sweep-") as tmp:
            results[setting] = run(setting.replace(":", "_"), Path(tmp), args.replicas,
                                   [*overrides(setting), f"seed={args.seed}"])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"replicas": args.replicas, "results": results}, indent=1))
        print(f"{setting}: eval {results[setting]['final']:.4f} ({results[setting]['seconds']:.0f} s)", flush=True)
    print(report(results))


def means(per_seed: list[dict]) -> str:
    """Each setting in every seed's results: its difference to blocking (`blocking_schedule`) and,
    under MODE/P, to blocking with the same P (``none/P``), seed by seed, and the means."""
    def diffs(name: str, base) -> list[float] | None:
        pairs = [(r[name]["final"], r.get(base(name))) for r in per_seed]
        return None if any(b is None for _, b in pairs) else [100 * (v / b["final"] - 1) for v, b in pairs]

    def blocking(name: str) -> str:
        mode, lr, mom, schedule, *_ = name.split(":")
        return f"none:{lr}:{mom}:{blocking_schedule(mode, schedule)}"

    def same_fragments(name: str) -> str:
        mode, rest = name.split(":", 1)
        return f"none/{mode.partition('/')[2]}:{rest}"

    common = [n for n in per_seed[0] if all(n in r for r in per_seed) and not n.startswith("none:")]
    lines = [f"{len(per_seed)} seeds; difference of the final eval loss, %, seed by seed | mean",
             f"{'setting':<34} {'vs blocking':<50} {'vs blocking with the same fragments':<50}"]
    for name in sorted(common, key=lambda n: (steps(n), n)):
        cols = []
        for d in (diffs(name, blocking), diffs(name, same_fragments) if "/" in name.split(":")[0]
                  and not name.startswith("none/") else None):
            cols.append("-" if d is None else " ".join(f"{x:+.2f}" for x in d) + f" | {sum(d) / len(d):+.2f}")
        lines.append(f"{name:<34} {cols[0]:<50} {cols[1]:<50}")
    return "\n".join(lines)


def plot_means(per_seed: list[dict], png: Path) -> None:
    """Each seed's difference to blocking (dots) and the mean (bar) per setting; the ±1% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted((n for n in per_seed[0] if all(n in r for r in per_seed) and not n.startswith("none:")),
                   key=lambda n: (steps(n), n))
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2, 4.5))
    ax.axhspan(-1, 1, color="0.9", label="within 1% of blocking")
    for i, name in enumerate(names):
        mode, lr, mom, schedule, *_ = name.split(":")
        base = f"none:{lr}:{mom}:{blocking_schedule(mode, schedule)}"
        d = [100 * (r[name]["final"] / r[base]["final"] - 1) for r in per_seed]
        ax.plot([i] * len(d), d, "o", color="tab:blue", alpha=0.6)
        ax.hlines(sum(d) / len(d), i - 0.3, i + 0.3, color="tab:red", lw=2)
    ax.axhline(0, color="0.4", lw=0.8)
    ax.set_xticks(range(len(names)), [n.replace(":0.7:0.3:", "\n") for n in names], fontsize=8)
    ax.set_ylabel("final eval loss vs blocking (%)")
    ax.set_title(f"sync.fragments / overlap vs blocking at equal tokens, {len(per_seed)} seeds (dots), mean (bar)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"plot: {png}")


def steps(setting: str) -> int:
    rounds, h = setting.split(":")[3].split("x")
    return int(rounds) * int(h)


def blocking_schedule(mode: str, schedule: str) -> str:
    """The blocking run a setting is compared with: the same, or under MODE/P (fragments) the one
    whose rounds are as long as a part's sync interval: R x H -> R/P x H·P."""
    fragments = int(mode.partition("/")[2] or 1)
    rounds, h = (int(v) for v in schedule.split("x"))
    return f"{rounds // fragments}x{h * fragments}"


def report(results: dict) -> str:
    lines = [f"{'setting (mode:lr:momentum:rounds x H)':<30} {'eval':>7} {'blocking same':>13} {'vs same':>8} "
             f"{'blocking best':>13} {'vs best':>8} {'same θ':>6}"]
    for name in sorted(results, key=lambda k: (steps(k), -int(k.split(":")[3].split("x")[1]), k.split(":")[0] != "none", k)):
        r, (mode, lr, mom, schedule, *_) = results[name], name.split(":")
        same = results.get(f"none:{lr}:{mom}:{blocking_schedule(mode, schedule)}")
        blocking = [v for k, v in results.items() if k.startswith("none:") and steps(k) == steps(name)]
        top = min(blocking, key=lambda v: v["final"]) if blocking else None
        cols = [f"{same['final']:>13.4f}" if same else f"{'-':>13}",
                f"{r['final'] / same['final'] - 1:>+8.2%}" if same and mode != "none" else f"{'-':>8}",
                f"{top['final']:>13.4f}" if top else f"{'-':>13}",
                f"{r['final'] / top['final'] - 1:>+8.2%}" if top else f"{'-':>8}"]
        lines.append(f"{name:<30} {r['final']:>7.4f} {' '.join(cols)} {'yes' if r['identical'] else 'NO':>6}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
