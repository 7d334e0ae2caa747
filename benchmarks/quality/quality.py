"""Quality at equal tokens: tuned data-parallel AdamW against DiLoCo with M replicas, and compute efficiency.

Every run is `diloco-p2p simulate` (the swarm's arithmetic in one process) of one config (`--config`:
configs/tiny-cpu.yaml, configs/small-cpu.yaml, configs/35m.yaml, with `--set` on top) over the same
horizon, T = `--rounds` x `--h` inner steps per replica, and the same held-out eval set:

- data-parallel AdamW with global batch M x b: one replica of batch M x b whose outer step is the
  identity (outer.lr=1, outer.momentum=0, fp32 wire), its lr swept over `--dp-lr` (at M = 1) and
  γ* · √M · {1/2, 1/√2, 1} at M > 1 (γ* the best at M = 1: the square-root batch rule and two √2
  steps below it, the DiLoCo scaling-laws paper's lr grid);
- DiLoCo, one run per `--run` setting, written M[:key=value...] with keys `lr` (outer.lr), `mom`
  (outer.momentum), `nest` (outer.nesterov 0/1), `H` (outer.inner_steps), `sched` (outer.h_schedule),
  `h0` (outer.h_start), `warm` (outer.warmup_rounds), `lr0` (outer.lr_start), `ilr` (inner.lr),
  `opt` (inner.optimizer), `mlr` (inner.muon_lr), `recipe` (outer.recipe; its outer.nodes is M), `agg` (sync.aggregation) and the bare flag
  `moments` (sync.average_moments=true); e.g. `4:recipe=auto` or `4:lr=0.7:mom=0.3:moments`. Unnamed fields come from the config (a run's own fields
  override `--set`).

For every DiLoCo run the table gives its final eval loss, its gap over the best data-parallel run
of its M at equal tokens, its *compute efficiency* (the tokens data-parallel needed to reach the
run's final loss, interpolated on that data-parallel curve in log tokens, divided by the tokens
the run spent: 100% means every volunteer's token counted), and its number of all-reduces.

`--warm-start S` starts every run, data-parallel and DiLoCo alike, from one solo-trained checkpoint: a
single replica of batch b trains S steps on another seed's data order (the original DiLoCo recipe:
the swarm takes over a model that already trains), is exported, and is every run's
`model.pretrained_path`; the table then measures the gap of the continued phase only.

Runs go `--jobs` at a time (one torch thread each on a CPU; on a GPU every run shares it), the
data-parallel runs at M = 1 first, the DiLoCo runs beside those at M > 1; each result is written
to `--json` as it finishes, so `--resume` runs only the missing ones and `--report` prints the
table and writes the PNG (eval loss against tokens per replica: the x axis of a run of M replicas
is its tokens / M, the compute of one volunteer).

    python benchmarks/quality/quality.py --config configs/tiny-cpu.yaml --rounds 16 --h 30 \\
        --run 4:lr=0.7:mom=0.3 4:recipe=auto --seeds 0 1 2 --jobs 2 --json benchmarks/quality/results/quality_tiny.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.*

from benchmarks.plots import finish  # noqa: E402

KEYS = {"lr": "outer.lr", "mom": "outer.momentum", "nest": "outer.nesterov", "H": "outer.inner_steps",
        "sched": "outer.h_schedule", "h0": "outer.h_start", "warm": "outer.warmup_rounds", "lr0": "outer.lr_start",
        "ilr": "inner.lr", "opt": "inner.optimizer", "mlr": "inner.muon_lr", "recipe": "outer.recipe",
        "agg": "sync.aggregation", "moments": "sync.average_moments"}
FLAGS = {"moments": "true"}  # keys that may stand alone: ``8:...:moments`` is ``moments=true``


def simulate(cfg: str, keys: list[str], sets: list[str]) -> dict:
    """One `simulate` run: its eval curve (tokens of all replicas, loss) and its all-reduces."""
    with tempfile.TemporaryDirectory(prefix="diloco-quality-") as tmp:
        cmd = [sys.executable, "-m", "diloco_p2p", "simulate", "--order-keys", *keys, "--config", cfg, "--dir", tmp,
               *[a for s in sets for a in ("--set", s)]]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        return {**outcome(Path(tmp) / keys[0], len(keys)), "seconds": time.perf_counter() - start}


def outcome(run_dir: Path, m: int) -> dict:
    """A run's eval curve (tokens of all `m` replicas, loss) and all-reduces, from one replica's records."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["tokens"] * m, r["eval_loss"]) for r in records if r["eval_loss"] is not None]
    allreduces = sum(1 for r in records if r.get("status") == "committed")
    return {"curve": curve, "final": curve[-1][1], "allreduces": allreduces}


