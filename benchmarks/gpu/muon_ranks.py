"""Muon's optimizer step on a node of N local ranks against one rank holding the same model (CPU, gloo).

One rank steps `torch.optim.Muon` on the whole hidden matrices; N ranks step `ShardedMuon`
(`diloco_p2p.local.muon`) on FSDP2's row shards: each matrix gathered whole on one rank,
orthogonalized there, its rows scattered back. Only `step()` is timed (the median over the timed
steps, each between two barriers, the slowest rank's time), on the gradients of one fixed batch.
Rows: 1 rank with 1 thread (the same compute per process as each of the N ranks), 1 rank with N
threads (the same cores as the N ranks), N ranks with 1 thread each. The goal (issue 49): N=2
at most 1.25x one rank.

    python benchmarks/gpu/muon_ranks.py [--preset small] [--nproc 2] [--steps 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from diloco_p2p.model.build import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.gpu
from benchmarks.gpu.ranks import run_ranks as launch  # noqa: E402


def rank_main(args: argparse.Namespace) -> None:
    """One rank of a timed run (or the whole run when WORLD_SIZE is 1); rank 0 prints its JSON."""
    from diloco_p2p.config import Config
    from diloco_p2p.local.fsdp import shard_model
    from diloco_p2p.local.ranks import Ranks
    from diloco_p2p.loop.inner import InnerTrainer
    from diloco_p2p.model.build import ByteTokenizer, build_model

    torch.set_num_threads(args.threads)
    cfg = Config.model_validate({"model": {"preset": args.preset}, "train": {"device": "cpu"},
                                 "inner": {"optimizer": "muon"}})
    model = build_model(cfg.model, ByteTokenizer.vocab_size, cfg.seed)
    ranks = Ranks.from_env("cpu")  # one rank: no process group
    if ranks.sharded:
        model = shard_model(model, ranks)
    trainer = InnerTrainer(model, cfg.inner, 100, ranks.device, ranks=ranks)
    batch = torch.randint(0, ByteTokenizer.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(args.warmup + args.steps):
        trainer.model.zero_grad(set_to_none=True)
        trainer._loss(batch).backward()
        ranks.barrier()
        start = time.perf_counter()
        trainer.muon.step()
        ranks.barrier()
        if i >= args.warmup:
            times.append(ranks.all_reduce([time.perf_counter() - start], "max")[0])
    ranks.close()
    if ranks.leader:
        matrices = sum(len(g["params"]) for g in trainer.muon.param_groups)
        print(json.dumps({"optimizer": type(trainer.muon).__name__, "matrices": matrices,
                          "median_s": statistics.median(times)}), flush=True)


def run(args: argparse.Namespace, world: int, threads: int) -> dict:
    return launch(__file__, ["--preset", args.preset, "--steps", str(args.steps), "--warmup", str(args.warmup),
                             "--threads", str(threads)], world, "MUON_BENCH_RANK", threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=list(PRESETS))
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to compare with 1")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)  # a rank's, set by `run`
    args = parser.parse_args()
    if os.environ.get("MUON_BENCH_RANK"):
        rank_main(args)
        return
    n = args.nproc
    rows = [("1 rank, 1 thread", 1, 1), (f"1 rank, {n} threads", 1, n), (f"{n} ranks, 1 thread each", n, 1)]
    results = [(name, run(args, world, threads)) for name, world, threads in rows]
    base = results[0][1]["median_s"]
    print(f"Muon step, preset {args.preset} ({results[0][1]['matrices']} matrices), CPU, median of {args.steps} "
          f"steps, {os.cpu_count()} cores visible")
    print(f"| {'node':<24} | {'optimizer':<12} | {'step ms':>8} | {'vs 1 rank, 1 thread':>19} |")
    print(f"| {'-' * 24} | {'-' * 12} | {'-' * 8} | {'-' * 19} |")
    for name, r in results:
        print(f"| {name:<24} | {r['optimizer']:<12} | {1e3 * r['median_s']:>8.1f} | {r['median_s'] / base:>18.2f}x |")


if __name__ == "__main__":
    main()
