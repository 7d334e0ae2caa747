"""benchmarks/swarm/churn.py's numbers: what the round records say (pure), and the report: the table
(.txt), the plot (.png) and the goodput, from its JSON.

    python benchmarks/swarm/churn.py --report benchmarks/swarm/results/churn_4n.json   # again, without running
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

CONFIG = "configs/tiny-cpu.yaml"
SCENARIO = [  # issue 36: the churn soak
    "run_id=churn", "outer.inner_steps=20", "sync.target_group_size=4", "sync.allreduce_timeout=15",
    "sync.matchmaking_timeout=5", "train.max_rounds=1000", "p2p.reachability=public",
]
RESTART_FAILED_S = 120.0  # a restart with no committed round this long after it (or whose process exited) failed
ROUND_STATUSES = ("committed", "alone", "failed")  # rounds that trained (a resync record times a download)
COMPARABLE = 0.15  # the two runs' inner steps may differ this much in time (the machine's load) to compare them


# -- what the records say (pure) -------------------------------------------------------------


def committed(seen: list[dict]) -> list[dict]:
    return [r for r in seen if r["status"] == "committed"]


def forks(seen: list[dict], nodes: int) -> tuple[list[int], list[int]]:
    """Rounds whose committed records hold more than one θ, and among them the rounds where two
    members of one group disagree: two records of different nodes whose group sizes add up to
    more than `nodes` (disjoint groups could not hold them both)."""
    by_round: dict[int, list[dict]] = defaultdict(list)
    for r in committed(seen):
        by_round[r["round"]].append(r)
    forked, disagree = [], []
    for rnd, rs in sorted(by_round.items()):
        if len({r["params_sha256"] for r in rs}) < 2:
            continue
        forked.append(rnd)
        if any(a["node"] != b["node"] and a["params_sha256"] != b["params_sha256"]
               and a["group_size"] + b["group_size"] > nodes for a in rs for b in rs):
            disagree.append(rnd)
    return forked, disagree


def highest(seen: list[dict]) -> int:
    return max((r["round"] for r in committed(seen)), default=0)


def eval_at(seen: list[dict], rnd: int) -> float | None:
    """Mean eval loss of the committed records of round `rnd`."""
    losses = [r["eval_loss"] for r in committed(seen) if r["round"] == rnd and r["eval_loss"] is not None]
    return statistics.fmean(losses) if losses else None


def progress(seen: list[dict], end: float | None = None) -> list[tuple[float, int]]:
    """(time, highest committed round so far) at each new highest (and at `end`)."""
    curve, top = [(0.0, 0)], 0
    for r in sorted(committed(seen), key=lambda r: r["t"]):
        if r["round"] > top:
            top = r["round"]
            curve.append((r["t"], top))
    return curve if end is None else [*curve, (end, top)]


def median_round_s(seen: list[dict], keep: Callable[[dict], bool] = lambda r: True,
                   field: str = "seconds") -> float | None:
    times = [r[field] for r in seen if r["status"] in ROUND_STATUSES and keep(r) and r.get(field) is not None]
    return statistics.median(times) if times else None


def away_windows(log: list[dict], end: float) -> list[tuple[int, float, float]]:
    """(node, from, to) of each fault that fired: from the fault to the node's first committed round after it."""
    return [(f["node"], f["fired"], f["back"] if f.get("back") is not None else end)
            for f in log if f.get("fired") is not None]


def restart_failed(f: dict, end: float) -> bool | None:
    """A restart failed if its process exited, or it committed no round within RESTART_FAILED_S
    (None: the run ended before that, with no committed round yet)."""
    if f.get("exit_code_after_restart") is not None:
        return True
    if f.get("back") is not None:
        return f["back"] - f["ended"] > RESTART_FAILED_S
    return True if end - f["ended"] > RESTART_FAILED_S else None