def parse_run(spec: str, rounds: int = 16, h: int = 30, optimizer: str = "adamw") -> tuple[int, list[str]]:
    """`--run`'s M and its overrides. ``recipe=auto`` sets every field the recipe chooses for M nodes over
    `rounds` rounds of H with the run's inner optimizer (its `opt`, else `optimizer`), so a config file's
    own outer step (the tiny preset's) does not mask it."""
    m, *pairs = spec.split(":")
    optimizer = dict(pair.partition("=")[::2] for pair in pairs).get("opt", optimizer)
    sets = []
    for pair in pairs:
        key, _, value = pair.partition("=")
        value = value or FLAGS.get(key, "")
        if key not in KEYS or not value:
            raise SystemExit(f"--run {spec}: {pair!r} is not key=value with a key of {sorted(KEYS)}")
        sets.append(f"{KEYS[key]}={value}")
        if key == "recipe" and value == "auto":
            from diloco_p2p.config.recipe import recipe

            chosen = recipe(int(m), rounds, h, optimizer=optimizer)
            sets += [f"outer.nodes={m}", *(f"outer.{k}={v}" for k, v in chosen.items())]
    return int(m), sets


def interpolate_tokens(curve: list[tuple[float, float]], loss: float) -> float:
    """The tokens at which a (decreasing) eval curve reaches `loss`, linear in log tokens; a loss below
    the curve's end is not reached within it: infinity (an efficiency of more than 100% by an amount the
    curve cannot say; its flat, decayed end made an extrapolation meaningless)."""
    pts = [(math.log(t), v) for t, v in curve if t > 0]
    for (t0, v0), (t1, v1) in zip(pts, pts[1:], strict=False):
        if v1 <= loss <= v0 and v0 != v1:
            return math.exp(t0 + (t1 - t0) * (v0 - loss) / (v0 - v1))
    if loss >= pts[0][1]:
        return math.exp(pts[0][0])
    return math.inf if loss < min(v for _, v in pts) else math.exp(pts[-1][0])


def efficiency(value: float) -> str:
    return ">100%" if math.isinf(value) else f"{value:.0%}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--rounds", type=int, default=16, help="horizon: rounds of --h inner steps (T = rounds x h)")
    p.add_argument("--h", type=int, default=30, help="H of the horizon, and of every run that names none")
    p.add_argument("--batch", type=int, help="b, one replica's batch (default: the config's inner.batch_size)")
    p.add_argument("--eval-steps", type=int, help="data-parallel runs evaluate every this many steps (default: h)")
    p.add_argument("--dp-lr", type=float, nargs="+", help="data-parallel lrs at M = 1 (default: the config's inner.lr "
                   "and 2x it)")
    p.add_argument("--dp-scales", type=float, nargs="*", default=[0.5, 1 / math.sqrt(2), 1.0],
                   help="at M > 1 the data-parallel lrs are γ* · √M · each of these (γ* the best at M = 1); none: "
                        "no data-parallel runs above M = 1 (another file of the study has them)")
    p.add_argument("--dp-ms", type=int, nargs="*", default=[],
                   help="data-parallel at these M too, besides M = 1 and the M of every --run")
    p.add_argument("--run", nargs="*", default=[], help="DiLoCo settings M[:key=value...], see the docstring")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--jobs", type=int, default=2, help="runs at once")
    p.add_argument("--warm-start", type=int, default=0, metavar="S",
                   help="every run starts from a solo run of S steps at batch b (see the docstring)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="config override for every run")
    p.add_argument("--resume", action="store_true", help="keep the runs in --json, run the missing ones")
    p.add_argument("--report", action="store_true", help="only print the table and write the PNG from --json")
    p.add_argument("--json", type=Path, default=Path("benchmarks/quality/results/quality.json"))
    p.add_argument("--png", type=Path, help="default: --json with .png")
    args = p.parse_args()
    state = json.loads(args.json.read_text()) if (args.resume or args.report) and args.json.exists() else {}
    if not args.report:
        state = train(args, state.get("results", {}))
    report(state, args.png or args.json.with_suffix(".png"))


def train(args: argparse.Namespace, results: dict) -> dict:
    from diloco_p2p.config import load_config

    base = load_config(args.config, args.overrides)
    batch = args.batch or base.inner.batch_size
    steps, eval_steps = args.rounds * args.h, args.eval_steps or args.h
    if args.warm_start:
        args.overrides = [*args.overrides, f"model.pretrained_path={warm_start(args, batch)}"]
    meta = {"config": args.config, "overrides": args.overrides, "rounds": args.rounds, "h": args.h, "batch": batch,
            "warm_start": args.warm_start}
    state = {"args": meta, "results": results}

    def save(name: str, result: dict) -> None:
        results[name] = result
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(state, indent=1))
        print(f"{name}: eval {result['final']:.4f}, {result['allreduces']} all-reduces ({result['seconds']:.0f} s)",
              flush=True)

    def one(job: tuple[str, int, int, list[str], dict]) -> None:
        name, m, seed, sets, info = job
        keys = replica_keys(m, seed)
        save(name, {**simulate(args.config, keys, [*common(args, seed, batch), *sets]), **info, "M": m, "seed": seed})

    dp_rounds = [f"train.max_rounds={steps // eval_steps}", f"outer.inner_steps={eval_steps}", "train.eval_every=1",
                 f"train.checkpoint_every={steps // eval_steps}", "outer.lr=1.0", "outer.momentum=0.0",
                 "sync.compression=fp32", "outer.recipe=manual", "outer.h_schedule=constant", "outer.warmup_rounds=0"]

    def dp_job(m: int, seed: int, lr: float) -> tuple[str, int, int, list[str], dict]:
        return (f"dp-M{m}-lr{lr:.3g}@s{seed}", 1, seed,
                [*dp_rounds, f"inner.batch_size={batch * m}", f"inner.lr={lr}"],
                {"kind": "dp", "dp_M": m, "lr": lr})

    ms = sorted({parse_run(s)[0] for s in args.run} | {1, *args.dp_ms})
    lrs = args.dp_lr or [base.inner.lr, 2 * base.inner.lr]
    diloco = [diloco_job(args, spec, seed) for seed in args.seeds for spec in args.run]

    # One pool: the data-parallel runs at M = 1 first, then the DiLoCo runs, which need nothing; each
    # seed's data-parallel runs at M > 1 (at its best lr γ* from M = 1) join the queue once γ* is known.
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        first = {seed: [pool.submit(one, j) for j in (dp_job(1, seed, lr) for lr in lrs) if j[0] not in results]
                 for seed in args.seeds}
        rest = [pool.submit(one, j) for j in diloco if j[0] not in results]
        for seed in args.seeds:
            for f in first[seed]:
                f.result()
            gamma = best_dp(results, 1, seed)["lr"]
            later = [dp_job(m, seed, gamma * math.sqrt(m) * s) for m in ms if m > 1 for s in args.dp_scales]
            rest += [pool.submit(one, j) for j in later if j[0] not in results]
        for f in rest:
            f.result()
    return state


