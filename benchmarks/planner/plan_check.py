"""The round planner (`diloco_p2p.planner.plan`, `diloco-p2p plan`) against real swarms on shaped links.

Hosts are network namespaces on a bridge with tbf-shaped links (`tests/netns.py`, needs root),
as in `benchmarks/wire/allreduce_wan.py` and `benchmarks/wire/wan.py`, whose machinery this reuses. Stages
(each well under 10 minutes on two busy cores; run them in this order):

- ``calibrate``: all-reduces of `--numel` values on unshaped links (per-stream and fixed costs)
  and at each of `--cal-rates` Mbit (the wire and the slowest flow's tail, which grows as the
  rate falls) for k = 2, 4, 6, 8 peers; fits the `Calibration` constants by least squares
  (`fit`) and prints them. The shipped ones (`plan.Calibration`, the defaults the CLI uses) are
  `fit_file` of a quiet machine's results: these rows, and the matchmaking constant from the
  2-node ``rounds`` (run calibrate, allreduce, rounds, then report: `report` says whether a
  file's calibration made the shipped constants, and counts only the rows none was fitted on).
- ``allreduce``: at other rates (`--rates`, not the calibration's), k = 2, 4, 6, 8: predicted
  (shipped defaults) vs measured all-reduce seconds and bytes sent per peer, with the % error.
- ``rounds``: real training nodes (`tiny` model, a few rounds) in one group of k = 2, 4, 6 at
  `--round-rate`: predicted vs measured round seconds, given the measured compute of the round
  (the slowest member's inner steps; a planner's user states theirs), and bytes per node.
- ``curves``: predicted curves to 1,024 nodes (PNG, matplotlib from the `bench` extra).
- ``report``: every stored measurement again against the current constants (no network).
- ``holdout``: leave-one-rate-out and leave-one-k-out refits of the stored rows (no network).

Results accumulate in benchmarks/planner/results/plan_check.json (`--json`; one key per stage). The
shipped constants' file is plan_check_quiet.json (a quiet machine, load 0.5-3.8, the wire codecs
as they are now); plan_check_quiet_old_wire.json is the quiet file of the wire before its CPU
change (fp16 and int8 chunks 1.2-1.7x slower to encode and decode), kept as a record;
plan_check.json holds a busy machine's rows (load 6-14, the old wire too), whose calibrate rows
fit `LOAD_SHARE`.

    sudo python benchmarks/planner/plan_check.py calibrate|allreduce|rounds [--ks 2,4,6,8] [--json ...]
    python benchmarks/planner/plan_check.py report|holdout|curves [--json ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.*, tests.netns, tests.harness

from benchmarks.wire import allreduce_wan  # noqa: E402
from diloco_p2p.planner import plan  # noqa: E402
from diloco_p2p.swarm.collective import wire  # noqa: E402
from tests import netns  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CORES = 2  # the machine these checks ran on
LOAD_SHARE = 0.38  # of a core, per unit of load average beyond the k nodes: `fit_load` of plan_check.json's calibration


def _inputs(numel: int, rate: float, comp: str, k: int, group: int | None = None, load: float = 0.0,
            load_share: float | None = None, **kw) -> plan.Inputs:
    """The planner's inputs for a check on this machine: the k peers and the load average measured
    with them (`load`; other work, and ours) share `CORES` cores. CPU work takes 1 + `LOAD_SHARE` x
    max(0, load - k) times longer (`plan.Inputs.oversubscribe`): the k nodes themselves mostly wait
    for each other (on the quiet machine stream setup grew as k, not k^2), and a unit of load
    average is less than a busy core (it counts waiting processes; a 1-minute average). A
    volunteer's node has 1."""
    links, load_share = plan.Links(rate, rate), LOAD_SHARE if load_share is None else load_share
    return plan.Inputs(params=numel, step_seconds=1.0, uplink=links, downlink=links, rtt_ms=0.0,
                       scheme="grid" if group else "butterfly", group=group or max(k, 2), compression=comp,
                       oversubscribe=1 + load_share * max(load - k, 0.0), **kw)


