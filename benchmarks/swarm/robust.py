"""Robust aggregation against one attacking member (issue 12 item 5): final eval loss and cost.

Loss table: `diloco-p2p simulate`'s replicas (`diloco_p2p.planner.simulate`: every part reduced by
`aggregate.reduce_part`, the function the all-reduce's reducers call, with the same stated norms,
bounds and encodings) on the embedded corpus with `configs/tiny-cpu.yaml`: 4 replicas, the last
one attacking, each `sync.aggregation`, against 3 honest replicas alone (the attacker removed).
The attacker trains honestly and then lies about its Δ each round:

- ``signflip``: it sends -Δ with 0.999 × `sync.max_weight_ratio` × its honest weight (the largest
  weight not refused; `sync.weight_cap` then caps it for `mean`);
- ``scaled``: it sends Δ × 0.99 × `sync.max_norm_ratio` (the largest norm the bound lets through
  when its honest norm is the median), weight honest.

Every run is repeated for each ``--seeds`` value (``seed``: the initial θ), and each attacked run is
compared with the attacker-free run of the same seed: the table gives the mean of those relative
differences and their range. ``trimmed_mean (two-sided)`` is the rank-trimmed mean of Yin et al.
2018 (b from each end) that ``trimmed_mean`` replaced (`aggregate.trimmed_mean`'s docstring says
why), run for comparison by swapping the function in that job's process.

Cost table: one all-reduce of the tiny model's parameter count among 4 in-process members on real
p2pd daemons (loopback), per rule: median seconds and bytes sent per member, and the reducer's
arithmetic alone (`aggregate.reduce_part` on one part).

    python benchmarks/swarm/robust.py [--rounds 20] [--inner-steps 20] [--seeds 0,1,2] [--jobs 2] [--set a.b=v ...]

Prints both tables and writes benchmarks/swarm/results/robust.json (and robust.png: eval loss curves).
With ``--root DIR`` the runs stay in DIR and a run already complete there is read back instead of
run again: an interrupted benchmark resumes, or summarizes what it finished with fewer ``--seeds``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.harness

import torch  # noqa: E402

from diloco_p2p.swarm.collective import aggregate, wire  # noqa: E402

CONFIG = "configs/tiny-cpu.yaml"
RULES = ("mean", "trimmed_mean", "centered_clip")
ATTACKS = ("signflip", "scaled")
TWO_SIDED = "trimmed_mean (two-sided)"


def two_sided_trimmed_mean(values, trim_fraction: float) -> torch.Tensor:
    """The previous ``trimmed_mean``: drop the b = floor(trim_fraction·m) largest and smallest
    values of each coordinate (Yin et al. 2018), for the comparison row."""
    import math

    m = len(values)
    b = min(int(math.floor(trim_fraction * m)), (m - 1) // 2)
    ordered = torch.stack(list(values)).sort(dim=0).values
    return ordered[b : m - b].sum(dim=0, dtype=torch.float32) / float(m - 2 * b)


# ----------------------------------------------------------------------------- one simulated run


def simulate_one(name: str, root: Path, sets: list[str], attack: str | None, replicas: int,
                 two_sided: bool = False) -> dict:
    """In a child process: `replicas` replicas, the last one attacking with `attack`."""
    from diloco_p2p.config import load_config
    from diloco_p2p.contract import RoundOutcome
    from diloco_p2p.planner.simulate import ReplicaSync, simulate

    config = load_config(CONFIG, sets)
    keys = [f"replica-{i}" for i in range(replicas)]
    if two_sided:
        aggregate.trimmed_mean = two_sided_trimmed_mean

    class Attacker(ReplicaSync):
        def average(self, round: int, delta: torch.Tensor, weight: float, params_hash: str) -> RoundOutcome:
            if attack == "signflip":
                delta, weight = -delta, 0.999 * config.sync.max_weight_ratio * weight
            elif attack == "scaled":
                delta = delta * 0.99 * (config.sync.max_norm_ratio or 8.0)
            return super().average(round, delta, weight, params_hash)

    def make_sync(key, rendezvous):
        return (Attacker if attack and key == keys[-1] else ReplicaSync)(key, rendezvous)

    start = time.perf_counter()
    records = simulate(config, root / name, keys, make_sync=make_sync)
    curve = [(r.round, r.eval_loss) for r in records[keys[0]] if r.eval_loss is not None]
    hashes = {r.params_sha256 for k in keys for r in records[k][-1:]}
    return {"name": name, "curve": curve, "final": curve[-1][1], "seconds": time.perf_counter() - start,
            "replicas_agree": len(hashes) == 1}


def finished(name: str, root: Path, replicas: int, rounds: int) -> dict | None:
    """A job's result read back from its run directories under `root` (`--root`), if every
    replica recorded its last round; None otherwise. Its seconds are not known then (None)."""
    records = []
    for i in range(replicas):
        path = root / name / f"replica-{i}" / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        records.append([json.loads(line) for line in lines if line.endswith("}")])
    if not all(r and r[-1]["round"] == rounds for r in records):
        return None
    curve = [(r["round"], r["eval_loss"]) for r in records[0] if r["eval_loss"] is not None]
    return {"name": name, "curve": curve, "final": curve[-1][1], "seconds": None,
            "replicas_agree": len({r[-1]["params_sha256"] for r in records}) == 1}


def run_job(name: str, root: Path, rounds: int, sets: list[str], attack: str | None, replicas: int,
            two_sided: bool) -> dict:
    done = finished(name, root, replicas, rounds)
    if done is not None:
        return done
    cmd = [sys.executable, __file__, "--one",
           json.dumps([name, str(root), sets, attack, replicas, two_sided])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- cost per round


def model_size(sets: list[str]) -> int:
    from diloco_p2p.config import load_config
    from diloco_p2p.model.build import build_model, build_tokenizer, count_parameters

    config = load_config(CONFIG, sets)
    return count_parameters(build_model(config.model, build_tokenizer(config.model).vocab_size, config.seed))


def allreduce_cost(n: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds and bytes sent per member of one 4-member all-reduce of n values, per rule."""
    from tests.harness.loopback import AllreducePeers

    g = torch.Generator().manual_seed(0)
    base = torch.randn(n, generator=g) * 1e-3
    xs = [base + 1e-3 * torch.randn(n, generator=g) for _ in range(4)]
    out: dict[str, dict[str, float]] = {}
    with AllreducePeers(4, prefix="robust-bench", chunk_elements=wire.DEFAULT_CHUNK_ELEMENTS) as peers:
        for rule in RULES:
            robust = aggregate.Robust(rule, max_norm_ratio=8.0, weight_cap=4.0)
            seconds, sent = [], []
            for rep in range(repeats):
                async def go(group: str, robust: aggregate.Robust):
                    return await asyncio.gather(*(svc.allreduce(group, peers.peers, x, 1000.0, timeout=60,
                                                                max_weight_ratio=16.0, robust=robust)
                                                  for svc, x in zip(peers.services, xs, strict=True)))

                results = peers.loop.run(go(f"{rule}-{rep}", robust), 120)
                assert all(r.status == "ok" for r in results) and len({r.average.sum().item() for r in results}) == 1
                seconds.append(max(r.seconds for r in results))
                sent.append(statistics.mean(r.bytes_sent for r in results))
            lo, hi = wire.partition(n, 4)[0]
            ranges = wire.chunk_ranges(hi - lo, wire.DEFAULT_CHUNK_ELEMENTS)
            contribs = {i: (1000.0, [wire.encode(x[lo + a:lo + b], "fp16") for a, b in ranges]) for i, x in enumerate(xs)}
            norms = {i: aggregate.encoded_norm(x[lo:hi], wire.DEFAULT_CHUNK_ELEMENTS, "fp16") for i, x in enumerate(xs)}
            reduce_s = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                aggregate.reduce_part(robust, contribs, norms, 16.0, hi - lo, wire.DEFAULT_CHUNK_ELEMENTS, "fp16")
                reduce_s.append(time.perf_counter() - t0)
            out[rule] = {"allreduce_s": statistics.median(seconds), "bytes_sent": statistics.median(sent),
                         "reduce_part_s": statistics.median(reduce_s)}
    return out


