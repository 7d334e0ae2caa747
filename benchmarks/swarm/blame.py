"""What honest rounds look like to the two checks that blame by measure (issue 48 item 4).

Runs `diloco-p2p simulate`'s replicas (`diloco_p2p.planner.simulate`, the swarm's arithmetic) on
`configs/tiny-cpu.yaml` for each M and inner optimizer and seed, and at every round, on every part
of the all-reduce's partition (fp16, as the wire carries it), measures:

- **direction** (`aggregate.direction_scores`, the reducer's `opposed` check): the honest senders'
  pairwise cosines (``pair``), each honest sender's cosine with the mean direction of the others; and, with the last member's Δ sign-flipped
  (what a flipper sends; the scores ignore weights and norms), the flipped sender's cosine and the
  honest senders' beside it. ``caught`` / ``false``: parts where `aggregate.opposed` at the
  threshold leaves out exactly the flipper / leaves out anyone in an honest group.
- **scale** (`aggregate.small_parts`, the members' check on a reducer): each part's ratio
  ||average|| / (lower median of its contributors' norms) over the lower median of the other
  parts' ratios (the check drops a part below ``--min-part-ratio``), and the same with the
  references a lying member cannot tilt (its proof); ``shrunk``: rounds where one part × 0.001 is
  dropped and proven on every part tried; ``honest dropped``: honest parts `small_parts` drops.
- **framing** (no training): what a sender that knew the others' contributions before sending
  could do to an honest member's score (`framed_score`), by how much the honest members agree.

With ``--set sync.average_moments=true`` the moments' all-reduce of each round is measured apart
(rows ``... moments``) from the Δ's.

    python benchmarks/swarm/blame.py [--ms 3,4,8] [--optimizers adamw,muon] [--seeds 0,1]
        [--rounds 16] [--inner-steps 20] [--threshold T] [--min-part-ratio R] [--set a.b=v ...] [--no-train]

It first prints what the direction check adds to a reducer's arithmetic per value, and the
framing table (neither trains anything: ``--no-train`` stops there, in about a minute).

Prints the table; writes benchmarks/swarm/results/blame.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from diloco_p2p.swarm.collective import aggregate, wire  # noqa: E402

CONFIG = "configs/tiny-cpu.yaml"
SHRINK = 1e-3


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


class Recorder:
    """Wraps `simulate.wire_average`: the statistics of each round's Δs, then the real average."""

    def __init__(self, original, threshold: float, min_ratio: float, compression: str, moments: bool = False):
        self.original, self.threshold, self.min_ratio, self.compression = original, threshold, min_ratio, compression
        self.stats = self.empty()
        # sync.average_moments: every round's Δ all-reduce is followed by the moments' (simulate's
        # replicas meet for one before any trains on), so the calls alternate, Δ first
        self.moments_stats = self.empty() if moments else None
        self.calls = 0

    @staticmethod
    def empty() -> dict:
        return {"pairwise": [], "honest": [], "flipped": [], "beside_flip": [], "caught": 0, "false": 0, "parts": 0,
                "scale": [], "scale_proof": [], "shrunk_dropped": 0, "shrunk_proven": 0, "shrunk_tried": 0,
                "honest_dropped": 0}

    def __call__(self, deltas, weights, compression, max_weight_ratio, chunk=wire.DEFAULT_CHUNK_ELEMENTS,
                 robust=aggregate.MEAN, density=0.01):
        moments = self.moments_stats is not None and self.calls % 2 == 1
        self.calls += 1
        self.measure(deltas, chunk, self.moments_stats if moments else self.stats)
        return self.original(deltas, weights, compression, max_weight_ratio, chunk, robust, density)

    def measure(self, deltas, chunk: int, st: dict) -> None:
        m, n = len(deltas), deltas[0].numel()
        averages, stated = {}, {i: [] for i in range(m)}
        mean = aggregate.Robust(max_norm_ratio=8.0, weight_cap=4.0)
        for p, (lo, hi) in enumerate(wire.partition(n, m)):
            ranges = wire.chunk_ranges(hi - lo, chunk)
            chunks = {i: [wire.encode(d[lo + a:lo + b], self.compression) for a, b in ranges] for i, d in enumerate(deltas)}
            norms = {i: aggregate.encoded_norm(d[lo:hi], chunk, self.compression) for i, d in enumerate(deltas)}
            for i in range(m):
                stated[i].append(aggregate.stated(norms[i]))
            values = aggregate.reduce_part(mean, {i: (1.0, chunks[i]) for i in range(m)}, norms, 16.0, hi - lo, chunk,
                                           self.compression)[3]
            averages[p] = aggregate.part_sumsq(values, chunk) ** 0.5
            g = aggregate.part_gram(list(range(m)), chunks, ranges, self.compression)
            if m >= aggregate.OPPOSED_MIN:
                st["parts"] += 1
                d = g.diagonal().sqrt()
                st["pairwise"] += [float(g[i, j] / (d[i] * d[j])) for i in range(m) for j in range(i)]
                st["honest"] += list(aggregate.direction_scores(g, range(m)).values())
                st["false"] += bool(aggregate.opposed(g, range(m), self.threshold))
                flip = torch.ones(m, dtype=torch.float64)
                flip[-1] = -1
                scores = aggregate.direction_scores(g * flip[:, None] * flip[None, :], range(m))
                st["flipped"].append(scores[m - 1])
                st["beside_flip"] += [scores[i] for i in range(m - 1)]
                st["caught"] += aggregate.opposed(g * flip[:, None] * flip[None, :], range(m), self.threshold) == [m - 1]
        contributors = {p: list(range(m)) for p in averages}
        ratios = {}
        for p in averages:
            values = sorted(stated[i][p] for i in range(m))
            ratios[p] = (averages[p] / wire.lower_median(values), averages[p] / values[0], averages[p] / values[-1])
        for p in ratios:
            others = [q for q in ratios if q != p]
            if others:
                st["scale"].append(ratios[p][0] / wire.lower_median([ratios[q][0] for q in others]))
                st["scale_proof"].append(ratios[p][1] / wire.lower_median([ratios[q][2] for q in others]))
        st["honest_dropped"] += len(aggregate.small_parts(list(averages), stated, contributors, averages, self.min_ratio))
        for p in averages:  # each part shrunk in turn
            shrunk = {**averages, p: averages[p] * SHRINK}
            caught = aggregate.small_parts(list(averages), stated, contributors, shrunk, self.min_ratio)
            st["shrunk_tried"] += 1
            st["shrunk_dropped"] += list(caught) == [p]
            st["shrunk_proven"] += list(caught) == [p] and caught[p].proven