def predicted_allreduce(numel: int, rate: float, comp: str, k: int, cal: plan.Calibration,
                        group: int | None = None, load: float = 0.0,
                        load_share: float | None = None) -> tuple[float, int]:
    """(seconds, bytes sent per peer) of one all-reduce: the butterfly, or the grid with rows of `group`."""
    inp = _inputs(numel, rate, comp, k, group, load, load_share)
    steps = plan.levels(inp, inp.scheme, k)
    return sum(sum(plan.level_seconds(x, inp, k, cal).values()) for x in steps), sum(x.sent for x in steps)


def run_allreduces(rate: float, ks: list[int], comps: list[str], numel: int, rounds: int,
                   grid: int | None = None) -> list[dict]:
    out = []
    with netns.Hosts(max(ks), rate_mbit=rate) as hosts:
        for k in ks:
            got = allreduce_wan.measure(hosts, k, comps, numel, rounds, wire.DEFAULT_CHUNK_ELEMENTS, grid)
            for key, r in got.items():
                comp, _, scheme = key.partition("/")
                out.append({"rate": rate, "k": k, "comp": comp, "scheme": scheme or "butterfly",
                            "grid": grid if scheme else None, "numel": numel,
                            "seconds": r["seconds"], "sent": r["sent"], "load": os.getloadavg()[0],
                            "at": round(time.time())})
                print(f"  measured {rate:g} Mbit k={k} {key}: {r['seconds']:.3f} s, {r['sent'] / 1e6:.3f} MB",
                      flush=True)
    return out


def _lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    import numpy as np

    solution, *_ = np.linalg.lstsq(np.array(rows), np.array(y), rcond=None)
    return [float(v) for v in solution]


FIT_TERMS = ("wire", "tail", "setup", "messages")  # CPU per byte and RTTs: not separable here (see `fit`)


def terms(m: dict) -> dict[str, float]:
    """The planner's unit time terms (`plan.time_terms`) of a measured all-reduce row, summed over its levels."""
    group = m.get("grid") if m.get("scheme") == "grid" else None
    inp = _inputs(m["numel"], m["rate"], m["comp"], m["k"], group, m.get("load", 0.0))
    out: dict[str, float] = {}
    for level in plan.levels(inp, inp.scheme, m["k"]):
        for term, x in plan.time_terms(level, inp, m["k"]).items():
            out[term] = out.get(term, 0.0) + x
    return out


def fit(rows: list[dict], source: str) -> plan.Calibration:
    """Least squares on relative error: every row's seconds = sum of `FIT_TERMS` x their constants,
    each row divided by its measured seconds (so a 0.1 s row counts as much as a 5 s one). The CPU
    per byte did not separate from the wire (int8, half the bytes, was as slow as fp16 unshaped),
    so it stays 0 and the flow overhead carries it; the test network has no delay, so the RTT
    count keeps its default."""
    fitted = list(FIT_TERMS)
    while True:  # non-negative: a term whose best weight is negative is dropped and the rest refitted
        solution = dict(zip(fitted, _lstsq([[terms(m)[t] / m["seconds"] for t in fitted] for m in rows],
                                           [1.0] * len(rows)), strict=True))
        negative = [t for t, v in solution.items() if v < 0]
        if not negative:
            break
        fitted.remove(min(negative, key=solution.__getitem__))
    return replace(plan.Calibration(), cpu_s_per_byte=0.0, source=source,
                   **{plan.TERMS[t]: solution.get(t, 0.0) for t in FIT_TERMS})


MATCHMAKING_K = 2  # training rounds of this many nodes calibrate the matchmaking; larger ones are held out


def fit_matchmaking(rounds: list[dict], cal: plan.Calibration) -> plan.Calibration:
    """`cal` with the matchmaking constant of the `MATCHMAKING_K`-node training rounds: the measured
    round seconds less its compute and the predicted all-reduce, per other member (mean over rows,
    at least 0); `cal` unchanged when there are none."""
    rows = [r for r in rounds if r["k"] == MATCHMAKING_K]
    if not rows:
        return cal
    bare = replace(cal, matchmaking_per_member_s=0.0)
    rest = [(r["measured"]["seconds"] - _round(r, bare).round_seconds) / (r["k"] - 1) for r in rows]
    return replace(cal, matchmaking_per_member_s=max(0.0, statistics.mean(rest)))


