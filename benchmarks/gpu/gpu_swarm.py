"""A real swarm on one GPU box: a seed and N nodes (processes, loopback, fp16 unless --set) sharing the GPU.

Each round of each node is split from its own record: inner steps (`compute_seconds`),
matchmaking (the exposed time less the all-reduce), the all-reduce, the outer work
(`outer_seconds`: θ into the model, Δ back, the step, the hash) and the rest (evaluation,
checkpoint, records). Every round's θ hash must be the same on every node; the script exits 1
if not. ``--mixed`` runs node 0 on the GPU and the others on the CPU (tiny preset): the same
hashes across devices.

    python benchmarks/gpu/gpu_swarm.py [--nodes 3] [--rounds 5] [--preset 150m] [--inner-steps 20] [--mixed]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.*, tests.faults

from benchmarks.swarm.round_cost import local_seed, records, train  # noqa: E402
from tests.faults.injection import GATE_ENV  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--preset", default="150m")
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--mixed", action="store_true", help="node 0 on the GPU, the others on the CPU")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    if args.mixed:
        args.preset, args.seq, args.batch = "tiny", 128, 8
    common = [f"model.preset={args.preset}", f"inner.batch_size={args.batch}", f"inner.seq_len={args.seq}",
              f"outer.inner_steps={args.inner_steps}", f"train.max_rounds={args.rounds}", "inner.warmup_steps=10",
              "sync.compression=fp16", f"sync.min_group_size={args.nodes}", f"sync.target_group_size={args.nodes}",
              "train.eval_batches=2", "train.compile=false", "sync.matchmaking_timeout=60", "sync.allreduce_timeout=300", *args.overrides]
    devices = ["cuda"] + ["cpu" if args.mixed else "cuda"] * (args.nodes - 1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        gate = root / "start-gate"
        began = time.perf_counter()
        with local_seed(root) as maddrs:
            procs = [train(root / f"node-{i}", "configs/150m.yaml", [*common, f"train.device={d}"], maddrs[:1],
                           {GATE_ENV: str(gate)}) for i, d in enumerate(devices)]
            while len(list(root.glob("start-gate.ready-*"))) < args.nodes and all(p.poll() is None for p in procs):
                time.sleep(0.2)
            gate.touch()
            codes = [p.wait() for p in procs]
        if any(codes):
            for i in range(args.nodes):
                log = root / f"node-{i}" / "node.log"
                if log.exists():
                    sys.stderr.write(log.read_text()[-3000:])
            raise SystemExit(f"a node exited with {codes}")
        swarm = [records(root / f"node-{i}") for i in range(args.nodes)]
        wall = time.perf_counter() - began

    smi = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    name = subprocess.run(smi, capture_output=True, text=True).stdout.strip() if shutil.which(smi[0]) else "no GPU"
    settings = dict(o.split("=", 1) for o in common)  # a later --set wins
    sync = ", ".join(f"{k}={v}" for k, v in settings.items() if k.startswith("sync.") and not k.endswith(("timeout", "size")))
    print(f"{name}: seed + {args.nodes} nodes ({', '.join(devices)}), preset {args.preset}, H={args.inner_steps}, "
          f"batch {args.batch} x {args.seq}, {sync}, {args.rounds} rounds, {os.cpu_count()} CPU cores; {wall:.0f} s")
    print(f"{'round':>5} {'node':>4} {'device':>6} {'inner s':>8} {'matchm. s':>9} {'allred. s':>9} {'outer s':>8} "
          f"{'other s':>8} {'round s':>8} {'group':>5}  θ sha256")
    agree = True
    for r in range(1, args.rounds + 1):
        hashes = set()
        for i, node in enumerate(swarm):
            rec = node.get(r)
            if rec is None:
                print(f"{r:>5} {i:>4} no record")
                agree = False
                continue
            inner, ar, outer = rec["compute_seconds"] or 0.0, rec["allreduce_seconds"], rec["outer_seconds"] or 0.0
            mm = (rec["exposed_seconds"] or 0.0) - ar
            other = rec["seconds"] - inner - mm - ar - outer
            print(f"{r:>5} {i:>4} {devices[i]:>6} {inner:>8.2f} {mm:>9.3f} {ar:>9.3f} {outer:>8.3f} {other:>8.3f} "
                  f"{rec['seconds']:>8.2f} {rec['group_size']:>5}  {rec['params_sha256'][:16]}")
            hashes.add(rec["params_sha256"])
        agree &= len(hashes) == 1
    losses = [(swarm[0][0].get("eval_loss"), swarm[0][args.rounds].get("eval_loss"))] if 0 in swarm[0] else []
    if losses:
        print(f"node 0 eval loss: {losses[0][0]:.4f} -> {losses[0][1]:.4f}")
    print("θ identical on every node after every round" if agree else "θ DIFFERS between nodes")
    sys.exit(0 if agree else 1)


if __name__ == "__main__":
    main()
