"""The outer step of a big model on a GPU node, against the inner steps of its round.

For the 1b preset on this GPU: each piece of the node's outer work (θ into the model, the trained
weights back and Δ = θ − θ_local, the hash of θ, Δ to the fp16 wire, the Nesterov step), timed
the way the node does it (`OuterOptimizer`: θ and a staging buffer pinned, non-blocking copies,
the hash over 64 MiB chunks on threads) and the naive way beside it (pageable θ, one blocking
copy per parameter and a concatenation, one sha256 stream over a copy of the bytes). Then a few
inner steps (bf16 autocast, fused AdamW; the shipped config's batch, accumulation and H unless
overridden) give the round, and the share of the round the outer work takes.

    python benchmarks/gpu/gpu_outer.py [--config configs/1b.yaml] [--batch 8] [--grad-accum 16] [--seq 1024] [--inner-steps 125]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable

import torch

from diloco_p2p.config import OuterConfig, load_config
from diloco_p2p.hashing import tensor_sha256
from diloco_p2p.loop.inner import InnerTrainer
from diloco_p2p.loop.outer import OuterOptimizer, flatten
from diloco_p2p.model.build import llama_shape
from diloco_p2p.model.llama import Llama
from diloco_p2p.swarm.collective import wire


def seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def naive(params: list[torch.Tensor], theta: torch.Tensor, delta: torch.Tensor,
          cfg: OuterConfig) -> dict[str, Callable[[], object]]:
    """The straightforward versions: pageable host memory, a blocking copy per parameter, the
    step on whole vectors with a θ-sized temporary."""
    numels = [p.numel() for p in params]
    momentum = torch.zeros_like(theta)

    def step() -> None:
        if not torch.isfinite(delta).all():  # the check as it was: torch's
            raise ValueError("not finite")
        momentum.mul_(cfg.momentum).add_(delta)
        theta.sub_(delta.add(momentum, alpha=cfg.momentum), alpha=cfg.lr)

    def to_model() -> None:
        with torch.no_grad():
            for p, chunk in zip(params, theta.split(numels), strict=True):
                p.copy_(chunk.view(p.shape))

    def pseudo_gradient() -> torch.Tensor:
        return theta - flatten(params)  # one blocking copy per parameter, then a concatenation

    return {"θ -> model": to_model, "Δ = θ - weights": pseudo_gradient, "outer step": step,
            "hash θ": lambda: hashlib.sha256(theta.numpy().tobytes()).hexdigest()}


def encode_fp16(delta: torch.Tensor) -> int:
    return sum(len(wire.encode(delta[a:b], "fp16")) for a, b in wire.chunk_ranges(delta.numel(),
                                                                                  wire.DEFAULT_CHUNK_ELEMENTS))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/1b.yaml")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--grad-accum", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--inner-steps", type=int, help="H: inner steps per round")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    given = {"inner.batch_size": args.batch, "inner.grad_accum": args.grad_accum, "inner.seq_len": args.seq,
             "outer.inner_steps": args.inner_steps}
    config = load_config(args.config, [f"{k}={v}" for k, v in given.items() if v is not None])
    inner_cfg, h = config.inner, config.outer.inner_steps
    with torch.device("cuda"):
        model = Llama(llama_shape(config.model, 259))
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    outer = OuterOptimizer(params, config.outer)
    pageable = outer.theta.clone()
    delta = outer.pseudo_gradient(params)

    ours: dict[str, Callable[[], object]] = {
        "θ -> model": lambda: outer.copy_into(params),
        "Δ = θ - weights": lambda: outer.pseudo_gradient(params),
        "hash θ": lambda: tensor_sha256(outer.theta),
        "Δ -> fp16 wire": lambda: encode_fp16(delta),
        "outer step": lambda: outer.step(delta),  # with its check that Δ̄ is finite
    }
    old = naive(params, pageable, delta, config.outer)
    rows = []
    for name, fn in ours.items():
        before = seconds(old[name], args.repeats) if name in old else None
        rows.append((name, before, seconds(fn, args.repeats)))

    trainer = InnerTrainer(model, inner_cfg, 1000, torch.device("cuda"))
    batch = torch.randint(3, 259, (inner_cfg.batch_size, inner_cfg.seq_len + 1))
    for _ in range(2):
        trainer.step(lambda: batch)
    step = seconds(lambda: [trainer.step(lambda: batch).loss for _ in range(3)], 1) / 3
    memory = torch.cuda.max_memory_allocated() / 2**30

    total_old = sum(b if b is not None else a for _, b, a in rows)
    total = sum(a for _, _, a in rows)
    inner = step * h
    tokens = inner_cfg.batch_size * inner_cfg.grad_accum * inner_cfg.seq_len
    print(f"{torch.cuda.get_device_name()}, {args.config} ({config.model.preset}): {numel / 1e9:.2f}B parameters "
          f"({numel * 4 / 2**30:.1f} GiB of fp32 θ), torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print(f"{'outer work':>16} {'naive s':>8} {'ours s':>8}")
    for name, before, after in rows:
        print(f"{name:>16} {'-' if before is None else f'{before:.3f}':>8} {after:>8.3f}")
    print(f"{'total':>16} {total_old:>8.3f} {total:>8.3f}")
    print(f"inner step: {step:.3f} s for {inner_cfg.batch_size} x {inner_cfg.grad_accum} x {inner_cfg.seq_len} tokens "
          f"({tokens / step:,.0f} tokens/s, peak GPU memory {memory:.1f} GiB); H = {h}: {inner:.1f} s of inner steps")
    print(f"outer work per round: naive {total_old / (inner + total_old):.2%}, ours {total / (inner + total):.2%} "
          "of the round (all-reduce not counted)")


if __name__ == "__main__":
    main()