def fit_file(data: dict) -> plan.Calibration:
    """The constants a results file's calibration makes: `fit` of its calibrate rows (unshaped and
    shaped all-reduces), then `fit_matchmaking` of its 2-node training rounds."""
    calib = data["calibrate"]
    rows = calib["fast"] + calib["shaped"]
    rates = "+".join(sorted({f"{m['rate']:g}" for m in calib["shaped"]}, key=float))
    loads = [m["load"] for m in rows if "load" in m]
    source = (f"fitted by benchmarks/planner/plan_check.py calibrate (2-8 peers, {rows[0]['numel']:,} values, unshaped and "
              f"{rates} Mbit tbf links, load average {min(loads):.1f}-{max(loads):.1f} on {CORES} cores; "
              f"matchmaking: {MATCHMAKING_K}-node training rounds)")
    return fit_matchmaking(data.get("rounds", []), fit(rows, source))


def fit_load(rows: list[dict], cal: plan.Calibration) -> float:
    """`LOAD_SHARE`: the share of a core per unit of load beyond the k nodes that makes `cal` (fitted
    on a quiet machine) best predict `rows` measured on a busy one (least squares on relative
    error, 0 to 1 in steps of 0.01)."""
    def loss(share: float) -> float:
        return sum(((predicted_allreduce(m["numel"], m["rate"], m["comp"], m["k"], cal, None, m["load"], share)[0]
                     - m["seconds"]) / m["seconds"]) ** 2 for m in rows)

    return min((i / 100 for i in range(101)), key=loss)


def _write(key: str, value, path: Path = RESULTS / "plan_check.json") -> None:
    path.parent.mkdir(exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=1) + "\n")


def stage_calibrate(args) -> None:
    rates = "+".join(f"{r:g}" for r in args.cal_rates)
    print(f"calibration: {args.numel:,} values, unshaped and {rates} Mbit, k = {args.ks}")
    fast = run_allreduces(10_000.0, args.ks, args.comps, args.numel, args.rounds)
    shaped = [m for rate in args.cal_rates for m in run_allreduces(rate, args.ks, args.comps, args.numel, args.rounds)]
    cal = fit(fast + shaped, f"benchmarks/planner/plan_check.py calibrate (unshaped, {rates} Mbit, "
                             f"k = {','.join(map(str, args.ks))}, {args.numel:,} values)")
    print("fitted:", cal)
    _write("calibrate", {"fast": fast, "shaped": shaped, "fitted": asdict(cal)}, args.json)


def _row(name: str, pred: float, meas: float) -> str:
    return f"{pred:>9.3f} {meas:>9.3f} {100 * (pred - meas) / meas:>+7.1f}%"


