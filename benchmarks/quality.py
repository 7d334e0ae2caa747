"""Quality at equal total tokens: tuned data-parallel AdamW vs DiLoCo with M = 1, 2, 4 replicas.

Every run is `diloco-p2p simulate` (the swarm's arithmetic in one process) on the embedded corpus
with `configs/tiny-cpu.yaml`, the same number of inner steps per replica (`--steps`, a cosine
schedule over them) and the same held-out eval set:

- data-parallel AdamW with global batch M x b: one replica with batch M x b whose outer step is the
  identity (outer.lr=1, outer.momentum=0: θ ← θ_local, fp32 wire), inner lr γ from a small sweep;
  at M = 1 over `--adamw-lr`, at M > 1 over γ* · √M · `--adamw-scales` (γ* the best at M = 1;
  default {1/√2, 1}: the square-root batch rule and one √2 step below it, the DiLoCo scaling-laws
  paper's lr grid);
- DiLoCo with M replicas of batch b (same total tokens), one run per `--diloco` setting
  M:outer_lr:momentum:H[:inner_lr] (inner lr default `--inner-lr`, else γ*);
- a lone node given 1/M of the tokens: the best AdamW run at batch b (M = 1) has, after the same
  steps, exactly 1/M of the tokens of an M-replica run, so it is read from that run, not rerun.

Runs go one after another on one core (torch threads 1), the cheap and most telling first; each
result is written to `--json` as it finishes, so an interrupted run keeps what it has and
`--resume` runs only the missing ones. `--report` prints the table and writes the PNG (eval loss
against total tokens, best run of each kind) from the json alone.

`--seed N` repeats runs with another initial θ (`seed`) and other data orders (order keys
sN-replica-i); their names end in @sN. A seed's AdamW baseline is its best run at that seed. The
table's DiLoCo row per M is the setting measured at the most seeds, then with the lowest mean gap;
every setting measured at several seeds is listed with its gap at each.

    python benchmarks/quality.py [--steps 1500] [--batch 8] [--diloco 2:0.7:0.3:25[:0.0015] ...]
                                 [--seed 0] [--set a.b=v ...] [--resume] [--report]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = "configs/tiny-cpu.yaml"
DILOCO = ["1:0.7:0.3:25", "2:0.7:0.3:25", "2:0.7:0.5:25", "4:1.0:0.3:25", "4:0.7:0.3:25"]


def run(name: str, root: Path, keys: list[str], sets: list[str]) -> dict:
    out, replicas = root / name, len(keys)
    cmd = [sys.executable, "-m", "diloco_p2p", "simulate", "--order-keys", *keys, "--config", CONFIG,
           "--dir", str(out), *[a for s in sets for a in ("--set", s)]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    lines = (out / keys[0] / "metrics.jsonl").read_text().splitlines()
    curve = [(r["tokens"] * replicas, r["eval_loss"]) for r in map(json.loads, lines) if r["eval_loss"] is not None]
    return {"name": name, "curve": curve, "final": curve[-1][1], "seconds": time.perf_counter() - start}


def schedule(steps: int, h: int, eval_steps: int) -> list[str]:
    if steps % h or eval_steps % h:
        raise SystemExit(f"--steps {steps} and --eval-steps {eval_steps} must be multiples of H={h}")
    return [f"train.max_rounds={steps // h}", f"outer.inner_steps={h}", f"train.eval_every={eval_steps // h}",
            f"train.checkpoint_every={steps // h}"]


def best(results: dict, prefix: str, seed: int = 0) -> dict | None:
    runs = [r for n, r in results.items() if n.startswith(prefix) and r.get("seed", 0) == seed]
    return min(runs, key=lambda r: r["final"]) if runs else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1500, help="inner steps per replica (every run)")
    p.add_argument("--eval-steps", type=int, default=150, help="evaluate every this many inner steps")
    p.add_argument("--batch", type=int, default=8, help="b, one replica's batch")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--adamw-lr", type=float, nargs="+", default=[0.0015, 0.003], help="γ swept at batch b")
    p.add_argument("--adamw-scales", type=float, nargs="+", default=[1 / math.sqrt(2), 1.0],
                   help="at M > 1 the AdamW lrs are γ* · √M · each of these")
    p.add_argument("--adamw-h", type=int, default=50, help="round length of the AdamW runs (no effect on θ)")
    p.add_argument("--diloco", nargs="*", default=DILOCO, help="M:outer_lr:momentum:H settings, run in this order")
    p.add_argument("--inner-lr", type=float, help="DiLoCo's inner lr where a setting names none, and the γ* of "
                   "--adamw-scales (default: the best AdamW lr at batch b)")
    p.add_argument("--seed", type=int, default=0, help="initial θ and data orders of every run (names end @sN)")
    p.add_argument("--resume", action="store_true", help="keep the runs already in --json and run the missing ones")
    p.add_argument("--report", action="store_true", help="only print the table and write the PNG from --json")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="extra config override for every run (e.g. inner.seq_len=64)")
    p.add_argument("--png", type=Path, default=Path("benchmarks/results/quality.png"))
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/quality.json"))
    args = p.parse_args()
    state = json.loads(args.json.read_text()) if (args.resume or args.report) and args.json.exists() else {}
    results: dict = state.get("results", {})
    if not args.report:
        train(args, results)
    report(json.loads(args.json.read_text()), args.png)


def train(args: argparse.Namespace, results: dict) -> None:
    common = ["train.num_threads=1", f"seed={args.seed}", *args.overrides]
    adamw = schedule(args.steps, args.adamw_h, args.eval_steps)
    tag, prefix = (f"@s{args.seed}", f"s{args.seed}-") if args.seed else ("", "")

    def step(name: str, replicas: int, sets: list[str], meta: dict) -> None:
        name += tag
        if name in results:
            return
        keys = [f"{prefix}replica-{i}" for i in range(replicas)]
        with tempfile.TemporaryDirectory(prefix="diloco-quality-") as tmp:
            results[name] = {**run(name, Path(tmp), keys, [*common, *sets]), **meta, "seed": args.seed}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
        print(f"{name}: eval {results[name]['final']:.4f} ({results[name]['seconds']:.0f} s)", flush=True)

    def adamw_run(m: int, lr: float) -> None:
        step(f"adamw-M{m}-lr{lr:.3g}", 1, [*adamw, f"inner.batch_size={args.batch * m}", f"inner.lr={lr}",
                                            "outer.lr=1.0", "outer.momentum=0.0", "sync.compression=fp32"],
             {"kind": "adamw", "M": m, "lr": lr, "batch": args.batch * m})

    for lr in args.adamw_lr:
        adamw_run(1, lr)
    gamma = args.inner_lr or best(results, "adamw-M1-")["lr"]
    settings = [s.split(":") for s in args.diloco]
    if any(len(s) not in (4, 5) for s in settings):
        raise SystemExit(f"--diloco settings are M:outer_lr:momentum:H[:inner_lr], got {args.diloco}")
    for m in args.replicas:
        if m > 1:
            for scale in args.adamw_scales:
                adamw_run(m, gamma * math.sqrt(m) * scale)
        for sm, lr, mom, h, *inner in settings:
            if int(sm) == m:
                g = float(inner[0]) if inner else gamma
                step(f"diloco-M{m}-{lr}:{mom}:H{h}:lr{g:.3g}", m,
                     [*schedule(args.steps, int(h), args.eval_steps), f"inner.batch_size={args.batch}",
                      f"inner.lr={g}", f"outer.lr={lr}", f"outer.momentum={mom}"],
                     {"kind": "diloco", "M": m, "outer_lr": float(lr), "momentum": float(mom), "H": int(h),
                      "inner_lr": g})


def report(state: dict, png: Path) -> None:
    args, results = state["args"], state["results"]
    lone = best(results, "adamw-M1-")
    ms = sorted({r["M"] for r in results.values() if "M" in r})
    total = sum(r["seconds"] for r in results.values())
    print(f"tiny model, {CONFIG} {args['overrides']}; {args['steps']} inner steps per replica, b={args['batch']}; "
          f"{len(results)} runs, {total / 60:.0f} min")
    print(f"lone node (AdamW, batch b, lr {lone['lr']:g}, 1/M of the tokens): eval {lone['final']:.4f}")
    print("DiLoCo: the setting measured at the most seeds, then the lowest mean gap; eval and gap at seed 0")
    print(f"{'M':>2} {'tokens':>10} {'AdamW dp (lr)':>20} {'DiLoCo (η:β:H:inner lr)':>37} {'gap':>7} {'vs lone':>8}"
          f" {'mean gap (seeds)':>17}")
    best_runs = {}
    for m in ms:
        dp = best(results, f"adamw-M{m}-")
        runs = [n for n, r in results.items() if r.get("kind") == "diloco" and r["M"] == m and r.get("seed", 0) == 0]
        if dp is None or not runs:
            continue
        dl = results[min(runs, key=lambda n: (-len(seed_gaps(results, n)), mean(seed_gaps(results, n).values())))]
        best_runs[m], gaps = (dp, dl), seed_gaps(results, dl["name"])
        print(f"{m:>2} {dl['curve'][-1][0]:>10,} {dp['final']:>8.4f} ({dp['lr']:>9.3g}) "
              f"{dl['final']:>8.4f} ({dl['name'].split('-', 2)[2]:>26}) {dl['final'] / dp['final'] - 1:>+7.1%} "
              f"{dl['final'] / lone['final'] - 1:>+8.1%} {mean(gaps.values()):>+10.1%} ({len(gaps)})")
    print("every run:")
    for name, r in results.items():
        print(f"  {name:<34} {r['final']:.4f}  {r['seconds']:>5.0f} s")
    print("DiLoCo settings measured at more than one seed: gap over the best AdamW of that M and seed, per seed")
    for n, r in results.items():
        gaps = seed_gaps(results, n) if r.get("kind") == "diloco" and r.get("seed", 0) == 0 else {}
        if len(gaps) > 1:
            print(f"  {n:<34} " + "  ".join(f"s{s} {g:+.1%}" for s, g in gaps.items())
                  + f"  mean {mean(gaps.values()):+.1%}")
    plot(lone, best_runs, png)
    print(f"plot: {png}")


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def seed_gaps(results: dict, name: str) -> dict[int, float]:
    """A seed-0 DiLoCo run's gap over the best AdamW run of its M at the same seed, at every seed measured."""
    seeds = sorted({r.get("seed", 0) for r in results.values()})
    gaps = {}
    for s in seeds:
        r, dp = results.get(name if s == 0 else f"{name}@s{s}"), best(results, f"adamw-M{results[name]['M']}-", s)
        if r and dp:
            gaps[s] = r["final"] / dp["final"] - 1
    return gaps


def plot(lone: dict, best_runs: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(*zip(*lone["curve"], strict=True), "k:", label="lone node, AdamW batch b (1/M of the tokens at M)")
    for i, (m, (dp, dl)) in enumerate(sorted(best_runs.items())):
        color = f"C{i}"
        if m > 1:
            ax.plot(*zip(*dp["curve"], strict=True), "--", color=color, label=f"AdamW data-parallel, batch {m}b")
        ax.plot(*zip(*dl["curve"], strict=True), "-", color=color, label=f"DiLoCo M={m} ({dl['name'].split('-', 2)[2]})")
    ax.set_xlabel("total tokens")
    ax.set_ylabel("eval loss")
    ax.set_ylim(top=min(ax.get_ylim()[1], lone["final"] * 1.5))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