# ----------------------------------------------------------------------------- main


def jobs_of(args: argparse.Namespace) -> dict[str, tuple[list[str], str | None, int, bool]]:
    """name -> (--set overrides, attack, replicas, two-sided trimmed mean), every seed."""
    common = [f"train.max_rounds={args.rounds}", f"outer.inner_steps={args.inner_steps}", "train.num_threads=1",
              "train.eval_every=2", f"train.checkpoint_every={args.rounds}", "inner.seq_len=64", *args.overrides]
    jobs = {}
    for seed in args.seeds:
        sets = [*common, f"seed={seed}"]
        jobs[f"attacker-free@{seed}"] = (sets, None, 3, False)
        for rule in RULES if args.honest else ():  # what a rule costs when nobody attacks
            jobs[f"honest/{rule}@{seed}"] = ([*sets, f"sync.aggregation={rule}"], None, 4, False)
        if args.honest_only:
            continue
        for attack in ATTACKS:
            for rule in (*RULES, TWO_SIDED):
                if rule == "mean" and seed != args.seeds[0]:
                    continue  # mean fails by a wide margin: one seed shows it
                agg = "trimmed_mean" if rule == TWO_SIDED else rule
                jobs[f"{attack}/{rule}@{seed}"] = ([*sets, f"sync.aggregation={agg}"], attack, 4, rule == TWO_SIDED)
    return jobs