def stage_allreduce(args) -> None:
    cal = plan.Calibration()
    print(f"all-reduce of {args.numel:,} values, k peers, predicted (calibration: {cal.source}) vs measured")
    print(f"{'Mbit/s':>6} {'k':>2} {'wire':>9} {'pred s':>9} {'meas s':>9} {'err':>8} {'pred MB':>9} "
          f"{'meas MB':>9} {'err':>8} {'load':>5}")
    rows = []
    for rate in args.rates:
        for m in run_allreduces(rate, args.ks, args.comps, args.numel, args.rounds, args.grid):
            group = args.grid if m["scheme"] == "grid" else None
            seconds, sent = predicted_allreduce(m["numel"], rate, m["comp"], m["k"], cal, group, m["load"])
            rows.append({**m, "pred_seconds": seconds, "pred_sent": sent,
                         "err_seconds": (seconds - m["seconds"]) / m["seconds"], "err_sent": (sent - m["sent"]) / m["sent"]})
            name = m["comp"] + ("/grid" if group else "")
            print(f"{rate:>6g} {m['k']:>2} {name:>9} {_row('s', seconds, m['seconds'])} "
                  f"{_row('MB', sent / 1e6, m['sent'] / 1e6)} {m['load']:>5.1f}", flush=True)
    path = args.json
    old = json.loads(path.read_text()).get("allreduce", []) if path.exists() else []
    done = {(x["rate"], x["k"], x["comp"], x["scheme"]) for x in rows}
    keep = [r for r in old if (r["rate"], r["k"], r["comp"], r.get("scheme", "butterfly")) not in done]
    _write("allreduce", keep + rows, args.json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["calibrate", "allreduce", "rounds", "curves", "report", "holdout"])
    parser.add_argument("--ks", default=None, help="group sizes, comma-separated (default 2,4,6,8; rounds 2,4,6)")
    parser.add_argument("--comps", default="fp16,int8")
    parser.add_argument("--numel", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=2, help="all-reduces (or training rounds) per configuration")
    parser.add_argument("--cal-rates", default="20,50", help="calibrate: shaped rates, comma-separated")
    parser.add_argument("--rates", default="100", help="allreduce: the check's rates (not the calibration's)")
    parser.add_argument("--round-rate", type=float, default=50.0)
    parser.add_argument("--grid", type=int, default=None, help="allreduce: also the grid all-reduce, rows of B")
    parser.add_argument("--json", type=Path, default=RESULTS / "plan_check.json", help="where results accumulate")
    parser.add_argument("--inner-steps", type=int, default=10, help="H of the training rounds")
    args = parser.parse_args()
    args.ks = [int(k) for k in (args.ks or ("2,4,6" if args.stage == "rounds" else "2,4,6,8")).split(",")]
    args.comps = args.comps.split(",")
    args.rates = [float(r) for r in args.rates.split(",")]
    args.cal_rates = [float(r) for r in args.cal_rates.split(",")]
    if args.stage in ("curves", "report", "holdout"):
        return {"curves": stage_curves, "report": stage_report, "holdout": stage_holdout}[args.stage](args)
    if not netns.available():
        raise SystemExit("benchmarks/planner/plan_check.py needs root and iproute2 (ip, tc) to make network namespaces")
    {"calibrate": stage_calibrate, "allreduce": stage_allreduce, "rounds": stage_rounds}[args.stage](args)


def run_rounds(hosts: netns.Hosts, k: int, args, root: Path) -> list[dict]:
    """k training nodes in one group: per round (past the first and before the last, which warm up and
    evaluate), the slowest member's compute, the median round and all-reduce seconds, bytes sent."""
    from tests.harness.procs import wait_until
    from tests.harness.swarm import ProcessSwarm

    overrides = [f"sync.compression={args.comps[0]}", f"train.max_rounds={args.rounds + 2}",
                 f"sync.target_group_size={k}", f"sync.min_group_size={k}", "sync.matchmaking_timeout=60",
                 "sync.allreduce_timeout=120", f"outer.inner_steps={args.inner_steps}", "train.eval_every=1000",
                 f"sync.link_mbit={args.round_rate}", "model.preset=tiny", "data.max_bytes=300000"]
    swarm = ProcessSwarm(root, seed_host=hosts[0])
    try:
        nodes = [swarm.node(f"n{i}", overrides, host=hosts[i + 1]) for i in range(k)]
        swarm.release(*nodes, timeout=300)
        for n in nodes:
            wait_until(lambda n=n: n.popen.poll() is not None, 500, f"{n.run_dir.name} to finish", n)
            assert n.popen.returncode == 0, n.tail()
        by_round: dict[int, list[dict]] = {}
        for n in nodes:
            for r in n.records():
                if r["status"] == "committed" and r["group_size"] == k and 1 < r["round"] < args.rounds + 2:
                    by_round.setdefault(r["round"], []).append(r)
        return [{"round": i, "compute": max(r["compute_seconds"] for r in rs),
                 "seconds": statistics.median(r["seconds"] for r in rs),
                 "allreduce": statistics.median(r["allreduce_seconds"] for r in rs),
                 "exposed": statistics.median(r["exposed_seconds"] for r in rs),
                 "sent": statistics.median(r["bytes_sent"] for r in rs)}
                for i, rs in sorted(by_round.items()) if len(rs) == k]
    finally:
        swarm.close()


ROUNDS_HEADER = (f"{'k':>2} {'rounds':>6} {'compute s':>9} {'pred s':>9} {'meas s':>9} {'err':>8} {'pred AR':>8} "
                 f"{'meas AR':>8} {'pred MB':>8} {'meas MB':>8} {'err':>7} {'load':>5}")


