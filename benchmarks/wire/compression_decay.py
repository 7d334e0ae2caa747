"""topk2 with SparseLoCo's decaying error feedback (``sync.feedback_decay``) against the fp32 wire,
over a small grid of outer settings, at equal tokens.

Every run is one `benchmarks/wire/compression.py` run (`diloco-p2p simulate`, M replicas in one
process, the swarm's arithmetic) on `configs/tiny-cpu.yaml` with the same rounds x H and
held-out eval set. A setting is WIRE:DECAY:OUTER_LR:MOMENTUM[:CARRY]: ``fp32:-:0.7:0.3`` is the dense
reference, ``topk2:0.95:1.0:0`` topk2 + error feedback with β = 0.95, outer lr 1.0 and no outer
momentum (SparseLoCo, Sarfi et al. 2025: the decaying buffer stands in for outer momentum);
``topk2:0.9:2.0:0:0.5`` adds ``sync.feedback_carry`` γ = 0.5 (each round starts from θ − γ·β·e;
without the fifth field γ is 0, the plain feedback, as in every run recorded before γ existed).
Each topk2 run is compared with the fp32 run of the same outer setting (when in the grid) and
with the best fp32 run of the grid. Runs are kept in --json and skipped when present (--resume),
so a grid can be grown run by run; --report only prints the table from --json.

    python benchmarks/wire/compression_decay.py [--rounds 40] [--inner-steps 5] [--density 0.015] [--seed N]
        [--settings fp32:-:0.7:0.3 topk2:0.95:1.0:0 ...] [--resume] [--report] [--txt PATH] [--png PATH]

A run of seed N > 0 is named SETTING@RxHsN and compared with the fp32 runs of its own seed; with
more than one seed the table ends with each setting's mean difference to the preset's fp32 (0.7/0.3)
of the same seed, over the seeds run (the seed-to-seed spread of such a difference is about 1.4% on
this model, so one seed does not resolve gaps under ~2%).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.*

from benchmarks.plots import finish  # noqa: E402
from benchmarks.wire.compression import payload_bytes, run  # noqa: E402

DEFAULT = ["fp32:-:0.7:0.3", "fp32:-:0.7:0", "fp32:-:1.0:0", "fp32:-:1.0:0.3",
           *[f"topk2:{b}:{lr}:{m}" for b in ("0.95", "0.9") for lr in ("1.0", "0.7") for m in ("0", "0.3")]]


def overrides(setting: str) -> list[str]:
    wire, decay, lr, mom, *carry = setting.split(":")
    sets = [f"sync.compression={wire}", f"outer.lr={lr}", f"outer.momentum={mom}"]
    # no fifth field: γ 0, the plain feedback every earlier run of a four-field setting had (unset is 0.5 now)
    feedback = ["sync.error_feedback=true", f"sync.feedback_decay={decay}", f"sync.feedback_carry={(carry or ['0'])[0]}"]
    return sets + (feedback if wire == "topk2" else [])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--inner-steps", type=int, default=5)
    p.add_argument("--density", type=float, default=0.015)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0, help="the runs' seed (initial parameters and data order)")
    p.add_argument("--settings", nargs="+", default=DEFAULT, help="WIRE:DECAY:OUTER_LR:MOMENTUM[:CARRY] (CARRY: sync.feedback_carry), run in this order")
    p.add_argument("--resume", action="store_true", help="keep the runs already in --json, run the missing ones")
    p.add_argument("--report", action="store_true", help="only print the table from --json")
    p.add_argument("--json", type=Path, default=Path("benchmarks/wire/results/compression_topk_decay.json"))
    p.add_argument("--txt", type=Path, help="also write the table here")
    p.add_argument("--png", type=Path, help="also plot each seed's difference to the reference here")
    args = p.parse_args()
    state = json.loads(args.json.read_text()) if (args.resume or args.report) and args.json.exists() else {}
    results: dict = state.get("results", {})
    common = [f"train.max_rounds={args.rounds}", f"outer.inner_steps={args.inner_steps}", "train.num_threads=1",
              f"train.eval_every={args.eval_every}", f"train.checkpoint_every={args.rounds}",
              f"sync.topk_density={args.density}", f"seed={args.seed}"]
    for setting in [] if args.report else args.settings:
        name = f"{setting}@{args.rounds}x{args.inner_steps}{f's{args.seed}' if args.seed else ''}"
        if name in results:
            continue
        with tempfile.TemporaryDirectory(prefix="diloco-decay-") as tmp:
            results[name] = run(name.replace(":", "_"), Path(tmp), args.replicas, [*common, *overrides(setting)])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"replicas": args.replicas, "density": args.density, "results": results},
                                        indent=1))
        print(f"{name}: eval {results[name]['final']:.4f} ({results[name]['seconds']:.0f} s)", flush=True)
    table = report(results, args.replicas, args.density)
    print(table)
    if args.txt:
        args.txt.write_text(table + "\n")
    if args.png:
        plot(results, args.png)


def report(results: dict, replicas: int, density: float) -> str:
    from benchmarks.wire.compression import parameters

    n = parameters()
    fewer = payload_bytes(n, "fp16", replicas, density) / payload_bytes(n, "topk2", replicas, density)
    lines = [f"{'setting (wire:β:lr:momentum@rounds x H)':<34} {'eval':>7} {'fp32 same':>9} {'vs same':>8} "
             f"{'fp32 best':>9} {'vs best':>8} {'same θ':>6}"]
    order = sorted(results, key=lambda k: (int(k.split("@")[1].split("x")[0]), not k.startswith("fp32:"), k))
    for name in order:
        r = results[name]
        setting, schedule = name.split("@")
        wire, _, lr, mom, *_ = setting.split(":")
        fp32 = {k: v for k, v in results.items() if k.startswith("fp32:") and k.endswith("@" + schedule)}
        same = fp32.get(f"fp32:-:{lr}:{mom}@{schedule}")
        top = min(fp32.values(), key=lambda v: v["final"]) if fp32 else None
        cols = [f"{same['final']:>9.4f}" if same else f"{'-':>9}",
                f"{r['final'] / same['final'] - 1:>+8.2%}" if same and wire != "fp32" else f"{'-':>8}",
                f"{top['final']:>9.4f}" if top else f"{'-':>9}",
                f"{r['final'] / top['final'] - 1:>+8.2%}" if top else f"{'-':>8}"]
        lines.append(f"{name:<34} {r['final']:>7.4f} {' '.join(cols)} {'yes' if r['identical'] else 'NO':>6}")
    lines += seed_means(results)
    lines.append(f"topk2 payload: {payload_bytes(n, 'topk2', replicas, density):,.0f} bytes/round/node at M={replicas}, "
                 f"density {density}: {fewer:.1f}x fewer than fp16")
    return "\n".join(lines)


REFERENCE = "fp32:-:0.7:0.3"


def seed_diffs(results: dict, reference: str = REFERENCE) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(setting, rounds x H) run on more than one seed -> (seed, its difference to `reference` of that seed)."""
    diffs: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for name, r in results.items():
        setting, schedule = name.split("@")
        base, _, seed = schedule.partition("s")
        ref = results.get(f"{reference}@{schedule}")
        if ref and setting != reference:
            diffs.setdefault((setting, base), []).append((int(seed or 0), r["final"] / ref["final"] - 1))
    return {key: sorted(runs) for key, runs in sorted(diffs.items()) if len(runs) > 1}


