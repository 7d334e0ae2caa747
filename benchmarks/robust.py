"""Robust aggregation against one attacking member (issue 12 item 5): final eval loss and cost.

Loss table: `diloco-p2p simulate`'s replicas (`diloco_p2p.simulate`: every part reduced by
`aggregate.reduce_part`, the function the all-reduce's reducers call, with the same stated norms,
bounds and encodings) on the embedded corpus with `configs/tiny-cpu.yaml`: 4 replicas, the last
one attacking, each `sync.aggregation`, against 3 honest replicas alone (the attacker removed).
The attacker trains honestly and then lies about its Δ each round:

- ``signflip``: it sends -Δ with 0.999 × `sync.max_weight_ratio` × its honest weight (the largest
  weight not refused; `sync.weight_cap` then caps it for `mean`);
- ``scaled``: it sends Δ × 0.99 × `sync.max_norm_ratio` (the largest norm the bound lets through
  when its honest norm is the median), weight honest.

Cost table: one all-reduce of the tiny model's parameter count among 4 in-process members on real
p2pd daemons (loopback), per rule: median seconds and bytes sent per member, and the reducer's
arithmetic alone (`aggregate.reduce_part` on one part).

    python benchmarks/robust.py [--rounds 20] [--inner-steps 20] [--jobs 2] [--set a.b=v ...]

Prints both tables and writes benchmarks/results/robust.json (and robust.png: eval loss curves).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.harness

import torch  # noqa: E402

from diloco_p2p.swarm import aggregate, wire  # noqa: E402

CONFIG = "configs/tiny-cpu.yaml"
RULES = ("mean", "trimmed_mean", "centered_clip")
ATTACKS = ("signflip", "scaled")


# ----------------------------------------------------------------------------- one simulated run


def simulate_one(name: str, root: Path, sets: list[str], attack: str | None, replicas: int) -> dict:
    """In a child process: `replicas` replicas, the last one attacking with `attack`."""
    from diloco_p2p.config import load_config
    from diloco_p2p.contract import RoundOutcome
    from diloco_p2p.simulate import ReplicaSync, simulate

    config = load_config(CONFIG, sets)
    keys = [f"replica-{i}" for i in range(replicas)]

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


def run_job(name: str, root: Path, sets: list[str], attack: str | None, replicas: int) -> dict:
    cmd = [sys.executable, __file__, "--one", json.dumps([name, str(root), sets, attack, replicas])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- cost per round


def model_size(sets: list[str]) -> int:
    from diloco_p2p.config import load_config
    from diloco_p2p.model import build_model, build_tokenizer, count_parameters

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--inner-steps", type=int, default=20, help="H")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="all-reduces per rule in the cost table")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/robust.json"))
    p.add_argument("--png", type=Path, default=Path("benchmarks/results/robust.png"))
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        name, root, sets, attack, replicas = json.loads(args.one)
        torch.set_num_threads(1)
        print(json.dumps(simulate_one(name, Path(root), sets, attack, replicas)))
        return
    common = [f"train.max_rounds={args.rounds}", f"outer.inner_steps={args.inner_steps}", "train.num_threads=1",
              "train.eval_every=2", f"train.checkpoint_every={args.rounds}", "inner.seq_len=64", *args.overrides]
    jobs = {"attacker-free": (common, None, 3)}
    for attack in ATTACKS:
        for rule in RULES:
            jobs[f"{attack}/{rule}"] = ([*common, f"sync.aggregation={rule}"], attack, 4)
    start = time.perf_counter()
    n = model_size(common)
    cost = allreduce_cost(n, args.repeats)
    with tempfile.TemporaryDirectory(prefix="diloco-robust-") as tmp, \
            concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {name: pool.submit(run_job, name.replace("/", "-"), Path(tmp), sets, attack, m)
                   for name, (sets, attack, m) in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
    free = results["attacker-free"]["final"]
    print(f"\n4 replicas (3 honest + 1 attacker), tiny model, {args.rounds} rounds x H={args.inner_steps}; "
          f"attacker-free = the 3 honest replicas alone: final eval loss {free:.4f}")
    print(f"{'attack':<10} {'aggregation':<14} {'final eval':>10} {'vs free':>9} {'θ agree':>8} {'wall s':>7}")
    for name, r in results.items():
        attack, _, rule = name.partition("/")
        print(f"{attack:<10} {rule or '-':<14} {r['final']:>10.4f} {100 * (r['final'] / free - 1):>+8.1f}% "
              f"{str(r['replicas_agree']):>8} {r['seconds']:>7.0f}")
    print(f"\ncost per round, one all-reduce of {n:,} values among 4 members on loopback (fp16), median of "
          f"{args.repeats}")
    print(f"{'aggregation':<14} {'all-reduce s':>12} {'bytes sent/member':>18} {'reduce_part s':>14}")
    for rule, c in cost.items():
        print(f"{rule:<14} {c['allreduce_s']:>12.3f} {c['bytes_sent']:>18,.0f} {c['reduce_part_s']:>14.4f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "parameters": n,
                                     "results": results, "cost": cost,
                                     "seconds": time.perf_counter() - start}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(ATTACKS), figsize=(11, 4), sharey=True)
    for ax, attack in zip(axes, ATTACKS, strict=True):
        rounds, losses = zip(*results["attacker-free"]["curve"], strict=True)
        ax.plot(rounds, losses, "k--", label="attacker-free (3 honest)")
        for rule in RULES:
            rounds, losses = zip(*results[f"{attack}/{rule}"]["curve"], strict=True)
            ax.plot(rounds, losses, label=rule)
        ax.set_title(f"attack: {attack}")
        ax.set_xlabel("round")
        ax.set_yscale("log")
        ax.legend()
    axes[0].set_ylabel("eval loss")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