def _round(row: dict, cal: plan.Calibration) -> plan.Prediction:
    """The planner's round for a measured training row: its compute, k, rate, H. No load term: a
    training check's load average is mostly its own nodes' inner steps, which stop while they
    all-reduce."""
    inp = replace(_inputs(row["params"], row["rate"], row["comp"], row["k"]),
                  step_seconds=row["compute"] / row["inner_steps"], inner_steps=row["inner_steps"])
    return plan.predict_scheme(inp, row["k"], "butterfly", cal)


def predict_round(row: dict, cal: plan.Calibration) -> dict:
    """The planner's round for a measured row (`_round`), with the % errors; prints it."""
    p, meas = _round(row, cal), row["measured"]
    row = {**row, "predicted": p.as_dict(), "err_seconds": (p.round_seconds - meas["seconds"]) / meas["seconds"],
           "err_sent": (p.bytes_sent - meas["sent"]) / meas["sent"]}
    print(f"{row['k']:>2} {row['rounds']:>6} {row['compute']:>9.2f} {_row('s', p.round_seconds, meas['seconds'])} "
          f"{p.allreduce_seconds:>8.2f} {meas['allreduce']:>8.2f} {_row('MB', p.bytes_sent / 1e6, meas['sent'] / 1e6)} "
          f"{row['load']:>5.1f}", flush=True)
    return row


def stage_rounds(args) -> None:
    from benchmarks.model_sizes import parameters

    cal, comp = plan.Calibration(), args.comps[0]
    n = parameters(["model.preset=tiny"])
    print(f"training rounds, tiny model ({n:,} parameters), {comp}, H={args.inner_steps}, {args.round_rate:g} Mbit; "
          f"predicted = the slowest member's measured compute + the planner's communication ({cal.source})")
    print(ROUNDS_HEADER)
    rows = []
    for k in args.ks:
        with netns.Hosts(k + 1, rate_mbit=args.round_rate) as hosts, tempfile.TemporaryDirectory(prefix="pl-") as tmp:
            got = run_rounds(hosts, k, args, Path(tmp))
        assert got, f"no round averaged all {k} nodes"
        meas = {key: statistics.median(g[key] for g in got) for key in ("seconds", "allreduce", "exposed", "sent")}
        row = {"k": k, "rounds": len(got), "compute": statistics.median(g["compute"] for g in got), "params": n,
               "comp": comp, "rate": args.round_rate, "inner_steps": args.inner_steps, "load": os.getloadavg()[0],
               "measured": meas}
        rows.append(predict_round(row, cal))
    _write("rounds", rows, args.json)


def _report_allreduce(rows: list[dict], cal: plan.Calibration, role: str) -> list[dict]:
    out = []
    for m in rows:
        group = m.get("grid") if m.get("scheme") == "grid" else None
        seconds, sent = predicted_allreduce(m["numel"], m["rate"], m["comp"], m["k"], cal, group, m.get("load", 0.0))
        out.append({**m, "pred_seconds": seconds, "pred_sent": sent,
                    "err_seconds": (seconds - m["seconds"]) / m["seconds"], "err_sent": (sent - m["sent"]) / m["sent"]})
        name = m["comp"] + ("/grid" if group else "")
        print(f"{role:>5} {m['rate']:>6g} {m['k']:>2} {name:>9} {_row('s', seconds, m['seconds'])} "
              f"{_row('MB', sent / 1e6, m['sent'] / 1e6)} {m.get('load', float('nan')):>5.1f}")
    return out


def is_source(data: dict, cal: plan.Calibration) -> bool:
    """Whether `cal`'s fitted constants are what this results file's calibration makes (`fit_file`)."""
    if not data.get("calibrate"):
        return False
    fitted = fit_file(data)
    names = [plan.TERMS[t] for t in FIT_TERMS] + ["matchmaking_per_member_s"]
    return all(math.isclose(getattr(fitted, x), getattr(cal, x), rel_tol=0.01, abs_tol=1e-6) for x in names)