def summarize(results: dict[str, dict], seeds: list[int]) -> dict[str, dict]:
    """Per attack/rule: final losses per seed and their difference to the same seed's attacker-free run."""
    rows: dict[str, dict] = {}
    for name, r in results.items():
        key, _, seed = name.rpartition("@")
        free = results[f"attacker-free@{seed}"]["final"]
        row = rows.setdefault(key, {"finals": [], "vs_free_pct": [], "agree": True, "seconds": []})
        row["finals"].append(r["final"])
        row["vs_free_pct"].append(100 * (r["final"] / free - 1))
        row["agree"] &= r["replicas_agree"]
        row["seconds"].append(r["seconds"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--inner-steps", type=int, default=20, help="H")
    p.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1, 2])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="all-reduces per rule in the cost table")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--root", type=Path, help="keep the runs here (default: a temporary directory); a run "
                   "already complete there is read back, not run again (resume an interrupted benchmark)")
    p.add_argument("--json", type=Path, default=Path("benchmarks/swarm/results/robust.json"))
    p.add_argument("--png", type=Path, default=Path("benchmarks/swarm/results/robust.png"))
    p.add_argument("--honest", action="store_true", help="also 4 honest replicas under each rule: a rule's "
                   "cost to quality when nobody attacks")
    p.add_argument("--honest-only", action="store_true", help="only the attacker-free and honest runs")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.honest |= args.honest_only
    torch.set_num_threads(1)
    if args.one:
        name, root, *rest = json.loads(args.one)
        print(json.dumps(simulate_one(name, Path(root), *rest)))
        return
    jobs = jobs_of(args)
    start = time.perf_counter()
    n = model_size(jobs[f"attacker-free@{args.seeds[0]}"][0])
    cost = allreduce_cost(n, args.repeats)
    with tempfile.TemporaryDirectory(prefix="diloco-robust-") as tmp, \
            concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        root = args.root or Path(tmp)
        futures = {name: pool.submit(run_job, name.replace("/", "-").replace(" ", "_"), root, args.rounds, *job)
                   for name, job in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
    rows = summarize(results, args.seeds)
    free = rows["attacker-free"]["finals"]
    print(f"\n4 replicas (3 honest + 1 attacker), tiny model, {args.rounds} rounds x H={args.inner_steps}, seeds "
          f"{args.seeds}; attacker-free = the 3 honest replicas alone: final eval loss "
          f"{statistics.mean(free):.4f} (range {min(free):.4f}-{max(free):.4f})")
    print("vs free: the attacked run vs the attacker-free run of the same seed, mean [min, max] over seeds")
    print(f"{'attack':<10} {'aggregation':<26} {'final eval':>10} {'vs free':>9} {'[min, max]':>17} {'θ agree':>8}")
    for key, r in rows.items():
        if key == "attacker-free":
            continue
        attack, _, rule = key.partition("/")
        pct = r["vs_free_pct"]
        print(f"{attack:<10} {rule or '-':<26} {statistics.mean(r['finals']):>10.4f} "
              f"{statistics.mean(pct):>+8.2f}% [{min(pct):>+6.2f}%, {max(pct):>+6.2f}%] {str(r['agree']):>8}")
    honest = {k.partition("/")[2]: r["finals"] for k, r in rows.items() if k.startswith("honest/")}
    if honest:
        print("\nno attacker: 4 honest replicas, each rule against mean on the same seeds")
        for rule, finals in honest.items():
            pct = [100 * (f / m - 1) for f, m in zip(finals, honest["mean"], strict=True)]
            print(f"{rule:<14} final eval {statistics.mean(finals):.4f}  vs mean {statistics.mean(pct):+.2f}% "
                  f"[{min(pct):+.2f}%, {max(pct):+.2f}%]")
    print(f"\ncost per round, one all-reduce of {n:,} values among 4 members on loopback (fp16), median of "
          f"{args.repeats}")
    print(f"{'aggregation':<14} {'all-reduce s':>12} {'bytes sent/member':>18} {'reduce_part s':>14}")
    for rule, c in cost.items():
        print(f"{rule:<14} {c['allreduce_s']:>12.3f} {c['bytes_sent']:>18,.0f} {c['reduce_part_s']:>14.4f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "parameters": n,
                                     "summary": rows, "results": results, "cost": cost,
                                     "seconds": time.perf_counter() - start}, indent=1))
    plot(args, results)


def plot(args: argparse.Namespace, results: dict[str, dict]) -> None:
    """Eval loss curves of the first seed, one panel per attack."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    seed = args.seeds[0]
    fig, axes = plt.subplots(1, len(ATTACKS), figsize=(11, 4), sharey=True)
    for ax, attack in zip(axes, ATTACKS, strict=True):
        rounds, losses = zip(*results[f"attacker-free@{seed}"]["curve"], strict=True)
        ax.plot(rounds, losses, "k--", label="attacker-free (3 honest)")
        for rule in (*RULES, TWO_SIDED):
            if f"{attack}/{rule}@{seed}" not in results:  # --honest-only
                continue
            rounds, losses = zip(*results[f"{attack}/{rule}@{seed}"]["curve"], strict=True)
            ax.plot(rounds, losses, ":" if rule == TWO_SIDED else "-", label=rule)
        ax.set_title(f"attack: {attack} (seed {seed})")
        ax.set_xlabel("round")
        ax.set_yscale("log")
        ax.legend()
    axes[0].set_ylabel("eval loss")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