def summarize(seen: list[dict], nodes: int, seconds: float, log: list[dict]) -> dict:
    forked, disagree = forks(seen, nodes)
    top = highest(seen)
    windows = away_windows(log, seconds)

    def others_away(r: dict) -> bool:
        return any(r["node"] != k and a <= r["t"] <= b for k, a, b in windows)

    def nobody_away(r: dict) -> bool:
        return not any(a <= r["t"] <= b for _, a, b in windows)

    restarts = [f for f in log if f["kind"] in ("kill", "term") and f.get("ended") is not None]
    count = defaultdict(int)
    for r in seen:
        count[r["status"]] += 1
    return {
        "committed": count["committed"], "highest_round": top, "forks": forked, "group_disagreements": disagree,
        "resyncs": count["resynced"], "alone": count["alone"], "failed": count["failed"],
        "eval_loss": eval_at(seen, top),
        "median_round_s": median_round_s(seen),
        # the inner steps alone: how much CPU the nodes got (a busier machine makes them slower)
        "median_compute_s": median_round_s(seen, field="compute_seconds"),
        "median_round_s_others_while_away": median_round_s(seen, others_away) if windows else None,
        "median_round_s_nobody_away": median_round_s(seen, nobody_away) if windows else None,
        "faults": sum(1 for f in log if f.get("fired") is not None),
        "faults_skipped": sum(1 for f in log if f.get("fired") is None),
        "restarts": len(restarts),
        "failed_restarts": sum(1 for f in restarts if f.get("restart_failed")),
        "restarts_not_back_by_the_end": sum(1 for f in restarts if f.get("back") is None),
    }


# -- the report ------------------------------------------------------------------------------