def replica_keys(m: int, seed: int) -> list[str]:
    return [f"s{seed}-replica-{i}" for i in range(m)]


def common(args: argparse.Namespace, seed: int, batch: int) -> list[str]:
    """The overrides every run of a seed shares."""
    return [f"seed={seed}", f"inner.batch_size={batch}", "train.num_threads=1", *args.overrides]


def diloco_job(args: argparse.Namespace, spec: str, seed: int) -> tuple[str, int, int, list[str], dict]:
    """A DiLoCo `--run` at `seed`: its name, M, seed, overrides over the horizon, and result fields."""
    from diloco_p2p.config import load_config

    m, sets = parse_run(spec, args.rounds, args.h, load_config(args.config, args.overrides).inner.optimizer)
    steps, eval_steps = args.rounds * args.h, args.eval_steps or args.h
    h = next((int(s.split("=")[1]) for s in sets if s.startswith("outer.inner_steps=")), args.h)
    if steps % h:
        raise SystemExit(f"--run {spec}: H={h} does not divide the horizon's {steps} steps")
    horizon = [f"train.max_rounds={steps // h}", f"outer.inner_steps={h}",
               f"train.eval_every={max(1, eval_steps // h)}", f"train.checkpoint_every={10**6}"]
    # the outer lr and momentum the run's own overrides set (every recipe=auto run sets both); {}: the config's
    ran = {k: float(v) for k, _, v in (s.removeprefix("outer.").partition("=") for s in sets) if k in ("lr", "momentum")}
    return f"{spec}@s{seed}", m, seed, [*horizon, *sets], {"kind": "diloco", "spec": spec, "outer": ran}