def framed_score(m: int, cosine: float, steps: int = 800, restarts: int = 5) -> float:
    """The lowest score an attacker that knew the other contributions could give honest member 0
    while scoring no lower itself (so the check would leave member 0 out first): m - 1 honest unit
    vectors with pairwise `cosine`, the attacker's direction optimised (Adam, a few restarts)."""
    gen = torch.Generator().manual_seed(0)
    honest = torch.zeros(m - 1, m + 1, dtype=torch.float64)
    honest[:, 0] = cosine ** 0.5
    for i in range(m - 1):
        honest[i, i + 1] = (1 - cosine) ** 0.5

    def scores(c: torch.Tensor, a: int) -> torch.Tensor:
        others = [b for b in range(m) if b != a]
        return c[a, others].sum() / c[others][:, others].sum().clamp_min(len(others)).sqrt()

    best = 1.0
    for _ in range(restarts):
        v = torch.randn(m + 1, dtype=torch.float64, generator=gen).requires_grad_()
        opt = torch.optim.Adam([v], lr=0.05)
        for _ in range(steps):
            x = torch.cat([honest, (v / v.norm())[None]])
            c = x @ x.T
            victim, attacker = scores(c, 0), scores(c, m - 1)
            loss = victim + 10 * torch.relu(victim - attacker + 0.01)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            x = torch.cat([honest, (v / v.norm())[None]])
            got = aggregate.direction_scores(x @ x.T, range(m))
        if got[0] <= got[m - 1]:
            best = min(best, got[0])
    return best


def cost(ms: list[int], reps: int = 50) -> dict[int, tuple[float, float]]:
    """ns per contribution value of one 65,536-value fp16 chunk: the mean's reduce, and the inner
    products the direction check adds (`aggregate.chunk_gram`), one thread."""
    n, out = wire.DEFAULT_CHUNK_ELEMENTS, {}
    for m in ms:
        gen = torch.Generator().manual_seed(m)
        chunks = [wire.encode(torch.randn(n, generator=gen), "fp16") for _ in range(m)]
        timed = []
        for f in (lambda chunks=chunks: aggregate.reduce_chunk(aggregate.MEAN, [(1.0, c) for c in chunks], n, "fp16"),
                  lambda chunks=chunks: aggregate.chunk_gram(chunks, n, "fp16")):
            f()
            start = time.perf_counter()
            for _ in range(reps):
                f()
            timed.append((time.perf_counter() - start) / reps / (m * n) * 1e9)
        out[m] = (timed[0], timed[1])
    return out


