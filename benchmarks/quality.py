"""Quality at equal total tokens: tuned data-parallel AdamW vs DiLoCo with M = 1, 2, 4 replicas.

Every run is `diloco-p2p simulate` (the swarm's arithmetic in one process) on the embedded corpus
with `configs/tiny-cpu.yaml`, the same schedule (rounds x H inner steps) and the same held-out
eval set:

- data-parallel AdamW with global batch M x b: one replica with batch M x b whose outer step is
  the identity (outer.lr=1, outer.momentum=0: θ ← θ_local), inner lr from a small sweep;
- DiLoCo with M replicas of batch b (same total tokens), outer lr / momentum from a small sweep;
- a lone node given 1/M of the tokens: AdamW with batch b (the same for every M).

Prints the table and writes a PNG of eval loss against total tokens (best run of each kind).

    python benchmarks/quality.py [--rounds 16] [--inner-steps 25] [--jobs 2] [--set a.b=v ...]
                                 [--png benchmarks/results/quality.png]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = "configs/tiny-cpu.yaml"


def run(name: str, root: Path, replicas: int, sets: list[str]) -> dict:
    out = root / name
    cmd = [sys.executable, "-m", "diloco_p2p", "simulate", "--replicas", str(replicas), "--config", CONFIG,
           "--dir", str(out), *[a for s in sets for a in ("--set", s)]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    lines = (out / "replica-0" / "metrics.jsonl").read_text().splitlines()
    curve = [(r["tokens"] * replicas, r["eval_loss"]) for r in map(json.loads, lines) if r["eval_loss"] is not None]
    return {"name": name, "curve": curve, "final": curve[-1][1], "seconds": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--inner-steps", type=int, default=25, help="H")
    p.add_argument("--batch", type=int, default=8, help="b, one replica's batch")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--adamw-lr", type=float, nargs="+", default=[0.0015, 0.003])
    p.add_argument("--outer", nargs="+", default=["0.7:0.5", "1.0:0.5"], help="outer lr:momentum pairs to sweep")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in --json (same scale) and run only the missing ones, e.g. a wider sweep")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="extra config override for every run (e.g. inner.seq_len=64)")
    p.add_argument("--png", type=Path, default=Path("benchmarks/results/quality.png"))
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/quality.json"))
    args = p.parse_args()
    common = [f"train.max_rounds={args.rounds}", f"outer.inner_steps={args.inner_steps}", "train.num_threads=1",
              f"train.eval_every={args.eval_every}", f"train.checkpoint_every={args.rounds}", *args.overrides]
    jobs: dict[str, tuple[int, list[str]]] = {
        "lone": (1, [*common, f"inner.batch_size={args.batch}", "outer.lr=1.0", "outer.momentum=0.0"])}
    for m in args.replicas:
        for lr in args.adamw_lr:
            jobs[f"adamw-M{m}-lr{lr:g}"] = (1, [*common, f"inner.batch_size={args.batch * m}", f"inner.lr={lr}",
                                                "outer.lr=1.0", "outer.momentum=0.0"])
        for pair in args.outer:
            lr, mom = pair.split(":")
            jobs[f"diloco-M{m}-{lr}:{mom}"] = (m, [*common, f"inner.batch_size={args.batch}", f"outer.lr={lr}",
                                                   f"outer.momentum={mom}"])
    done = json.loads(args.json.read_text())["results"] if args.resume and args.json.exists() else {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diloco-quality-") as tmp, \
            concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {name: pool.submit(run, name, Path(tmp), m, sets) for name, (m, sets) in jobs.items()
                   if name not in done}
        results = {**done, **{name: f.result() for name, f in futures.items()}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    steps = args.rounds * args.inner_steps
    tokens = results["lone"]["curve"][-1][0]
    print(f"tiny model, {CONFIG} {' '.join(args.overrides)}; {args.rounds} rounds x H={args.inner_steps} = {steps} inner steps per replica, "
          f"b={args.batch}; {tokens:,} tokens per replica; {time.perf_counter() - start:.0f} s in all")
    print(f"lone node (AdamW, batch {args.batch}, 1/M of the tokens): eval {results['lone']['final']:.4f}")
    print(f"{'M':>2} {'tokens':>10} {'AdamW dp (lr)':>22} {'DiLoCo (outer lr:mom)':>24} {'gap':>7} {'vs lone':>8}")
    best = {}
    for m in args.replicas:
        dp = min((r for n, r in results.items() if n.startswith(f"adamw-M{m}-")), key=lambda r: r["final"])
        dl = min((r for n, r in results.items() if n.startswith(f"diloco-M{m}-")), key=lambda r: r["final"])
        best[m] = (dp, dl)
        gap = dl["final"] / dp["final"] - 1
        lone = dl["final"] / results["lone"]["final"] - 1
        print(f"{m:>2} {tokens * m:>10,} {dp['final']:>8.4f} ({dp['name'].split('-lr')[1]:>9}) "
              f"{dl['final']:>8.4f} ({dl['name'].split('-', 2)[2]:>13}) {gap:>+7.1%} {lone:>+8.1%}")
    plot(results, best, args.png)
    print(f"plot: {args.png}; all runs: {args.json}")


def plot(results: dict, best: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(*zip(*results["lone"]["curve"], strict=True), "k:", label="lone node, AdamW (1/M of the tokens)")
    for i, (m, (dp, dl)) in enumerate(sorted(best.items())):
        color = f"C{i}"
        ax.plot(*zip(*dp["curve"], strict=True), "--", color=color, label=f"AdamW data-parallel, batch x{m}")
        ax.plot(*zip(*dl["curve"], strict=True), "-", color=color, label=f"DiLoCo M={m} ({dl['name'].split('-', 2)[2]})")
    ax.set_xlabel("total tokens")
    ax.set_ylabel("eval loss")
    ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
