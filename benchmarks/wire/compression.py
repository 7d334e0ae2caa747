"""Quality and bytes of each wire at equal tokens: fp32, fp16, int8, int4, topk2 (with and without
error feedback), on the same run.

Every run is `diloco-p2p simulate` (M replicas in one process, each contribution encoded, reduced
and decoded exactly as the swarm's all-reduce does, error feedback in each replica's node) on the
embedded corpus with `configs/tiny-cpu.yaml`, the same schedule and the same held-out eval set.
Bytes per round per node are the payload a member sends (`wire.encoded_size` /
`codecs.topk_size` of its frames: the butterfly's scatter of k-1 parts plus the gather of its own
part to k-1 members; topk2's all-gather of its whole contribution to k-1 members), without the
~200-byte headers. Prints the table, writes benchmarks/wire/results/compression.json and a PNG of eval
loss against rounds.

    python benchmarks/wire/compression.py [--replicas 2] [--rounds 10] [--inner-steps 20] [--jobs 2]
                                     [--density 0.01] [--only fp32 int4 int4+ef ...]

The committed benchmarks/wire/results/compression.json ran every setting (--only fp16 int8 int4 int4+ef topk2 topk2+ef).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.*

from benchmarks.plots import finish  # noqa: E402
from diloco_p2p.swarm.collective import codecs, wire

CONFIG = "configs/tiny-cpu.yaml"
SETTINGS = {  # name -> (compression, error feedback)
    "fp32": ("fp32", "false"), "fp16": ("fp16", "false"), "int8": ("int8", "false"), "int4": ("int4", "false"),
    "int4+ef": ("int4", "true"), "topk2": ("topk2", "false"), "topk2+ef": ("topk2", "true"),
}


def wire_overrides(name: str) -> list[str]:
    """The config overrides of a wire named as in SETTINGS, e.g. ``int4+ef``."""
    compression, feedback = SETTINGS[name]
    return [f"sync.compression={compression}", f"sync.error_feedback={feedback}"]


def payload_bytes(n: int, compression: str, k: int, density: float, chunk: int = wire.DEFAULT_CHUNK_ELEMENTS) -> float:
    """Mean payload bytes one member sends per round (see the module docstring)."""
    if k < 2:
        return 0.0
    if compression in wire.SPARSE:
        return (k - 1) * sum(codecs.topk_size(b - a, density) for a, b in wire.chunk_ranges(n, chunk))
    sizes = [sum(wire.encoded_size(b - a, compression) for a, b in wire.chunk_ranges(hi - lo, chunk))
             for lo, hi in wire.partition(n, k)]
    # member j scatters every part but its own and gathers its own to k-1 members
    return sum(sum(sizes) - sizes[j] + (k - 1) * sizes[j] for j in range(k)) / k


def run(name: str, root: Path, replicas: int, sets: list[str]) -> dict:
    out = root / name
    cmd = [sys.executable, "-m", "diloco_p2p", "simulate", "--replicas", str(replicas), "--config", CONFIG,
           "--dir", str(out), *[a for s in sets for a in ("--set", s)]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "replica-0" / "metrics.jsonl").read_text().splitlines()]
    hashes = [[json.loads(line)["params_sha256"] for line in (out / f"replica-{i}" / "metrics.jsonl").read_text()
               .splitlines()] for i in range(replicas)]
    curve = [(r["round"], r["eval_loss"]) for r in records if r["eval_loss"] is not None]
    return {"name": name, "curve": curve, "final": curve[-1][1], "seconds": time.perf_counter() - start,
            "identical": all(h == hashes[0] for h in hashes)}


def parameters() -> int:
    from diloco_p2p.config import load_config
    from diloco_p2p.model.build import build_model, build_tokenizer

    cfg = load_config(CONFIG, [])
    return sum(p.numel() for p in build_model(cfg.model, build_tokenizer(cfg.model).vocab_size, cfg.seed).parameters())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=2, help="M = the group size k")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--inner-steps", type=int, default=20, help="H")
    p.add_argument("--density", type=float, default=0.01, help="sync.topk_density")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--only", nargs="+", choices=list(SETTINGS), default=[n for n in SETTINGS if n != "int4+ef"],
                   help="wires to run (fp32, the reference, always runs); int4+ef is left out by default to stay "
                        "within 3 rounds of 2 jobs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--png", type=Path, default=Path("benchmarks/wire/results/compression.png"))
    p.add_argument("--json", type=Path, default=Path("benchmarks/wire/results/compression.json"))
    args = p.parse_args()
    common = [f"train.max_rounds={args.rounds}", f"outer.inner_steps={args.inner_steps}", "train.num_threads=1",
              f"train.eval_every={args.eval_every}", f"train.checkpoint_every={args.rounds}",
              f"sync.topk_density={args.density}", *args.overrides]
    names = ["fp32", *[n for n in args.only if n != "fp32"]]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diloco-compression-") as tmp, \
            concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {n: pool.submit(run, n, Path(tmp), args.replicas,
                                  [*common, *wire_overrides(n)])
                   for n in names}
        results = {n: f.result() for n, f in futures.items()}
    n_params, k = parameters(), args.replicas
    fp16 = payload_bytes(n_params, "fp16", k, args.density)
    for name, r in results.items():
        r["bytes_per_round"] = payload_bytes(n_params, SETTINGS[name][0], k, args.density)
        r["vs_fp32"] = r["final"] / results["fp32"]["final"] - 1
        r["fewer_than_fp16"] = fp16 / r["bytes_per_round"] if r["bytes_per_round"] else None
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {a: str(v) for a, v in vars(args).items()}, "parameters": n_params,
                                     "results": results}, indent=1))
    print(f"tiny model ({n_params:,} parameters), {CONFIG} {' '.join(args.overrides)}; M = k = {k} replicas, "
          f"{args.rounds} rounds x H={args.inner_steps}; topk density {args.density}; "
          f"{time.perf_counter() - start:.0f} s in all")
    print(f"{'wire':<10} {'eval loss':>9} {'vs fp32':>8} {'bytes/round/node':>17} {'fewer than fp16':>16} {'same θ':>7}")
    for name, r in results.items():
        fewer = f"{r['fewer_than_fp16']:.1f}x" if r["fewer_than_fp16"] else "-"
        print(f"{name:<10} {r['final']:>9.4f} {r['vs_fp32']:>+8.2%} {r['bytes_per_round']:>17,.0f} {fewer:>16} "
              f"{'yes' if r['identical'] else 'NO':>7}")
    plot(results, args.png)
    print(f"plot: {args.png}; runs: {args.json}")


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, r) in enumerate(results.items()):
        ax.plot(*zip(*r["curve"], strict=True), "-" if "topk" not in name else "--", color=f"C{i}",
                label=f"{name} ({r['final']:.3f})")
    ax.set_xlabel("round (equal tokens per round)")
    ax.set_ylabel("eval loss")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    finish(fig, ax, png)


if __name__ == "__main__":
    main()