def seed_means(results: dict, reference: str = REFERENCE) -> list[str]:
    """Per setting and schedule run on more than one seed: each seed's difference to `reference` of
    the same seed, their mean and sample standard deviation."""
    lines = []
    for (setting, base), runs in seed_diffs(results, reference).items():
        values = [d for _, d in runs]
        mean = sum(values) / len(values)
        sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        seeds = " / ".join(f"{v:+.2%}" for v in values)
        lines.append(f"{setting}@{base} vs {reference} of the same seed, seeds {[s for s, _ in runs]}: "
                     f"{seeds}; mean {mean:+.2%} (sd {sd:.2%})")
    return lines


def plot(results: dict, png: Path, goal: float = 0.02) -> None:
    """Each seed's difference to the reference (dots) and their mean (bar) per setting and schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    diffs = seed_diffs(results)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(diffs) + 1.5))
    for row, runs in enumerate(diffs.values()):
        values = [100 * d for _, d in runs]
        ax.scatter(values, [row] * len(values), s=14, color="C0", alpha=0.6)
        ax.plot([sum(values) / len(values)] * 2, [row - 0.3, row + 0.3], color="C3", lw=2)
    ax.axvline(100 * goal, color="grey", ls="--", lw=1, label=f"goal +{goal:.0%}")
    ax.axvline(0, color="black", lw=0.5)
    ax.set_yticks(range(len(diffs)), [f"{s} @ {b} ({len(r)} seeds)" for (s, b), r in diffs.items()], fontsize=7)
    ax.set_xlabel(f"eval loss vs {REFERENCE} of the same seed (%): dots = seeds, bar = mean")
    finish(fig, ax, png, grid_axis="x")


if __name__ == "__main__":
    main()