def warm_start(args: argparse.Namespace, batch: int) -> Path:
    """The solo checkpoint every run starts from: one replica of batch b, `--warm-start` steps on seed
    1000's data order (the runs' seeds read theirs from the start), exported once into the temp directory."""
    out = Path(tempfile.gettempdir()) / f"diloco-quality-{args.json.stem}-warm{args.warm_start}"
    if (out / "config.json").is_file():
        return out
    with tempfile.TemporaryDirectory(prefix="diloco-warm-") as tmp:
        sets = ["seed=1000", f"inner.batch_size={batch}", "train.num_threads=1", *args.overrides,
                "train.max_rounds=1", f"outer.inner_steps={args.warm_start}", "train.checkpoint_every=1",
                "outer.lr=1.0", "outer.momentum=0.0", "sync.compression=fp32", "outer.recipe=manual",
                "outer.h_schedule=constant", "outer.warmup_rounds=0"]
        for cmd in (["simulate", "--order-keys", "solo", "--config", args.config, "--dir", tmp,
                     *[a for s in sets for a in ("--set", s)]],
                    ["export", "--checkpoint", f"{tmp}/solo", "--out", str(out)]):
            proc = subprocess.run([sys.executable, "-m", "diloco_p2p", *cmd], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return out


def best_dp(results: dict, m: int, seed: int) -> dict:
    runs = [r for r in results.values() if r.get("kind") == "dp" and r["dp_M"] == m and r["seed"] == seed]
    return min(runs, key=lambda r: r["final"])


def report(state: dict, png: Path) -> None:
    args, results = state["args"], state["results"]
    shown = [o for o in args["overrides"] if not o.startswith("model.pretrained_path=")]
    warm = f", from a solo run of {args['warm_start']} steps" if args.get("warm_start") else ""
    print(f"{args['config']} {' '.join(shown)}: horizon {args['rounds']} x H={args['h']} inner steps "
          f"per replica, b={args['batch']}{warm}; {len(results)} runs, "
          f"{sum(r['seconds'] for r in results.values()) / 60:.0f} min of runs")
    rows = {}
    compared = {(r["dp_M"], r["seed"]) for r in results.values() if r.get("kind") == "dp"}
    for r in results.values():
        if r.get("kind") == "diloco" and (r["M"], r["seed"]) in compared:  # a run still waiting for its dp: later
            rows.setdefault(r["spec"], []).append(r)
    print(f"{'DiLoCo run':<44} {'seeds':>5} {'eval':>7} {'gap vs dp':>10} {'efficiency':>10} {'all-reduces':>11}   "
          "gap per seed")
    summary = {}
    for spec, runs in rows.items():
        gaps, effs = [], []
        for r in runs:
            dp = best_dp(results, r["M"], r["seed"])
            gaps.append(r["final"] / dp["final"] - 1)
            effs.append(interpolate_tokens(dp["curve"], r["final"]) / r["curve"][-1][0])
        summary[spec] = (mean(gaps), mean(effs))
        print(f"{spec:<44} {len(runs):>5} {mean([r['final'] for r in runs]):>7.4f} {mean(gaps):>+10.2%} "
              f"{efficiency(mean(effs)):>10} {runs[0]['allreduces']:>11}   " + " ".join(f"{g:+.1%}" for g in gaps))
    print("data-parallel (best lr of each M and seed):")
    for m in sorted({r["dp_M"] for r in results.values() if r.get("kind") == "dp"}):
        best = [best_dp(results, m, s) for s in sorted({r["seed"] for r in results.values()})
                if any(r.get("kind") == "dp" and r["dp_M"] == m and r["seed"] == s for r in results.values())]
        print(f"  M={m}: eval {mean([b['final'] for b in best]):.4f} at lr " + ", ".join(f"{b['lr']:.3g}" for b in best))
    plot(results, rows, png)
    print(f"plot: {png}")


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def plot(results: dict, rows: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ms = sorted({r["M"] for runs in rows.values() for r in runs})
    colors = {m: f"C{i}" for i, m in enumerate(sorted({1, *ms}))}
    for m in sorted({1, *ms}):
        dp = [r for r in results.values() if r.get("kind") == "dp" and r["dp_M"] == m and r["seed"] == 0]
        if dp:
            best = min(dp, key=lambda r: r["final"])
            ax.plot([t / m for t, _ in best["curve"]], [v for _, v in best["curve"]], "--", color=colors[m],
                    label=f"data-parallel, batch {m}b (lr {best['lr']:.3g})")
    styles = ["-", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1))]
    for i, (spec, runs) in enumerate(rows.items()):
        r = next((r for r in runs if r["seed"] == 0), runs[0])
        ax.plot([t / r["M"] for t, _ in r["curve"]], [v for _, v in r["curve"]], linestyle=styles[i % len(styles)],
                color=colors[r["M"]], label=f"DiLoCo {spec}")
    ax.set_xlabel("tokens per replica (one volunteer's compute)")
    ax.set_ylabel("eval loss")
    finals = [r["final"] for r in results.values()]
    ax.set_ylim(min(finals) * 0.97, max(finals) * 1.4)
    finish(fig, ax, png, legend_size=7)


if __name__ == "__main__":
    main()
