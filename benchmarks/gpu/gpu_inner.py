"""Inner-loop overhead on a GPU: our inner trainer against a plain torch loop, same model.

Both train the same preset (150m by default) from the same seed with fused AdamW, bf16 autocast
on fp32 weights, global-norm clipping and the same batch shape. The plain loop is what a user
would write in 30 lines: batches already made (pinned, copied non-blocking), no logging, no
host sync. Ours is `Node.trainer.step(Node._next_batch)`: our dataset, our schedule, the
node-wide loss read back every step. Modes run alternately, `--repeats` times each, and the
table gives the median tokens/s, ours over plain, and MFU: (6·N + 12·L·d·T) FLOP per token
(PaLM's count: N non-embedding parameters, L layers, width d, sequence T) over the GPU's
dense bf16 peak (`--peak-tflops`, 989 for an H100 SXM) and over an 8192³ bf16 matmul measured here.

    python benchmarks/gpu/gpu_inner.py [--preset 150m] [--batch 32] [--seq 1024] [--steps 40] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from diloco_p2p.config import load_config
from diloco_p2p.loop.node import Node
from diloco_p2p.model.build import build_model


def matmul_tflops() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    began, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * n / (time.perf_counter() - began) / 1e12


def plain_loop(config, batches: list[torch.Tensor], compile: bool) -> Callable[[int], None]:
    """The 30-line loop; returns a function that runs n steps."""
    model = build_model(config.model, 259, config.seed).cuda()
    if compile:
        model.compile()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=config.inner.lr, betas=(0.9, 0.95), fused=True)
    it = iter(range(10**9))

    def run(n: int) -> None:
        for _ in range(n):
            batch = batches[next(it) % len(batches)].cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return run


def ours(config, run_dir: Path) -> tuple[Callable[[int], None], Node]:
    node = Node(config, run_dir, progress=False)

    def run(n: int) -> None:
        for _ in range(n):
            node.trainer.step(node._next_batch)

    return run, node


def timed(run: Callable[[int], None], steps: int) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    run(steps)
    torch.cuda.synchronize()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="150m")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also both loops with torch.compile")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True

    overrides = [f"model.preset={args.preset}", f"inner.batch_size={args.batch}", f"inner.seq_len={args.seq}",
                 "inner.warmup_steps=10", "train.eval_batches=0", "train.device=cuda", "train.max_rounds=1000",
                 "data.max_bytes=20000000"]
    config = load_config(None, overrides)
    tmp = Path(tempfile.mkdtemp())
    node_for_data = Node(config, tmp / "data-node", progress=False)
    batches = [node_for_data._next_batch().pin_memory() for _ in range(16)]
    model_cfg, nonembed = node_for_data.model.config, sum(
        p.numel() for n, p in node_for_data.model.named_parameters() if "embed" not in n and "lm_head" not in n)
    del node_for_data
    torch.cuda.empty_cache()
    flop_per_token = 6 * nonembed + 12 * model_cfg.num_hidden_layers * model_cfg.hidden_size * args.seq
    measured_peak = matmul_tflops()

    modes = ["plain", "ours"] + (["plain+compile", "ours+compile"] if args.compile else [])
    tokens = args.batch * args.seq * args.steps
    results: dict[str, list[float]] = {}
    for mode in modes:
        cfg = load_config(None, [*overrides, f"train.compile={'compile' in mode}"])
        if mode.startswith("plain"):
            run = plain_loop(cfg, batches, "compile" in mode)
        else:
            run, _node = ours(cfg, tmp / mode)
        run(args.warmup)
        results[mode] = [tokens / timed(run, args.steps) for _ in range(args.repeats)]
        del run
        torch.cuda.empty_cache()

    print(f"{torch.cuda.get_device_name()}, preset {args.preset} ({nonembed / 1e6:.1f}M non-embedding parameters), "
          f"batch {args.batch} x {args.seq} tokens, {args.steps} steps x {args.repeats}, torch {torch.__version__}")
    print(f"8192^3 bf16 matmul here: {measured_peak:.0f} TFLOP/s; {flop_per_token / 1e9:.2f} GFLOP per token")
    print(f"{'mode':>14} {'tokens/s':>10} {'min':>10} {'max':>10} {'vs plain':>9} {'MFU':>6} {'of matmul':>9}")
    for mode in modes:
        med = statistics.median(results[mode])
        base = statistics.median(results["plain+compile" if "compile" in mode else "plain"])
        tflops = med * flop_per_token / 1e12
        print(f"{mode:>14} {med:>10.0f} {min(results[mode]):>10.0f} {max(results[mode]):>10.0f} "
              f"{med / base - 1:>+9.2%} {tflops / args.peak_tflops:>6.1%} {tflops / measured_peak:>9.1%}")


if __name__ == "__main__":
    main()