def held_out(data: dict, cal: plan.Calibration) -> list[float]:
    """% errors of the rows no constant was fitted on: the all-reduces at other rates than the
    calibration's, and the training rounds (but the `MATCHMAKING_K`-node ones in the file the
    constants came from, `is_source`). Calibrate rows are never held out: the source file's make
    `cal`, the busy file's (plan_check.json) make `LOAD_SHARE`."""
    source = is_source(data, cal)
    errs = []
    for m in data.get("allreduce", []):
        group = m.get("grid") if m.get("scheme") == "grid" else None
        seconds, _ = predicted_allreduce(m["numel"], m["rate"], m["comp"], m["k"], cal, group, m.get("load", 0.0))
        errs.append((seconds - m["seconds"]) / m["seconds"])
    for r in data.get("rounds", []):
        if not (source and r["k"] == MATCHMAKING_K):
            errs.append((_round(r, cal).round_seconds - r["measured"]["seconds"]) / r["measured"]["seconds"])
    return errs


def stage_report(args) -> None:
    """Re-predict every stored measurement with the current `plan.Calibration` (no network needed):
    the calibration's own rows (`cal`), then the held-out all-reduces (other rates, the grid) and
    training rounds (`check`), with how many held-out rows (`held_out`) are within 15%."""
    data = json.loads(args.json.read_text())
    cal = plan.Calibration()
    source = is_source(data, cal)
    print(f"constants: {cal}")
    print(f"this file's calibration {'made' if source else 'did not make'} them; calibrate rows (cal) are fitted "
          + ("(they and the 2-node rounds make the constants)" if source else "(the load share of a busy file's)")
          + f"; the rest is held out (check). Load: CPU work x (1 + {LOAD_SHARE} x max(0, load - k))")
    print(f"{'role':>5} {'Mbit/s':>6} {'k':>2} {'wire':>9} {'pred s':>9} {'meas s':>9} "
          f"{'err':>8} {'pred MB':>9} {'meas MB':>9} {'err':>8} {'load':>5}")
    calib = data.get("calibrate", {})
    _report_allreduce(calib.get("fast", []) + calib.get("shaped", []), cal, "cal")
    data["allreduce"] = _report_allreduce(data.get("allreduce", []), cal, "check")
    print("training rounds, predicted (given the measured compute) vs measured"
          + (f" (the {MATCHMAKING_K}-node rounds calibrate the matchmaking)" if source else ""))
    print(ROUNDS_HEADER)
    data["rounds"] = [predict_round(r, cal) for r in data.get("rounds", [])]
    errs = held_out(data, cal)
    within = sum(abs(e) <= 0.15 for e in errs)
    print(f"held out: {within} of {len(errs)} rows within 15% (worst {max(errs, key=abs, default=0):+.1%})")
    data["constants"] = dict(vars(cal))
    data["held_out_within_15"] = [within, len(errs)]
    args.json.write_text(json.dumps(data, indent=1) + "\n")


def _err(m: dict, cal: plan.Calibration) -> float:
    """% error of the planner's all-reduce (`m` measured) or training round (`m["measured"]`)."""
    if "measured" in m:
        return (_round(m, cal).round_seconds - m["measured"]["seconds"]) / m["measured"]["seconds"]
    group = m.get("grid") if m.get("scheme") == "grid" else None
    seconds, _ = predicted_allreduce(m["numel"], m["rate"], m["comp"], m["k"], cal, group, m.get("load", 0.0))
    return (seconds - m["seconds"]) / m["seconds"]


def holdout(data: dict) -> dict:
    """Leave-one-out over a results file: for each shaped rate, `fit` on every all-reduce at the
    other rates (the unshaped ones always: they are the CPU calibration) and predict that rate's
    rows; for each k, fit on the other k and predict its rows. The matchmaking constant comes from
    the 2-node rounds each time (`fit_matchmaking`); larger rounds are predicted by the fold that
    leaves out their rate, and their k. Returns, per row, the two held-out % errors."""
    calib = data["calibrate"]
    rows = calib["fast"] + calib["shaped"] + data.get("allreduce", [])
    rounds = data.get("rounds", [])
    shaped = sorted({m["rate"] for m in rows if m["rate"] < 10_000})
    out = {"by_rate": {}, "by_k": {}}
    for key, values, axis in (("by_rate", shaped, "rate"), ("by_k", sorted({m["k"] for m in rows}), "k")):
        for v in values:
            cal = fit_matchmaking(rounds, fit([m for m in rows if m[axis] != v], f"without {axis} {v:g}"))
            for i, m in enumerate(rows + rounds):
                if m[axis] == v and not ("measured" in m and m["k"] == MATCHMAKING_K):
                    out[key][i] = _err(m, cal)
    table = []
    for i, m in enumerate(rows + rounds):
        kind = "round" if "measured" in m else m["comp"] + ("/grid" if m.get("scheme") == "grid" else "")
        meas = m["measured"]["seconds"] if "measured" in m else m["seconds"]
        table.append({"rate": m["rate"], "k": m["k"], "what": kind, "seconds": meas, "load": m.get("load"),
                      "err_rate_out": out["by_rate"].get(i), "err_k_out": out["by_k"].get(i)})
    return {"rows": table}


