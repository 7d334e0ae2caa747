"""A 3-node swarm on loopback vs one node with the same per-node batch, same rounds.

Runs `diloco-p2p demo` (a seed and N nodes, real processes) and a solo node with the demo's
settings, then prints per round: eval loss of the swarm and of the solo node, bytes each swarm
node sent against the all-reduce lower bound 2(k-1)/k * bytes/value * parameters, and the
all-reduce seconds. The swarm trains on N times the tokens per round: that is the point of
adding nodes, and what the comparison shows.

    python benchmarks/swarm/swarm_vs_solo.py [--nodes 3] [--rounds 8] [--set a.b=v ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from diloco_p2p.config import load_config
from diloco_p2p.model.build import build_model, build_tokenizer, count_parameters
from diloco_p2p.ops.demo import DEMO_OVERRIDES

SWARM_ONLY = ("sync.", "p2p.")
BYTES_PER_VALUE = {"fp32": 4, "fp16": 2, "int8": 1}


def records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["round"]: r for r in map(json.loads, lines)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        demo = [sys.executable, "-m", "diloco_p2p", "demo", "--nodes", str(args.nodes), "--rounds",
                str(args.rounds), "--dir", str(root / "swarm")]
        subprocess.run(demo + [a for o in args.overrides for a in ("--set", o)], check=True)
        swarm = [records(root / "swarm" / f"node-{i}") for i in range(args.nodes)]
        solo_overrides = [o for o in DEMO_OVERRIDES if not o.startswith(SWARM_ONLY)]
        solo_overrides += [f"train.max_rounds={args.rounds}", *args.overrides]
        subprocess.run([sys.executable, "-m", "diloco_p2p", "train", "--run-dir", str(root / "solo"),
                        "--log-level", "WARNING", *[a for o in solo_overrides for a in ("--set", o)]], check=True)
        solo = records(root / "solo")
    cfg = load_config(None, solo_overrides)
    params = count_parameters(build_model(cfg.model, build_tokenizer(cfg.model).vocab_size, cfg.seed))
    k = args.nodes
    compression = swarm[0][1]["compression"]
    bound = 2 * (k - 1) / k * BYTES_PER_VALUE[compression] * params
    print(f"{params:,} parameters, {k} nodes, compression {compression}: "
          f"lower bound {bound / 1e6:.3f} MB sent per node per round")
    print(f"{'round':>5} {'swarm eval':>10} {'solo eval':>9} {'sent/bound (min..max)':>22} {'allreduce s (mean)':>18}")
    ratios, seconds = [], []
    for r in range(args.rounds + 1):
        ev = [n[r].get("eval_loss") for n in swarm if r in n]
        sent = [n[r].get("bytes_sent", 0) / bound for n in swarm if r in n and r > 0]
        secs = [n[r].get("allreduce_seconds", 0.0) for n in swarm if r in n and r > 0]
        ratios += sent
        seconds += secs
        span = f"{min(sent):.4f}..{max(sent):.4f}" if sent else "-"
        mean_s = f"{statistics.mean(secs):.3f}" if secs else "-"
        solo_ev = solo.get(r, {}).get("eval_loss")
        print(f"{r:>5} {ev[0]:>10.4f} {solo_ev:>9.4f} {span:>22} {mean_s:>18}")
    print(f"bytes sent / lower bound: mean {statistics.mean(ratios):.4f}; all-reduce seconds: median "
          f"{statistics.median(seconds):.3f}, max {max(seconds):.3f}")
    print(f"final eval loss: swarm {swarm[0][args.rounds]['eval_loss']:.4f} ({k} nodes) vs solo "
          f"{solo[args.rounds]['eval_loss']:.4f} (untrained {solo[0]['eval_loss']:.4f})")


if __name__ == "__main__":
    main()
