"""Data at scale: prepare throughput, and start time / memory / tokens/s on prepared corpora.

Measured, in one run, on synthetic corpora (random words from a 20k-word vocabulary, in 4 MB
text files) of each size in ``--sizes-mb``:

1. ``prepare`` with the byte tokenizer: MB of text per second (in-process, so the
   interpreter's start is not counted), and per CPU-second of the process (all its threads):
   on a shared machine the wall time mostly waits for a core.
2. ``prepare`` with an 8k ByteLevel BPE trained here with ``tokenizers``, against that
   library's own ``encode_batch`` on the same text (``--bpe-mb`` of it), same process.
3. Training (the tiny preset, solo) on each prepared corpus vs on the default corpus (the
   in-memory path): seconds from the interpreter's start to the end of the first inner step
   (the fastest of ``--repeats`` fresh processes, interleaved) and peak RSS at that point.
4. Loader: tokens/s of inner steps fed from memory-mapped shards vs from in-memory tokens
   (the same windows), interleaved, and the loader's own time per batch.

    python benchmarks/data/data_scale.py [--sizes-mb 300 3000] [--bpe-mb 32] [--repeats 3] [--work DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MB = 1_000_000
# Peak RSS is the child's VmHWM (its own address space): getrusage's ru_maxrss would carry the
# parent's high-water mark across fork + exec.
_CHILD = r"""
import json, sys, time
t0 = float(sys.argv[1])
from diloco_p2p.config import load_config
from diloco_p2p.loop.node import Node
cfg = load_config(None, json.loads(sys.argv[2]))
node = Node(cfg, __import__("pathlib").Path(sys.argv[3]), progress=False)
node.trainer.step(node._next_batch)
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"first_step_s": time.time() - t0, "peak_rss_mb": int(hwm.split()[1]) / 1024}))
"""
TRAIN = ["model.preset=tiny", "inner.batch_size=8", "inner.seq_len=128", "train.num_threads=2", "train.device=cpu",
         "train.eval_batches=1", "data.order_key=bench"]


def make_corpus(directory: Path, size_mb: int, seed: int = 0) -> Path:
    """`size_mb` MB of random-word text in 4 MB files (reused if already there)."""
    directory.mkdir(parents=True, exist_ok=True)
    n_files = max(1, size_mb // 4)
    if len(list(directory.glob("*.txt"))) == n_files:
        return directory
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz", dtype=np.uint8)
    vocab = [bytes(letters[rng.integers(0, 26, rng.integers(1, 10))]) for _ in range(20_000)]
    words = [vocab[i] for i in rng.zipf(1.2, 3_000_000) % len(vocab)]
    base = b" ".join(words)
    base = (base * (1 + 5 * MB // len(base)))[: 5 * MB]
    for i in range(n_files):
        start = (i * 7919) % MB
        (directory / f"{i:05d}.txt").write_bytes(base[start : start + 4 * MB])
    return directory


def bench_prepare(corpus: Path, out: Path, tokenizer, identity) -> dict:
    from diloco_p2p.data.prepare import prepare

    shutil.rmtree(out, ignore_errors=True)
    cpu = time.process_time()  # every thread of this process: on a shared box, wall time waits for a core
    result = prepare([str(corpus)], out, tokenizer, identity, progress=False)
    cpu = time.process_time() - cpu
    return {"mb": result.text_bytes / MB, "seconds": result.seconds, "mb_s": result.text_bytes / MB / result.seconds,
            "tokens": result.manifest.total_tokens, "cpu_s": cpu, "mb_per_cpu_s": result.text_bytes / MB / cpu,
            "load_avg": os.getloadavg()[0]}


def train_bpe(corpus: Path, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<pad>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted(corpus.glob("*.txt"))[:2]], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>").save_pretrained(str(out))
    return out


def bench_bpe(corpus: Path, work: Path, bpe_mb: int, repeats: int = 2) -> dict:
    """prepare with the BPE vs the library's own ``encode_batch`` on the same documents, interleaved
    `repeats` times: the fastest wall time and the least CPU time of each."""
    from diloco_p2p.config import ModelConfig
    from diloco_p2p.data.encode import tokenizer_identity
    from diloco_p2p.model.build import build_tokenizer

    sample = work / "bpe-sample"
    sample.mkdir(exist_ok=True)
    for f in sorted(corpus.glob("*.txt"))[: max(1, bpe_mb // 4)]:
        if not (sample / f.name).exists():
            shutil.copy(f, sample / f.name)
    cfg = ModelConfig(tokenizer_path=str(train_bpe(sample, work / "bpe8k")))
    tok = build_tokenizer(cfg)
    # The library's own batch encoding of the same documents: the ceiling prepare is held to.
    backend = tok._tok.backend_tokenizer
    texts = [f.read_text() for f in sorted(sample.glob("*.txt"))]
    mb = sum(len(t.encode()) for t in texts) / MB
    lib, ours = [], []
    for _ in range(max(1, repeats)):
        wall, cpu = time.perf_counter(), time.process_time()
        backend.encode_batch(texts, add_special_tokens=False)
        lib.append((time.perf_counter() - wall, time.process_time() - cpu))
        r = bench_prepare(sample, work / "bpe-prepared", tok, tokenizer_identity(cfg, tok))
        ours.append((r["seconds"], r["cpu_s"]))
    lib_s, lib_cpu = min(w for w, _ in lib), min(c for _, c in lib)
    our_s, our_cpu = min(w for w, _ in ours), min(c for _, c in ours)
    return {"mb": mb, "lib_mb_s": mb / lib_s, "prepare_mb_s": mb / our_s, "ratio": lib_s / our_s,
            "lib_cpu_s": lib_cpu, "prepare_cpu_s": our_cpu, "cpu_ratio": lib_cpu / our_cpu, "repeats": repeats,
            "load_avg": os.getloadavg()[0]}


def first_step(run_dir: Path, overrides: list[str]) -> dict:
    """A fresh process: seconds from its start to the end of its first inner step, and its peak RSS."""
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", _CHILD, str(t0), json.dumps(TRAIN + overrides), str(run_dir)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_steps(work: Path, runs: dict[str, list[str]], repeats: int) -> dict[str, dict]:
    """`first_step` of each run, interleaved `repeats` times; the fastest start and the largest RSS."""
    seen: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, overrides in runs.items():
            seen[name].append(first_step(work / f"run-{name}", overrides))
    return {name: {"first_step_s": min(r["first_step_s"] for r in rs), "peak_rss_mb": max(r["peak_rss_mb"] for r in rs)}
            for name, rs in seen.items()}


def bench_loader(prepared: Path, steps: int = 30, repeats: int = 3) -> dict:
    """Inner steps fed from shards vs from the same tokens in memory, interleaved."""
    import torch

    from diloco_p2p.config import load_config
    from diloco_p2p.data.dataset import ArraySource, ShardSource, TokenDataset
    from diloco_p2p.data.manifest import Manifest
    from diloco_p2p.local.ranks import Ranks
    from diloco_p2p.loop.inner import InnerTrainer
    from diloco_p2p.model.build import ByteTokenizer, build_model

    torch.set_num_threads(2)
    cfg = load_config(None, TRAIN)
    shards = ShardSource(Manifest.load(prepared))
    n = min(len(shards), 64 * MB)
    memory = ArraySource(np.array(shards.slice(0, n), dtype=np.int32))
    sources = {"shards": shards, "memory": memory}
    model = build_model(cfg.model, ByteTokenizer.vocab_size, 0)
    trainer = InnerTrainer(model, cfg.inner, 10_000, torch.device("cpu"), "fp32", Ranks(torch.device("cpu")), None)
    times: dict[str, list[float]] = {k: [] for k in sources}
    loader: dict[str, list[float]] = {k: [] for k in sources}
    for _ in range(repeats):
        for name, source in sources.items():
            data = TokenDataset(source, cfg.inner.seq_len, 0.02, "bench")
            trainer.step(lambda d=data: d.next_batch(cfg.inner.batch_size))  # warm
            start = time.perf_counter()
            for _ in range(steps):
                trainer.step(lambda d=data: d.next_batch(cfg.inner.batch_size))
            times[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            for _ in range(200):
                data.next_batch(cfg.inner.batch_size)
            loader[name].append((time.perf_counter() - start) / 200)
    tokens = steps * cfg.inner.batch_size * cfg.inner.seq_len
    tps = {k: tokens / min(v) for k, v in times.items()}
    return {"shards_tok_s": tps["shards"], "memory_tok_s": tps["memory"], "ratio": tps["shards"] / tps["memory"],
            "loader_ms": {k: 1000 * min(v) for k, v in loader.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[300, 3000])
    p.add_argument("--bpe-mb", type=int, default=32)
    p.add_argument("--work", type=Path, default=None, help="where corpora and shards go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per start measurement (fastest kept)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "data_scale.json")
    args = p.parse_args()
    from diloco_p2p.config import ModelConfig
    from diloco_p2p.data.encode import tokenizer_identity
    from diloco_p2p.model.build import ByteTokenizer

    work = args.work or Path(tempfile.mkdtemp(prefix="data-scale-"))
    byte, ident = ByteTokenizer(), tokenizer_identity(ModelConfig(), ByteTokenizer())
    print(f"cores: {os.cpu_count()}, load average at start: {os.getloadavg()[0]:.1f}; work dir {work}")
    try:
        preps = {}
        for size in args.sizes_mb:
            corpus = make_corpus(work / f"corpus-{size}", size)
            preps[size] = bench_prepare(corpus, work / f"prepared-{size}", byte, ident)
            print(f"{size} MB: prepare {preps[size]['mb_s']:.0f} MB/s ({preps[size]['seconds']:.1f} s; "
                  f"{preps[size]['cpu_s']:.1f} CPU-s = {preps[size]['mb_per_cpu_s']:.0f} MB per CPU-second; "
                  f"load average {preps[size]['load_avg']:.1f})", flush=True)
        runs = {"default": [], **{str(size): [f"data.path={work / f'prepared-{size}'}"] for size in args.sizes_mb}}
        starts = first_steps(work, runs, args.repeats)
        default = starts["default"]
        rows = [(size, preps[size], starts[str(size)]) for size in args.sizes_mb]
        bpe = bench_bpe(work / f"corpus-{args.sizes_mb[0]}", work, args.bpe_mb, max(2, args.repeats))
        loader = bench_loader(work / f"prepared-{args.sizes_mb[0]}")
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\n| corpus | prepare (byte) | start to first inner step | peak RSS |")
    print("| --- | --- | --- | --- |")
    print(f"| default (in memory) | - | {default['first_step_s']:.2f} s | {default['peak_rss_mb']:.0f} MB |")
    for size, prep, run in rows:
        print(f"| {size} MB prepared | {prep['mb_s']:.0f} MB/s | {run['first_step_s']:.2f} s "
              f"({run['first_step_s'] - default['first_step_s']:+.2f}) | {run['peak_rss_mb']:.0f} MB "
              f"({run['peak_rss_mb'] - default['peak_rss_mb']:+.0f}) |")
    print(f"\nBPE 8k on {bpe['mb']:.0f} MB: tokenizers encode_batch {bpe['lib_mb_s']:.1f} MB/s, prepare "
          f"{bpe['prepare_mb_s']:.1f} MB/s = {bpe['ratio']:.2f}x (CPU-seconds {bpe['lib_cpu_s']:.1f} vs "
          f"{bpe['prepare_cpu_s']:.1f} = {bpe['cpu_ratio']:.2f}x; load average {bpe['load_avg']:.1f})")
    print(f"loader: {loader['shards_tok_s']:.0f} tok/s on shards vs {loader['memory_tok_s']:.0f} in memory = "
          f"{loader['ratio']:.3f}x; next_batch {loader['loader_ms']['shards']:.3f} ms (shards) vs "
          f"{loader['loader_ms']['memory']:.3f} ms (memory)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cores": os.cpu_count(), "prepare_byte": {str(k): v for k, v in preps.items()},
                                    "first_step": starts, "bpe": bpe, "loader": loader,
                                    "load_avg_end": os.getloadavg()}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