def run_one(m: int, optimizer: str, seed: int, args) -> dict:
    from diloco_p2p.config import load_config
    from diloco_p2p.planner import simulate as sim

    sets = [f"train.max_rounds={args.rounds}", f"outer.inner_steps={args.inner_steps}", "train.num_threads=1",
            f"train.eval_every={args.rounds}", f"train.checkpoint_every={args.rounds}", "inner.seq_len=64",
            f"inner.optimizer={optimizer}", f"seed={seed}", *args.overrides]
    config = load_config(CONFIG, sets)
    recorder = Recorder(sim.wire_average, args.threshold, args.min_part_ratio, config.sync.compression,
                        moments=config.sync.average_moments and m > 1)
    sim.wire_average = recorder
    try:
        with tempfile.TemporaryDirectory(prefix="diloco-blame-") as tmp:
            sim.simulate(config, Path(tmp), [f"replica-{i}" for i in range(m)])
    finally:
        sim.wire_average = recorder.original
    return {"": recorder.stats, " moments": recorder.moments_stats}


def main() -> None:
    from diloco_p2p.config import SyncConfig

    defaults = SyncConfig()
    p = argparse.ArgumentParser()
    p.add_argument("--ms", type=lambda v: [int(x) for x in v.split(",")], default=[3, 4, 8])
    p.add_argument("--optimizers", type=lambda v: v.split(","), default=["adamw", "muon"])
    p.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--inner-steps", type=int, default=20, help="H")
    p.add_argument("--threshold", type=float, default=defaults.opposed_cosine)
    p.add_argument("--min-part-ratio", type=float, default=defaults.min_part_ratio)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--json", type=Path, default=Path("benchmarks/swarm/results/blame.json"))
    p.add_argument("--no-train", action="store_true", help="only the tables that need no training: the "
                   "direction check's cost per value and the framing table")
    args = p.parse_args()
    torch.set_num_threads(1)
    print("cost, ns per contribution value (one 65,536-value fp16 chunk, one thread): m, the mean's reduce, "
          "the direction check's inner products")
    for m, (reduce_ns, gram_ns) in cost(args.ms).items():
        print(f"{m:<4} {reduce_ns:>8.2f} {gram_ns:>8.2f}")
    cosines = (0.1, 0.2, 0.3, 0.4, 0.5)
    framing = {m: [framed_score(m, c) for c in cosines] for m in args.ms}
    print(f"\nframing: the lowest score an attacker knowing the others' contributions gives an honest member "
          f"while scoring above it (left out if below {args.threshold}), by the honest pairwise cosine:")
    print(f"{'m':<4}" + "".join(f"{c:>8}" for c in cosines))
    for m, row in framing.items():
        print(f"{m:<4}" + "".join(f"{v:>8.3f}" for v in row))
    if args.no_train:
        return
    start, rows = time.perf_counter(), {}
    for m in args.ms:
        for optimizer in args.optimizers:
            runs = [run_one(m, optimizer, seed, args) for seed in args.seeds]
            for suffix in runs[0]:
                if runs[0][suffix] is None:
                    continue
                kept = [r[suffix] for r in runs]
                rows[f"M={m} {optimizer}{suffix}"] = {k: (sum((r[k] for r in kept), []) if isinstance(kept[0][k], list)
                                                          else sum(r[k] for r in kept)) for k in kept[0]}
            print(f"done M={m} {optimizer} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    print(f"\ntiny-cpu, {args.rounds} rounds x H={args.inner_steps}, seeds {args.seeds}, fp16; every round, every part")
    print(f"direction (cosine with the others' mean direction), threshold {args.threshold}:")
    print(f"{'group':<20} {'parts':>5} {'pair min':>8} {'pair p1':>7} {'honest min':>10} {'p1':>7} {'median':>7} "
          f"{'flipped max':>11} {'beside min':>10} {'caught':>7} {'false':>5}")
    for name, r in rows.items():
        if not r["honest"]:
            continue
        h, pair = r["honest"], r["pairwise"]
        print(f"{name:<20} {r['parts']:>5} {min(pair):>8.3f} {percentile(pair, 0.01):>7.3f} {min(h):>10.3f} "
              f"{percentile(h, 0.01):>7.3f} {statistics.median(h):>7.3f} {max(r['flipped']):>11.3f} "
              f"{min(r['beside_flip']):>10.3f} {r['caught']:>3}/{r['parts']:<3} {r['false']:>5}")
    print(f"\nscale (a part's ||average||/norms over the other parts' lower median), min_part_ratio {args.min_part_ratio}:")
    print(f"{'group':<20} {'parts':>5} {'min':>7} {'p1':>7} {'median':>7} {'proof min':>9} {'x0.001 dropped':>14} "
          f"{'proven':>7} {'honest dropped':>14}")
    for name, r in rows.items():
        s = r["scale"]
        print(f"{name:<20} {len(s):>5} {min(s):>7.3f} {percentile(s, 0.01):>7.3f} {statistics.median(s):>7.3f} "
              f"{min(r['scale_proof']):>9.3f} {r['shrunk_dropped']:>6}/{r['shrunk_tried']:<7} {r['shrunk_proven']:>7} "
              f"{r['honest_dropped']:>14}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                     "framing": {str(m): dict(zip(map(str, cosines), row, strict=True))
                                                 for m, row in framing.items()},
                                     "seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
