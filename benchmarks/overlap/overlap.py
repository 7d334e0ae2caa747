"""Communication hidden behind compute (`sync.overlap`): quality at equal tokens, and the seconds
of communication a round still exposes on a shaped link.

`quality`: M replicas in one process (`diloco-p2p simulate`, the swarm's arithmetic, exact) on
`configs/tiny-cpu.yaml`, the same rounds x H inner steps and held-out eval set, with
``sync.overlap`` none (blocking), delayed (Eager Updates Algorithm 2), eager (Algorithm 3) and
inner (Streaming DiLoCo's inner-step overlap; `--set sync.overlap_steps=TAU` fixes its τ here, where
the replicas take turns and "as soon as known" has no meaning).
Prints the final eval loss of each and its difference to blocking (goal: eager within 1%).

`link`: k real nodes on hosts of a test network (`tests/netns.py`: namespaces on a bridge, every
link token-bucket shaped in both directions, needs root). The rate is chosen so the blocking
all-reduce costs about 30% of a round: a short blocking run on a fast link measures the compute
seconds per round and the bytes, and the rate follows from the all-reduce's measured ratio to
wire time (`--rate` fixes it instead). Then one run per mode at that rate; per mode, medians
over the steady rounds (blocking: every committed round; overlapped: the rounds that applied
the previous round's average, i.e. not the first (nothing to apply) nor the last (it drains the
pipeline, blocking)): round seconds, compute seconds, all-reduce seconds, exposed seconds (the
loop stood still for the swarm), exposed as a share of the round (goal: <= 3% with overlap). A mode written MODE@WIRE runs on another
wire than the default (fp16): ``inner@int4+ef`` is inner with the int4 wire and error feedback, at the
rate calibrated for the default's blocking all-reduce. MODE/P runs Streaming DiLoCo's ``sync.fragments=P``
with rounds of H/P inner steps and P times the rounds (each part still syncs every H steps): ``inner/5``.
Exposed seconds also hold the wait for the slower node of the group, overlap or not.

    python benchmarks/overlap/overlap.py quality [--replicas 2] [--rounds 12] [--inner-steps 25] [--set a.b=v ...]
    sudo python benchmarks/overlap/overlap.py link [--k 2] [--rounds 6] [--inner-steps 20] [--rate MBIT] [--share 0.3]
                                           [--modes none,delayed,eager,inner,inner@int4+ef,inner/5] [--section S]
    sudo python benchmarks/overlap/overlap.py all

Results go to benchmarks/overlap/results/overlap.json (`quality` keyed by M, rounds and H; `link` replaced),
and the eval-loss curves to benchmarks/overlap/results/overlap_quality_<key>.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.*, tests.netns, tests.harness

from benchmarks.quality.quality import simulate  # noqa: E402
from benchmarks.wire.compression import wire_overrides  # noqa: E402

RESULTS = Path("benchmarks/overlap/results/overlap.json")
CONFIG = "configs/tiny-cpu.yaml"


def quality(args: argparse.Namespace, earlier: dict | None = None) -> dict:
    """Runs the modes of `args.modes` and the variants; runs of `earlier` (the same key) are kept."""
    common = [f"train.max_rounds={args.rounds}", f"outer.inner_steps={args.inner_steps}", "train.num_threads=1",
              f"train.eval_every={args.eval_every}", f"train.checkpoint_every={args.rounds}", *args.overrides]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        jobs = {mode: [f"sync.overlap={mode}"] for mode in args.modes.split(",") if mode}
        for variant in args.variants:  # MODE:OUTER_LR:MOMENTUM, e.g. the paper's lowered lr for delayed
            mode, lr, mom = variant.split(":")
            jobs[variant] = [f"sync.overlap={mode}", f"outer.lr={lr}", f"outer.momentum={mom}"]
        keys = [f"replica-{i}" for i in range(args.replicas)]  # quality.simulate takes the order keys
        futures = {name: pool.submit(simulate, CONFIG, keys, [*common, *sets]) for name, sets in jobs.items()}
        runs = {mode: f.result() for mode, f in futures.items()}
    runs = {**(earlier or {}).get("runs", {}), **runs}
    base = runs["none"]["final"]
    tokens = runs["none"]["curve"][-1][0]
    print(f"quality: {args.replicas} replicas, {args.rounds} rounds x H={args.inner_steps}, {tokens:,} tokens in all, "
          f"{' '.join(args.overrides)}; {time.perf_counter() - start:.0f} s")
    print(f"{'overlap':>16} {'eval loss':>10} {'vs blocking':>12}")
    for mode, r in runs.items():
        print(f"{mode:>16} {r['final']:>10.4f} {r['final'] / base - 1:>+12.2%}")
    return {"args": {k: v for k, v in vars(args).items() if k != "func"}, "tokens": tokens,
            "runs": {m: {"final": r["final"], "vs_blocking": r["final"] / base - 1, "curve": r["curve"],
                         "seconds": r["seconds"]} for m, r in runs.items()}}


def swarm_run(hosts, k: int, mode: str, rounds: int, extra: list[str], rate: float) -> list[list[dict]]:
    from benchmarks.wire.wan import run_nodes

    overrides = [f"sync.overlap={mode}", f"train.max_rounds={rounds}", f"sync.target_group_size={k}",
                 "sync.matchmaking_timeout=30", "sync.allreduce_timeout=120", f"sync.link_mbit={rate}",
                 "train.eval_every=100000", "train.eval_batches=1", "train.checkpoint_every=100000", *extra]
    with tempfile.TemporaryDirectory(prefix="overlap-wan-") as tmp:
        return run_nodes(hosts, k, overrides, Path(tmp))


def steady(per_node: list[list[dict]], mode: str, rounds: int, k: int) -> dict:
    """Medians over the steady rounds of every node (see the module docstring)."""
    if mode == "none":
        keep = [r for recs in per_node for r in recs if r["status"] == "committed" and r["group_size"] == k]
    else:
        keep = [r for recs in per_node for r in recs if r.get("applied_round") is not None
                and r["applied_round"] == r["round"] - 1 and r["status"] == "committed" and r["group_size"] == k]
    assert keep, f"{mode}: no steady committed round of all {k} nodes"
    med = {key: statistics.median(r[key] for r in keep)
           for key in ("seconds", "compute_seconds", "allreduce_seconds", "exposed_seconds", "bytes_sent")}
    med["exposed_share"] = statistics.median(r["exposed_seconds"] / r["seconds"] for r in keep)
    med["allreduce_share"] = statistics.median(r["allreduce_seconds"] / r["seconds"] for r in keep)
    med["rounds"] = len(keep) // k
    if mode == "inner":  # τ: the inner step after which the average landed
        med["landed_step"] = statistics.median(r["landed_step"] for r in keep)
    hashes = [{recs_r["round"]: recs_r["params_sha256"] for recs_r in recs} for recs in per_node]
    med["theta_agrees"] = all(h == hashes[0] for h in hashes[1:])
    return med


def link(args: argparse.Namespace) -> dict:
    from tests import netns

    if not netns.available():
        raise SystemExit("benchmarks/overlap/overlap.py link needs root and iproute2 (ip, tc) to make network namespaces")
    extra = [f"outer.inner_steps={args.inner_steps}", *args.overrides]
    rate = args.rate
    if rate is None:  # calibrate: compute seconds and bytes per round, blocking, on a fast link
        with netns.Hosts(args.k + 1, rate_mbit=1000) as hosts:
            cal = steady(swarm_run(hosts, args.k, "none", 3, extra, 1000), "none", 3, args.k)
        ratio = 1.5  # all-reduce seconds over wire time at tens of Mbit/s (benchmarks/wire/wan.py)
        target = args.share / (1 - args.share) * cal["compute_seconds"]
        rate = round(cal["bytes_sent"] * 8 * ratio / target / 1e6, 1)
        print(f"calibration: {cal['compute_seconds']:.2f} s compute/round, {cal['bytes_sent'] / 1e6:.3f} MB sent; "
              f"{rate} Mbit/s for a blocking all-reduce of ~{args.share:.0%} of a round")
    out = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "rate_mbit": rate, "modes": {}}
    print(f"link: {args.k} nodes, {rate} Mbit/s each way, H={args.inner_steps}, {args.rounds} rounds; medians over "
          "steady rounds")
    print(f"{'overlap':>14} {'round s':>8} {'compute s':>9} {'all-reduce s':>12} {'exposed s':>9} {'exposed %':>9} "
          f"{'all-reduce %':>12} {'θ agrees':>8} {'MB sent':>8}")
    with netns.Hosts(args.k + 1, rate_mbit=rate) as hosts:
        for entry in args.modes.split(","):
            mode, _, wire = entry.partition("@")  # MODE@WIRE: another wire than the default's, e.g. inner@int4+ef
            mode, _, fragments = mode.partition("/")  # MODE/P: sync.fragments=P, rounds of H/P steps, P x the rounds
            p = int(fragments or 1)
            wired = [*(wire_overrides(wire) if wire else []), f"sync.fragments={p}", f"outer.inner_steps={args.inner_steps // p}"]
            m = steady(swarm_run(hosts, args.k, mode, args.rounds * p, [*extra, *wired], rate), mode, args.rounds * p, args.k)
            m["mbytes_sent"] = m["bytes_sent"] / 1e6
            out["modes"][entry] = m
            print(f"{entry:>14} {m['seconds']:>8.2f} {m['compute_seconds']:>9.2f} {m['allreduce_seconds']:>12.2f} "
                  f"{m['exposed_seconds']:>9.2f} {m['exposed_share']:>9.1%} {m['allreduce_share']:>12.1%} "
                  f"{m['theta_agrees']!s:>8} {m['mbytes_sent']:>8.3f}" + (f"  landed after {m['landed_step']:g} of {args.inner_steps // p} steps"
                                                  if "landed_step" in m else ""), flush=True)
    return out


def plot(result: dict, key: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode, r in result["runs"].items():
        ax.plot(*zip(*r["curve"], strict=True), "-o", ms=3, label=f"{mode} ({r['vs_blocking']:+.1%})")
    ax.set_xlabel("total tokens")
    ax.set_ylabel("eval loss (global θ)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.set_title(f"sync.overlap, {key}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"plot: {png}")


def save(section: str, result: dict, key: str | None = None) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if key is None:
        data[section] = result
    else:
        data.setdefault(section, {})[key] = result
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["quality", "link", "all"])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rounds", type=int, default=None, help="quality: 12; link: 6")
    p.add_argument("--inner-steps", type=int, default=None, help="H (quality: 25; link: 20)")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--k", type=int, default=2, help="link: nodes in the group")
    p.add_argument("--rate", type=float, default=None, help="link: Mbit/s (default: calibrated for --share)")
    p.add_argument("--share", type=float, default=0.3, help="link: the blocking all-reduce's share of a round")
    p.add_argument("--modes", default="none,delayed,eager,inner", help="the overlap modes to run (quality keeps the "
                   "runs of other modes already in the results for the same M, rounds and H)")
    p.add_argument("--variants", nargs="*", default=[], metavar="MODE:LR:MOMENTUM",
                   help="quality: extra runs with another outer lr and momentum, e.g. eager:1.0:0.5")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--section", default="link", help="link: where in the results the run goes (replacing it)")
    args = p.parse_args()
    if args.part in ("quality", "all"):
        q = argparse.Namespace(**vars(args))
        q.rounds, q.inner_steps = args.rounds or 12, args.inner_steps or 25
        key = f"M{q.replicas}-R{q.rounds}xH{q.inner_steps}"
        earlier = json.loads(RESULTS.read_text()).get("quality", {}).get(key) if RESULTS.exists() else None
        result = quality(q, earlier)
        save("quality", result, key)
        plot(result, key, RESULTS.with_name(f"overlap_quality_{key}.png"))
    if args.part in ("link", "all"):
        w = argparse.Namespace(**vars(args))
        w.rounds, w.inner_steps = args.rounds or 6, args.inner_steps or 20
        save(args.section, link(w))
    print(f"results: {RESULTS}")


if __name__ == "__main__":
    main()
