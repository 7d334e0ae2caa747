"""FSDP inside a node: host memory of the outer state per rank, and inner-step throughput.

Two measurements:

1. θ + momentum bytes each rank keeps on the host (fp32, two copies of its shards), sharded
   over N local ranks vs unsharded, for every model preset. Shard sizes follow FSDP2's layout
   exactly (dim 0 of each parameter in `torch.chunk` order; the model is built on the meta
   device, so no memory is used); the largest rank is reported. For the preset that is
   trained in part 2, the bytes actually allocated by the outer optimizer on each rank are printed too.
2. Inner-step throughput (tokens/s, after warmup) of 1 rank vs N ranks on CPU with the same
   global batch: 1 rank with batch N·b, N ranks with b each (gloo).

    python benchmarks/gpu/fsdp_memory.py [--nproc 2] [--preset tiny] [--steps 20] [--batch 4] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from diloco_p2p.config import Config
from diloco_p2p.model.build import PRESETS, ByteTokenizer, llama_shape
from diloco_p2p.model.llama import Llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.gpu
from benchmarks.gpu.ranks import run_ranks as launch  # noqa: E402

MiB = 2**20


def shard_numels(preset: str, nproc: int) -> list[int]:
    """Parameters held by each of `nproc` ranks under FSDP2's dim-0 chunking."""
    cfg = Config.model_validate({"model": {"preset": preset}})
    with torch.device("meta"):
        model = Llama(llama_shape(cfg.model, ByteTokenizer.vocab_size))
    per_rank = [0] * nproc
    for p in model.parameters():
        rows = [c.shape[0] for c in torch.chunk(torch.empty(p.shape[0], device="meta"), nproc)]
        for r, n in enumerate(rows):
            per_rank[r] += n * (p.numel() // p.shape[0])
    return per_rank


def memory_table(nprocs: list[int]) -> None:
    print("outer state (θ + momentum, fp32) on the host, per rank (largest rank)")
    print(f"{'preset':>7} {'params':>14} " + " ".join(f"{f'N={n}':>12}" for n in nprocs))
    for preset in PRESETS:
        cells = []
        for n in nprocs:
            numels = shard_numels(preset, n)
            cells.append(f"{8 * max(numels) / MiB:>8.1f} MiB")
        total = sum(shard_numels(preset, 1))
        print(f"{preset:>7} {total:>14,} " + " ".join(f"{c:>12}" for c in cells))


def rank_main(args: argparse.Namespace) -> None:
    """One rank of the throughput run (or the whole run when WORLD_SIZE is 1)."""
    from diloco_p2p.data import build_dataset
    from diloco_p2p.local.fsdp import ShardLayout, shard_model
    from diloco_p2p.local.ranks import Ranks
    from diloco_p2p.loop.inner import InnerTrainer
    from diloco_p2p.loop.outer import OuterOptimizer
    from diloco_p2p.model.build import build_model

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = Config.model_validate({
        "model": {"preset": args.preset}, "data": {"max_bytes": 2_000_000, "order_key": "bench"},
        "inner": {"batch_size": args.batch * args.nproc // world, "seq_len": args.seq_len, "warmup_steps": 2},
        "train": {"device": "cpu"},
    })
    tok = ByteTokenizer()
    model = build_model(cfg.model, tok.vocab_size, cfg.seed)
    data = build_dataset(cfg.data, tok, cfg.inner.seq_len, "bench")
    ranks = Ranks.from_env(cfg.train.device)  # one rank: no process group, every collective a no-op
    total = args.warmup + args.steps
    if ranks.sharded:
        model = shard_model(model, ranks)
    trainer = InnerTrainer(model, cfg.inner, total, ranks.device, ranks=ranks)
    outer = OuterOptimizer(ShardLayout(list(model.parameters()), ranks).local_views(), cfg.outer)
    rank, n = ranks.rank, ranks.world_size

    class batches:  # rank r's rows of the node's next N·b windows, as the node takes them
        @staticmethod
        def next_batch(b: int) -> torch.Tensor:
            return data.next_batch(b * n)[rank::n]

    for _ in range(args.warmup):
        trainer.step(lambda: batches.next_batch(cfg.inner.batch_size))
    start, tokens = time.perf_counter(), 0
    for _ in range(args.steps):
        tokens += trainer.step(lambda: batches.next_batch(cfg.inner.batch_size)).tokens  # node-wide tokens
    seconds = time.perf_counter() - start
    outer_bytes = outer.theta.nbytes + outer.momentum.nbytes
    outer_bytes = int(ranks.all_reduce([outer_bytes], "max")[0])
    ranks.close()
    if rank == 0:
        print(json.dumps({"world": world, "tokens_per_s": tokens / seconds, "outer_bytes_max_rank": outer_bytes,
                          "batch_per_rank": cfg.inner.batch_size}), flush=True)


def run_ranks(args: argparse.Namespace, world: int) -> dict:
    return launch(__file__, ["--nproc", str(args.nproc), "--preset", args.preset, "--steps", str(args.steps),
                             "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq-len", str(args.seq_len)],
                  world, "FSDP_BENCH_RANK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to compare with 1")
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS), help="model trained in the throughput run")
    parser.add_argument("--steps", type=int, default=20, help="timed inner steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed inner steps first")
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch of the N-rank run (1 rank: N times it)")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    if os.environ.get("FSDP_BENCH_RANK"):
        rank_main(args)
        return
    memory_table(sorted({1, 2, args.nproc, 8}))
    print(f"\ninner steps on CPU, preset {args.preset}, global batch {args.batch * args.nproc} x {args.seq_len} tokens, "
          f"{torch.get_num_threads()} cores visible, 1 thread per rank")
    for world in (1, args.nproc):
        r = run_ranks(args, world)
        print(f"  {world} rank(s): {r['tokens_per_s']:>9.0f} tokens/s   outer state on the largest rank: "
              f"{r['outer_bytes_max_rank'] / MiB:.2f} MiB (allocated)")


if __name__ == "__main__":
    main()