def _f(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(result: dict) -> str:
    runs, a = result["runs"], result["args"]
    names = [k for k in ("clean", "faults") if k in runs]
    s = {k: runs[k]["summary"] for k in names}
    head = (f"churn: {a['nodes']} nodes, {a['minutes']:g} min a run, seed {a['seed']}, faults {a['faults']} "
            f"every {a['interval']} s; {CONFIG} + {' '.join(SCENARIO + a['set'])}")
    rows = [
        ("committed node-rounds", "committed", "{}"),
        ("highest committed round", "highest_round", "{}"),
        ("forks (rounds with 2+ θ)", "forks", None),
        ("  of which one group disagrees", "group_disagreements", None),
        ("resyncs", "resyncs", "{}"),
        ("alone / failed rounds", None, None),
        ("eval loss at the highest round", "eval_loss", "{:.4f}"),
        ("median round s, all", "median_round_s", "{:.2f}"),
        ("median round s, others while one away", "median_round_s_others_while_away", "{:.2f}"),
        ("median round s, nobody away", "median_round_s_nobody_away", "{:.2f}"),
        ("median inner steps s a round", "median_compute_s", "{:.2f}"),
        ("faults fired (skipped)", None, None),
        ("restarts (failed)", None, None),
    ]
    lines = [head, f"{'':40}" + "".join(f"{'no faults' if k == 'clean' else 'faults':>12}" for k in names)]
    for label, key, fmt in rows:
        cells = []
        for k in names:
            v = s[k]
            if label.startswith("alone"):
                cells.append(f"{v['alone']} / {v['failed']}")
            elif label.startswith("faults fired"):
                cells.append(f"{v['faults']} ({v['faults_skipped']})")
            elif label.startswith("restarts"):
                cells.append(f"{v['restarts']} ({v['failed_restarts']})")
            elif fmt is None:
                cells.append(str(len(v[key])))
            else:
                cells.append(_f(v[key], fmt))
        lines.append(f"{label:40}" + "".join(f"{c:>12}" for c in cells))
    if len(names) == 2:
        c, f = s["clean"], s["faults"]
        lines.append(f"goodput (faults / no faults): {f['committed'] / max(c['committed'], 1):.1%}; "
                     f"no-faults eval loss at round {f['highest_round']}: "
                     f"{_f(eval_at(runs['clean']['records'], f['highest_round']), '{:.4f}')}")
        if c["median_compute_s"] and f["median_compute_s"] and \
                abs(f["median_compute_s"] / c["median_compute_s"] - 1) > COMPARABLE:
            lines.append(f"NOT COMPARABLE: the inner steps took {c['median_compute_s']:.2f} s a round without faults "
                         f"and {f['median_compute_s']:.2f} s with them: the machine's load differed between the "
                         f"runs (more than {COMPARABLE:.0%}); run again on a quieter machine")
    for k in names:
        load = [x for _, x in runs[k]["load"]]
        if load:
            lines.append(f"{'no faults' if k == 'clean' else 'faults'}: load average (1 min) median "
                         f"{statistics.median(load):.1f}, max {max(load):.1f} on {os.cpu_count()} cores")
    if "faults" in runs:
        log = runs["faults"]["faults"]
        lines += ["", "restarts: node kind  restart s  first commit s  round  records until it",]
        for f in log:
            if f["kind"] in ("kill", "term") and f.get("ended") is not None:
                lines.append(f"  n{f['node']} {f['kind']:>4} {f['ended']:>10.1f} {_f(f.get('to_commit_s'), '{:.1f}'):>15}"
                             f" {_f(f.get('first_round'), '{}'):>6}  {','.join(f.get('records_to_commit', []))}"
                             + ("  FAILED" if f.get("restart_failed") else
                                "  not back by the end of the run" if f.get("back") is None else ""))
        lines += ["", "faults: at s  node kind       fired s  ended s  back s  notes"]
        for f in log:
            notes = [f.get("note", ""), f.get("skipped", "")]
            if f.get("ended") is not None and f.get("back") is None:
                notes.append("no committed round by the end of the run")
            if f["kind"] == "kill":
                notes.append(f"main exit {f.get('main_exit')}")
            if f["kind"] == "term":
                notes.append(f"exited {_f(f.get('exit_s'), '{:.1f}')} s after SIGTERM")
            if f["kind"] in ("kill", "term"):
                notes.append(f"exit {f.get('exit_code')}, helpers alive at restart {len(f.get('helpers_left', []))}, "
                             f"left after reap {len(f.get('left_after_reap', []))}")
            node = "-" if f["node"] is None else f"n{f['node']}"
            lines.append(f"  {f['at']:8.1f}  {node:>4} {f['kind']:<9} {_f(f['fired'], '{:8.1f}'):>8} "
                         f"{_f(f.get('ended'), '{:8.1f}'):>8} {_f(f.get('back'), '{:7.1f}'):>7}  "
                         + "; ".join(n for n in notes if n))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no plot", flush=True)
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    colors = {"kill": "tab:red", "term": "tab:orange", "stop": "tab:purple", "partition": "tab:brown"}
    for name, run in result["runs"].items():
        curve = progress(run["records"], result["args"]["minutes"] * 60)
        ax.step([t / 60 for t, _ in curve], [r for _, r in curve], where="post",
                label=f"{'no faults' if name == 'clean' else 'faults'} ({run['summary']['committed']} committed node-rounds)")
    labelled = set()
    for f in result["runs"].get("faults", {}).get("faults", []):
        if f.get("fired") is None:
            continue
        ax.axvline(f["fired"] / 60, color=colors[f["kind"]], lw=0.8,
                   label=None if f["kind"] in labelled else f["kind"])
        ax.axvspan(f["fired"] / 60, (f.get("back") or result["args"]["minutes"] * 60) / 60,
                   color=colors[f["kind"]], alpha=0.08)
        labelled.add(f["kind"])
    ax.set_xlabel("minutes since round 1 began")
    ax.set_ylabel("highest committed round")
    ax.set_title(f"churn: {result['args']['nodes']} nodes, seed {result['args']['seed']} "
                 "(shaded: the node away until its first committed round)")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def report(path: Path) -> None:
    """Summaries, goodput, table (.txt) and plot (.png) from the records and fault log in the JSON."""
    result = json.loads(path.read_text())
    a = result["args"]
    for run in result["runs"].values():
        run["summary"] = summarize(run["records"], a["nodes"], a["minutes"] * 60, run["faults"])
    if "faults" in result["runs"] and "clean" in result["runs"]:
        result["goodput"] = (result["runs"]["faults"]["summary"]["committed"]
                             / max(result["runs"]["clean"]["summary"]["committed"], 1))
    path.write_text(json.dumps(result, indent=1) + "\n")
    text = table(result)
    print(text, flush=True)
    path.with_suffix(".txt").write_text(text + "\n")
    print(f"wrote {path} and {path.with_suffix('.txt')}", flush=True)
    plot(result, path.with_suffix(".png"))
