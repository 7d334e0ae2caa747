"""Prototype, not a swarm feature: the inner optimizers' first moments averaged at every all-reduce.

At each committed round every replica hands in, beside its Δ, its inner first moments (Muon's
``momentum_buffer``, AdamW's ``exp_avg``), averaged on the same wire (`sync.compression`, the
swarm's partition and codec) and written back, so the next round's inner steps start from the
mean momentum, the one data-parallel would hold (MT-DAO's and the review's point that the inner
state drifts with the parameters). Twice the bytes of Δ per all-reduce. Runs `quality.py`'s
DiLoCo `--run` settings in this process (`diloco_p2p.planner.simulate`) and writes each result,
named ``<spec>:moments@s<seed>``, into `--json` beside that file's data-parallel runs, so
``quality.py --report`` tables it against them:

    python benchmarks/quality/moments.py --config configs/tiny-cpu.yaml --rounds 16 --h 30 \\
        --set inner.optimizer=muon --set inner.muon_lr=0.012 --seeds 0 \\
        --json benchmarks/quality/results/quality_tiny_moments.json --run 8:sched=qsr:h0=8:lr=1.0:mom=0
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.quality.quality import common, diloco_job, outcome, replica_keys  # noqa: E402
from diloco_p2p.config import load_config  # noqa: E402
from diloco_p2p.planner.simulate import Rendezvous, ReplicaSync, simulate  # noqa: E402

MOMENTS = ("momentum_buffer", "exp_avg")


def first_moments(trainer) -> list[torch.Tensor]:
    """The trainer's first-moment buffers, in its optimizers' parameter order."""
    out = []
    for optimizer in trainer.optimizers.values():
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                out += [state[k] for k in MOMENTS if k in state]
    return out


class MomentSync(ReplicaSync):
    """A replica's sync that averages its inner first moments after each committed Δ average."""

    def __init__(self, key: str, rendezvous: Rendezvous, moments: Rendezvous):
        super().__init__(key, rendezvous)
        self.moments, self.trainer = moments, None

    def average(self, round, delta, weight, params_hash):
        result = super().average(round, delta, weight, params_hash)
        if result.status == "committed":
            buffers = first_moments(self.trainer)
            flat = torch.cat([b.detach().reshape(-1).float() for b in buffers])
            mean = self.moments.average(self.peer_id, round, flat, 1.0)
            offset = 0
            for b in buffers:
                b.copy_(mean[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
        return result


def run(args: argparse.Namespace, spec: str, seed: int, batch: int) -> tuple[str, dict]:
    name, m, seed, sets, info = diloco_job(args, spec, seed)
    keys = replica_keys(m, seed)
    config = load_config(args.config, [f"outer.nodes={m}", *common(args, seed, batch), *sets])
    moments = Rendezvous(keys, config.sync)
    syncs = {}

    def make_sync(key: str, rendezvous: Rendezvous) -> MomentSync:
        moments.baton = rendezvous.baton  # the replicas' one baton: waiting on the moments hands it on
        syncs[key] = MomentSync(key, rendezvous, moments)
        return syncs[key]

    def attach(nodes: dict) -> None:
        for key, node in nodes.items():
            syncs[key].trainer = node.trainer

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diloco-moments-") as tmp:
        simulate(config, Path(tmp), keys, make_sync=make_sync, on_nodes=attach)
        result = outcome(Path(tmp) / keys[0], m)
    spec = f"{spec}:moments"
    return f"{spec}@s{seed}", {**result, "seconds": time.perf_counter() - start, **info, "spec": spec, "M": m,
                               "seed": seed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--h", type=int, default=30)
    p.add_argument("--eval-steps", type=int)
    p.add_argument("--run", nargs="+", required=True, help="quality.py's DiLoCo settings M[:key=value...]")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--json", type=Path, required=True, help="a quality.py results file; results are added to it")
    args = p.parse_args()
    torch.set_num_threads(1)
    state = json.loads(args.json.read_text()) if args.json.exists() else {"args": {}, "results": {}}
    batch = load_config(args.config, args.overrides).inner.batch_size
    for seed in args.seeds:
        for spec in args.run:
            name, result = run(args, spec, seed, batch)
            state["results"][name] = result
            args.json.write_text(json.dumps(state, indent=1))
            print(f"{name}: eval {result['final']:.4f}, {result['allreduces']} all-reduces "
                  f"({result['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
