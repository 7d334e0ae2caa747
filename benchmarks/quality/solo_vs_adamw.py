"""Single-node DiLoCo (M=1, the config's outer Nesterov step) vs plain AdamW on the same tokens.

With outer.lr=1 and outer.momentum=0 the outer step copies the inner parameters back, so the
run is plain AdamW. Both runs use the same config, seed and data order; the script prints the
eval loss after every round for both, side by side.

    python benchmarks/quality/solo_vs_adamw.py [--config configs/tiny-cpu.yaml] [--set a.b=v ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(config: str, overrides: list[str], run_dir: Path) -> list[dict]:
    args = [sys.executable, "-m", "diloco_p2p", "train", "--config", config, "--run-dir", str(run_dir),
            "--log-level", "WARNING"]
    for o in overrides + ["data.order_key=benchmark"]:
        args += ["--set", o]
    subprocess.run(args, check=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        diloco = run(args.config, args.overrides, Path(tmp) / "diloco")
        adamw = run(args.config, args.overrides + ["outer.lr=1.0", "outer.momentum=0.0"], Path(tmp) / "adamw")
    print(f"{'round':>5} {'tokens':>9} {'DiLoCo M=1':>11} {'AdamW':>8}")
    for d, a in zip(diloco, adamw, strict=True):
        ev = lambda r: f"{r['eval_loss']:.4f}" if r["eval_loss"] is not None else "-"  # noqa: E731
        print(f"{d['round']:>5} {d['tokens']:>9} {ev(d):>11} {ev(a):>8}")
    print(f"final eval loss: DiLoCo {diloco[-1]['eval_loss']:.4f}  AdamW {adamw[-1]['eval_loss']:.4f}  "
          f"(untrained {diloco[0]['eval_loss']:.4f})")


if __name__ == "__main__":
    main()
