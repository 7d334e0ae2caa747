"""What a reducer's quoted samples catch, and what they cost (issue 48 item 4: a reducer that scales
its part by any factor).

Runs `diloco-p2p simulate`'s replicas (`diloco_p2p.planner.simulate`, the swarm's arithmetic) on
`configs/tiny-cpu.yaml` and keeps every round's real pseudo-gradients. On every part of every
round, in each dense wire format, it reduces the part as a reducer does, quotes it
(`swarm.collective.samples`), and counts:

- **honest**: parts the quotes refute (should be 0) and contributors that find their own values
  misquoted (should be 0);
- **scaled by c**: parts whose output × c (re-encoded, the same bytes to every member) the quotes
  refute, for c from 0.5 to 2 (1 - c down to 0.1%).

Then the cost at the 150m preset's state size (about 150M values, 4 members: a part of 37.5M):
the reducer's quoting and one member's checks of one part, and the bytes the quotes add.

    python benchmarks/swarm/quotes.py [--m 4] [--rounds 8] [--inner-steps 20] [--seeds 0]

Prints the tables; writes benchmarks/swarm/results/quotes.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from diloco_p2p.swarm.collective import aggregate, samples, wire  # noqa: E402

CONFIG = "configs/tiny-cpu.yaml"
FACTORS = (0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.001, 1.01, 1.05, 1.1, 1.25, 2.0)
COMPRESSIONS = ("fp32", "fp16", "int8", "int4")
CHUNK = wire.DEFAULT_CHUNK_ELEMENTS


def rounds_of(m: int, seed: int, args) -> list[list[torch.Tensor]]:
    """Every round's pseudo-gradients of an honest simulated run."""
    from diloco_p2p.config import load_config
    from diloco_p2p.planner import simulate as sim

    sets = [f"train.max_rounds={args.rounds}", f"outer.inner_steps={args.inner_steps}", "train.num_threads=1",
            f"train.eval_every={args.rounds}", f"train.checkpoint_every={args.rounds}", "inner.seq_len=64", f"seed={seed}"]
    kept, original = [], sim.wire_average

    def keep(deltas, *a, **kw):
        kept.append([d.clone() for d in deltas])
        return original(deltas, *a, **kw)

    sim.wire_average = keep
    try:
        with tempfile.TemporaryDirectory(prefix="diloco-quotes-") as tmp:
            sim.simulate(load_config(CONFIG, sets), Path(tmp), [f"replica-{i}" for i in range(m)])
    finally:
        sim.wire_average = original
    return kept


def check_part(xs: list[torch.Tensor], weights: list[float], compression: str, robust) -> dict:
    numel = xs[0].numel()
    ranges = wire.chunk_ranges(numel, CHUNK)
    contribs = {j: (w, [wire.encode(x[a:b], compression) for a, b in ranges]) for j, (x, w) in enumerate(zip(xs, weights, strict=True))}
    norms = {j: aggregate.encoded_norm(x, CHUNK, compression) for j, x in enumerate(xs)}
    out = aggregate.reduce_part(robust, contribs, norms, 64.0, numel, CHUNK, compression)[3]
    offsets = samples.places("g", 0, "0" * 32, numel)
    rows = torch.stack([samples.at(contribs[j][1], numel, CHUNK, compression, offsets) for j in contribs])

    def refuted(output: torch.Tensor) -> bool:
        allowed = samples.quantum(output, CHUNK, compression, offsets)
        return samples.refuted(robust, weights, rows, output[torch.from_numpy(offsets)], allowed) is not None

    return {
        "honest_refuted": refuted(out),
        "honest_misquoted": sum(samples.misquoted(weights, rows, j, weights[j], samples.sent(x, CHUNK, compression, offsets))
                                for j, x in enumerate(xs)),
        "caught": {c: refuted(wire.roundtrip(out * c, compression, CHUNK)) for c in FACTORS},
    }