def stage_holdout(args) -> None:
    """Print `holdout`'s table and how many held-out rows are within 15% (stored under "holdout")."""
    data = json.loads(args.json.read_text())
    got = holdout(data)

    def pct(e: float | None) -> str:
        return f"{100 * e:>+8.1f}%" if e is not None else f"{'(fitted)':>9}"

    print(f"leave-one-out on {args.json.name}: the planner's time model ({', '.join(FIT_TERMS)}) refitted without "
          "the row's rate (unshaped rows always fitted) or without its k")
    print(f"{'Mbit/s':>6} {'k':>2} {'what':>9} {'meas s':>8} {'rate out':>9} {'k out':>9} {'load':>5}")
    for r in got["rows"]:
        print(f"{r['rate']:>6g} {r['k']:>2} {r['what']:>9} {r['seconds']:>8.3f} {pct(r['err_rate_out'])} "
              f"{pct(r['err_k_out'])} {r['load'] or float('nan'):>5.1f}")
    for key in ("err_rate_out", "err_k_out"):
        errs = [r[key] for r in got["rows"] if r[key] is not None]
        got[key + "_within_15"] = [sum(abs(e) <= 0.15 for e in errs), len(errs)]
        print(f"{key}: {got[key + '_within_15'][0]} of {len(errs)} held-out rows within 15% "
              f"(worst {max(errs, key=abs):+.1%})")
    _write("holdout", got, args.json)


def stage_curves(args) -> None:
    """Predicted curves to 1,024 nodes for a 150M-parameter model on 20/100 Mbit volunteer links."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = tuple(2 ** i for i in range(2, 11))
    base = dict(params=150_000_000, step_seconds=0.5, inner_steps=500, uplink=plan.Links(20, 20),
                downlink=plan.Links(100, 100), rtt_ms=50.0)
    settings = [("butterfly fp16", dict(scheme="butterfly", compression="fp16")),
                ("grid fp16", dict(scheme="grid", compression="fp16")),
                ("grid int8", dict(scheme="grid", compression="int8")),
                ("grid int4", dict(scheme="grid", compression="int4")),
                ("grid int4 + eager", dict(scheme="grid", compression="int4", overlap="eager")),
                ("sparse top-k 1%", dict(scheme="sparse", compression="topk2", density=0.01)),
                ("grid fp16, 10-100 Mbit, spread 0.2, 1% failures",
                 dict(scheme="grid", uplink=plan.Links(10, 100), step_spread=0.2, fail_rate=0.01))]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    curves = {}
    for label, kw in settings:
        ps = plan.sweep(plan.Inputs(**{**base, **kw}), nodes)
        curves[label] = [p.as_dict() for p in ps]
        axes[0].plot(nodes, [p.round_seconds for p in ps], marker="o", label=label)
        axes[1].plot(nodes, [p.utilization for p in ps], marker="o", label=label)
        axes[2].plot(nodes, [p.bytes_sent / 1e6 for p in ps], marker="o", label=label)
    for ax, title in zip(axes, ("round seconds", "compute utilization", "MB sent per node per round"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes N")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle("diloco-p2p plan: 150M params, H=500 x 0.5 s, 20 Mbit up / 100 Mbit down, RTT 50 ms")
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    fig.savefig(RESULTS / "plan_curves.png", dpi=110)
    _write("curves", {"inputs": {k: str(v) for k, v in base.items()}, "curves": curves}, args.json)
    print(f"wrote {RESULTS / 'plan_curves.png'}")


if __name__ == "__main__":
    main()
