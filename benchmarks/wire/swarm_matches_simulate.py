"""One setting on a real swarm for a whole run, then `simulate` with the swarm's peer ids: the
same θ every round (so every quality figure `simulate` gives for that setting is the swarm's),
and a reference wire simulated on the same data orders, for the swarm's own gap.

Starts `diloco-p2p demo` (a seed and N real nodes on loopback: real DHT, p2pd, all-reduce) with
configs/tiny-cpu.yaml's values and the --set overrides, for R rounds; then runs `simulate` with
the first node's resolved config and the nodes' peer ids (which fix each node's data order), and
once more with the --reference overrides on top (default: the fp32 wire at the preset's outer
step). Prints, per evaluated round, the swarm's eval loss, whether every node's θ hash equals
simulate's, and the reference's eval loss; --json keeps the rows.

    python benchmarks/wire/swarm_matches_simulate.py [--nodes 2] [--rounds 40] [--set a.b=v ...]
        [--reference a.b=v ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml

from diloco_p2p.config import load_config
from diloco_p2p.ops.demo import run_demo
from diloco_p2p.planner.simulate import simulate
from diloco_p2p.swarm.transport.dht import peer_id_of

PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
REFERENCE = ["sync.compression=fp32", "outer.lr=0.7", "outer.momentum=0.3", "sync.error_feedback=null",
             "sync.feedback_decay=1.0", "sync.feedback_carry=null"]


def preset_overrides(path: Path) -> list[str]:
    """The preset's values as `--set` overrides (the demo takes no config file)."""
    def flat(tree: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in tree.items():
            name = f"{prefix}{key}"
            out += flat(value, name + ".") if isinstance(value, dict) else [f"{name}={json.dumps(value)}"]
        return out
    return flat(yaml.safe_load(path.read_text()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--reference", action="append", default=None, metavar="A.B=VALUE",
                   help="overrides of the reference run on top of the swarm's config (default: fp32 at 0.7/0.3)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="diloco-swarm-sim-"))
    preset = [o for o in preset_overrides(PRESET) if not o.startswith("train.max_rounds=")]  # --rounds
    extra = [*preset, f"train.max_rounds={args.rounds}", *args.overrides]
    if run_demo(args.nodes, args.rounds, root / "swarm", extra) != 0:
        raise SystemExit(f"the swarm failed; logs in {root / 'swarm'}")
    dirs = [root / "swarm" / f"node-{i}" for i in range(args.nodes)]
    swarm = [{r["round"]: r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())} for d in dirs]
    keys = [peer_id_of(d / "identity.key") for d in dirs]
    config = dirs[0] / "config.yaml"
    simulated = simulate(load_config(config, []), root / "sim", keys)
    reference = simulate(load_config(config, args.reference or REFERENCE), root / "ref", keys)
    rows = []
    for round_ in range(args.rounds + 1):
        ours = swarm[0][round_]
        rows.append({
            "round": round_, "status": [s[round_]["status"] for s in swarm], "eval": ours["eval_loss"],
            "same_theta": len({s[round_]["params_sha256"] for s in swarm}
                              | {rec[round_].params_sha256 for rec in simulated.values()}) == 1,
            "simulate_eval": simulated[keys[0]][round_].eval_loss, "reference_eval": reference[keys[0]][round_].eval_loss,
        })
    print(f"{'round':>5} {'statuses':<24} {'swarm eval':>10} {'simulate':>9} {'same θ':>6} {'reference':>9} {'vs ref':>7}")
    for r in rows:
        if r["eval"] is None:
            continue
        gap = f"{r['eval'] / r['reference_eval'] - 1:+.2%}" if r["reference_eval"] else "-"
        print(f"{r['round']:>5} {'/'.join(r['status']):<24} {r['eval']:>10.4f} {r['simulate_eval']:>9.4f} "
              f"{'yes' if r['same_theta'] else 'NO':>6} {r['reference_eval']:>9.4f} {gap:>7}")
    print(f"every round, every node: θ as simulate's: {'yes' if all(r['same_theta'] for r in rows) else 'NO'}; "
          f"bytes sent per round by node-0: {swarm[0][args.rounds].get('bytes_sent')}")
    if args.json:
        args.json.write_text(json.dumps({"overrides": args.overrides, "reference": args.reference or REFERENCE,
                                         "nodes": args.nodes, "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