def cost(numel: int, k: int, compression: str, reps: int = 3) -> dict:
    """Seconds of the reducer's quoting and of one member's checks, for one part of `numel` values."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(numel, generator=g) for _ in range(k)]
    ranges = wire.chunk_ranges(numel, CHUNK)
    chunks = {j: [wire.encode(x[a:b], compression) for a, b in ranges] for j, x in enumerate(xs)}
    out = torch.cat([wire.decode(wire.encode(sum(x[a:b] for x in xs) / k, compression), b - a, compression)
                     for a, b in ranges])
    quote_s, check_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        offsets = samples.places("g", 0, "0" * 32, numel)
        frame = samples.pack([1.0] * k, torch.stack([samples.at(chunks[j], numel, CHUNK, compression, offsets)
                                                     for j in range(k)]))
        t1 = time.perf_counter()
        weights, rows = samples.unpack(frame, k, numel)
        allowed = samples.quantum(out, CHUNK, compression, offsets)
        samples.refuted(aggregate.MEAN, weights, rows, out[torch.from_numpy(offsets)], allowed)
        samples.misquoted(weights, rows, 0, 1.0, samples.sent(xs[0], CHUNK, compression, offsets))
        samples.digest("0" * 32, frame)
        t2 = time.perf_counter()
        quote_s.append(t1 - t0)
        check_s.append(t2 - t1)
    return {"quote_s": min(quote_s), "check_s": min(check_s), "frame_bytes": len(frame)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--cost-values", type=int, default=150_000_000 // 4, help="values of one part for the cost")
    args = ap.parse_args()
    torch.set_num_threads(1)

    robust = aggregate.Robust(max_norm_ratio=8.0, weight_cap=4.0)
    table = {c: {"parts": 0, "honest_refuted": 0, "honest_misquoted": 0, "caught": dict.fromkeys(FACTORS, 0)}
             for c in COMPRESSIONS}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for r, deltas in enumerate(rounds_of(args.m, seed, args)):
            weights = [1000.0 + 37.0 * ((j * 7 + r) % 5) for j in range(args.m)]  # uneven, as tokens are
            for lo, hi in wire.partition(deltas[0].numel(), args.m):
                for c in COMPRESSIONS:
                    got, row = check_part([d[lo:hi] for d in deltas], weights, c, robust), table[c]
                    row["parts"] += 1
                    row["honest_refuted"] += got["honest_refuted"]
                    row["honest_misquoted"] += got["honest_misquoted"]
                    for f in FACTORS:
                        row["caught"][f] += got["caught"][f]

    print(f"\nhonest rounds of tiny-cpu, M={args.m}, {args.rounds} rounds of H={args.inner_steps}, seeds {args.seeds}: "
          f"parts whose quotes refute them, out of the parts tried")
    print(f"{'wire':>5} {'parts':>6} {'honest refuted':>15} {'honest misquoted':>17} | "
          + " ".join(f"x{f:<6g}" for f in FACTORS))
    for c, row in table.items():
        print(f"{c:>5} {row['parts']:>6} {row['honest_refuted']:>15} {row['honest_misquoted']:>17} | "
              + " ".join(f"{row['caught'][f] / row['parts']:>7.0%}" for f in FACTORS))

    costs = {c: cost(args.cost_values, args.m, c) for c in ("fp16", "int8")}
    print(f"\ncost for one part of {args.cost_values:,} values with {args.m} contributors (one thread)")
    for c, got in costs.items():
        print(f"{c:>5}: reducer quotes in {got['quote_s'] * 1e3:.1f} ms, a member checks in {got['check_s'] * 1e3:.1f} ms, "
              f"{got['frame_bytes']} bytes per member ({got['frame_bytes'] / (wire.bytes_per_element(c) * args.cost_values):.2e} "
              "of the part)")
    out = Path(__file__).resolve().parent / "results" / "quotes.json"
    out.write_text(json.dumps({"args": vars(args), "table": {c: {**row, "caught": {str(f): n for f, n in row["caught"].items()}}
                                                          for c, row in table.items()}, "cost": costs}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
