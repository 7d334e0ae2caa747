"""Regenerate the tables of docs/benchmarks.md from the stored results in benchmarks/AREA/results/.

docs/benchmarks.md holds the prose; each table sits between ``<!-- report:NAME -->`` and
``<!-- /report:NAME -->``, and NAME is a function in `TABLES` below. Where a benchmark has a report
mode (`quality.py --report`, `compression_decay.py --report`, `overlap_sweep.py --report` and
``--means``, `plan_check.py report|holdout`), its own functions make the table; the rest are read
from the benchmark's JSON as it wrote it. Nothing here runs a benchmark.

    python benchmarks/report.py           # rewrite the generated blocks of docs/benchmarks.md
    python benchmarks/report.py --check   # exit 1 if docs/benchmarks.md is not what the results give
    python benchmarks/report.py --plots   # also redraw the PNGs from the same results (matplotlib)

`tests/unit/test_benchmarks_report.py` runs ``--check``'s comparison, so a result file changed
without its table (or a table edited by hand) fails the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "benchmarks.md"
sys.path.insert(0, str(HERE.parent))  # for benchmarks.*; plan_check imports tests.netns

BLOCK = re.compile(r"(<!-- report:(?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.S)


def result(area: str, name: str) -> Path:
    """A stored result file: benchmarks/AREA/results/NAME."""
    return HERE / area / "results" / name


def load(area: str, name: str):
    return json.loads(result(area, name).read_text())


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def code(text: str) -> str:
    return "```\n" + text.rstrip() + "\n```"


def captured(fn: Callable, *args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args)
    return out.getvalue()


def pct(x: float, digits: int = 1) -> str:
    return f"{x:+.{digits}%}"


# --- quality, recipes -----------------------------------------------------------------------


def quality_report(name: str) -> str:
    """`quality.py --report`'s table of the stored run `name` (the PNG is left as it is)."""
    from benchmarks.quality import quality

    with mock.patch.object(quality, "plot", lambda *a: None):
        return code(captured(quality.report, load("quality", name), None).replace("plot: None\n", ""))


# The quality tables, one per stored run of benchmarks/quality/quality.py (block name = file stem).
QUALITY = ("quality_tiny", "quality_tiny_dp_muon", "quality_tiny_muon_outer", "quality_tiny_sweep", "quality_tiny_warm",
           "quality_tiny_32", "quality_small", "quality_small_dp_muon", "quality_35m", "quality_35m_dp_muon",
           "quality_tiny_muon_ilr", "quality_tiny_moments", "quality_tiny_m64", "quality_small_muon_ilr")


# --- wires ----------------------------------------------------------------------------------


def compression_wires() -> str:
    data = load("wire", "compression.json")
    rows = []
    for name, r in data["results"].items():
        fewer = f"{r['fewer_than_fp16']:.1f}×" if r.get("fewer_than_fp16") else "-"
        rows.append([f"`{name}`", f"{r['final']:.4f}", pct(r["vs_fp32"], 2), f"{r['bytes_per_round']:,.0f}", fewer,
                     "yes" if r["identical"] else "NO"])
    return table(["wire", "eval loss", "vs fp32", "bytes/round/node", "fewer than fp16", "same θ"], rows)


def _topk(name: str) -> str:
    """`compression_decay.py --report`'s seed means for one results file, and its payload line."""
    from benchmarks.wire import compression, compression_decay

    data = load("wire", name)
    n = load("wire", "compression.json")["parameters"]
    k, density = data["replicas"], data["density"]
    topk = compression.payload_bytes(n, "topk2", k, density)
    lines = compression_decay.seed_means(data["results"])
    lines.append(f"topk2 payload: {topk:,.0f} bytes/round/node at M={k}, density {density}: "
                 f"{compression.payload_bytes(n, 'fp16', k, density) / topk:.1f}x fewer than fp16")
    return code("\n".join(lines))


def topk_carry() -> str:
    return _topk("compression_topk_carry.json")


def topk_carry_m3() -> str:
    return _topk("compression_topk_carry_m3.json")


def topk_carry_d010() -> str:
    return _topk("compression_topk_carry_d010.json")


def topk_seeds() -> str:
    return _topk("compression_topk_seeds.json")


def swarm_matches_simulate() -> str:
    data = load("wire", "swarm_matches_simulate_topk2.json")
    rows = [[r["round"], "/".join(r["status"]), f"{r['eval']:.4f}", f"{r['simulate_eval']:.4f}",
             "yes" if r["same_theta"] else "NO", f"{r['reference_eval']:.4f}", pct(r["eval"] / r["reference_eval"] - 1, 2)]
            for r in data["rows"] if r["eval"] is not None]
    same = all(r["same_theta"] for r in data["rows"])
    return (table(["round", "statuses", "swarm eval", "simulate", "same θ", "fp32 reference", "vs reference"], rows)
            + f"\n\nθ as `simulate`'s in every round on every node: {'yes' if same else 'NO'} "
            f"({len(data['rows'])} rounds, {data['nodes']} nodes).")


# --- overlap --------------------------------------------------------------------------------


def _link(section: str) -> str:
    data = load("overlap", "overlap.json")[section]
    h = data["args"]["inner_steps"]
    rows = []
    for mode, m in data["modes"].items():
        p = int(mode.partition("/")[2] or 1)
        landed = f"{m['landed_step']:g} of {h // p}" if "landed_step" in m else "-"
        rows.append([f"`{mode}`", f"{m['seconds']:.2f}", f"{m['compute_seconds']:.2f}", f"{m['allreduce_seconds']:.2f}",
                     f"{m['exposed_share']:.1%}", landed, "yes" if m["theta_agrees"] else "NO"])
    return (f"{data['args']['k']} nodes, {data['rate_mbit']:g} Mbit/s, H={h}:\n\n"
            + table(["mode", "round s", "compute s", "all-reduce s", "exposed", "landed after step", "θ agrees"], rows))


def overlap_link() -> str:
    return _link("link")


def overlap_link_fragments() -> str:
    return _link("link_fragments_256x4_h10") + "\n\n" + _link("link_fragments_256x4")


def overlap_fragments() -> str:
    """`overlap_sweep.py --means` over the six seeds' files."""
    from benchmarks.overlap import overlap_sweep

    per_seed = [load("overlap", f"overlap_fragments_seed{s}.json")["results"] for s in range(6)]
    return code(overlap_sweep.means(per_seed))


def overlap_sweep_seed0() -> str:
    """`overlap_sweep.py --report` of the seed-0 grid."""
    from benchmarks.overlap import overlap_sweep

    return code(overlap_sweep.report(load("overlap", "overlap_sweep.json")["results"]))


# --- all-reduce on shaped links -------------------------------------------------------------


def _by_k(rows: list[dict], rate_key: str, scheme_key: str, ratio: Callable[[dict], float]) -> dict:
    cells: dict = {}
    for r in rows:
        cells.setdefault((r[rate_key], r[scheme_key]), {})[r["k"]] = ratio(r)
    return cells


def _k_cell(by_k: dict | None) -> str:
    return " / ".join(f"{by_k[k]:.2f}" for k in sorted(by_k)) if by_k else ""


def allreduce_paced() -> str:
    """Paced all-reduce, × the wire time, k = 2 / 3 / 4 in each cell."""
    ratio = lambda r: r["seconds"] / r["wire_seconds"]  # noqa: E731
    small = _by_k(load("wire", "allreduce_wan_payload_at_once.json")["rows"], "rate_mbit", "scheme", ratio)
    large = _by_k(load("wire", "allreduce_wan_payload_at_once_20m.json")["rows"], "rate_mbit", "scheme", ratio)
    rates = sorted({rate for rate, _ in small} | {rate for rate, _ in large})
    rows = [[f"{rate:g}", _k_cell(small.get((rate, "fp16"))), _k_cell(small.get((rate, "int8"))),
             _k_cell(large.get((rate, "fp16"))), _k_cell(large.get((rate, "int8")))] for rate in rates]
    return table(["Mbit/s", "3.5M values, fp16", "3.5M, int8", "20M values, fp16", "20M, int8"], rows)


def allreduce_ceiling() -> str:
    """Unpaced all-reduce and plain TCP of the same bytes, × the wire time, k = 2 / 3 / 4."""
    rows = []
    for cc in ("bbr", "cubic"):
        data = load("wire", f"allreduce_wan_ceiling_{cc}.json")["rows"]
        ours = _by_k(data, "rate_mbit", "scheme", lambda r: r["seconds"] / r["wire_seconds"])
        tcp = _by_k(data, "rate_mbit", "scheme", lambda r: r["tcp_seconds"] / r["wire_seconds"])
        for rate, scheme in sorted(ours):
            rows.append([cc.upper(), f"{rate:g}", scheme, _k_cell(ours[rate, scheme]), _k_cell(tcp[rate, scheme])])
    return table(["TCP", "Mbit/s", "wire", "all-reduce", "plain TCP"], rows)


def allreduce_paced_cubic() -> str:
    data = load("wire", "allreduce_wan_paced_cubic.json")["rows"]
    cells = _by_k(data, "rate_mbit", "scheme", lambda r: r["seconds"] / r["wire_seconds"])
    rates = sorted({rate for rate, _ in cells})
    return table(["Mbit/s", "fp16", "int8"], [[f"{rate:g}", _k_cell(cells.get((rate, "fp16"))),
                                               _k_cell(cells.get((rate, "int8")))] for rate in rates])


def wan_line_rate() -> str:
    data = load("wire", "wan_line_rate.json")
    ratio = _by_k(data["rows"], "mbit", "wire", lambda r: r["ratio"])
    util = _by_k(data["rows"], "mbit", "wire", lambda r: r["utilization"])
    rates = sorted({rate for rate, _ in ratio}, reverse=True)
    return table(["Mbit/s", "fp16 × wire time", "int8 × wire time", "fp16 utilization", "int8 utilization"],
                 [[f"{rate:g}", _k_cell(ratio[rate, "fp16"]), _k_cell(ratio[rate, "int8"]),
                   _k_cell(util[rate, "fp16"]), _k_cell(util[rate, "int8"])] for rate in rates])


def _wan_rows(name: str) -> str:
    data = load("wire", name)
    rows = [[f"{r['mbit']:g}", r["k"], f"`{r['wire']}`", r["overlap"], f"{r['bytes_sent'] / 1e6:.3f}",
             f"{r['fewer_than_fp16']:.1f}×", f"{r['allreduce_seconds']:.3f}", f"{r['ratio']:.2f}", f"{r['seconds']:.2f}",
             f"{r['exposed_seconds']:.2f}", f"{r['utilization']:.2f}"] for r in data["rows"]]
    return table(["Mbit/s", "k", "wire", "overlap", "sent MB", "fewer than fp16", "all-reduce s", "× wire time",
                  "round s", "exposed s", "utilization"], rows)


def wan_topk() -> str:
    return _wan_rows("wan_topk.json")


def wan_256x4() -> str:
    return _wan_rows("wan_256x4.json")


def hivemind() -> str:
    """The latest paced run of each (k, congestion control): time × hivemind's fp16 all-reduce."""
    latest: dict = {}
    for r in load("wire", "hivemind_compare.json"):
        if r.get("pace") and "hivemind fp16" in r.get("sides", {}):
            latest.setdefault((r["k"], r["congestion"]), {})[r["rate"]] = r  # later runs replace earlier ones
    rows = []
    for (k, cc), by_rate in sorted(latest.items(), key=lambda kv: (kv[0][1] != "bbr", kv[0][0])):
        for rate, r in sorted(by_rate.items()):
            s, hm = r["sides"], r["sides"]["hivemind fp16"]["seconds"]
            rows.append([cc.upper(), k, f"{rate:g}", f"{hm:.3f}", f"{s['ours fp16']['seconds'] / hm:.2f}",
                         f"{s['ours int8']['seconds'] / hm:.2f}", f"{r['tcp_seconds'] / hm:.2f}",
                         f"{hm_err:.0e}" if (hm_err := s["hivemind fp16"].get("error")) is not None else "-"])
    return table(["TCP", "k", "Mbit/s", "hivemind fp16 s", "ours fp16 ×", "ours int8 ×", "plain TCP (fp16 bytes) ×",
                  "hivemind's error"], rows)


# --- scale, NAT, planner, robustness, data --------------------------------------------------


def scale() -> str:
    data = load("wire", "scale.json")
    rows = [[r["compression"], r["members"], r["scheme"], f"{r['bytes_over_bound']:.4f}", r["messages"],
             f"{r['seconds']:.2f}"] for r in data["allreduce"]]
    shaped = load("wire", "scale_wan.json")
    rows_wan = [[f"{r['rate_mbit']:g}", r["k"], "grid" if "/grid" in r["scheme"] else "butterfly",
                 f"{r['sent'] / r['bound']:.4f}", f"{r['seconds']:.2f}", f"{r['seconds'] / r['wire_seconds']:.2f}"]
                for r in shaped["rows"]]
    members = [[r["members"], r["groups"], r["gets_max"], r["stores_max"], r["entries_read_max"]]
               for r in data["membership"]]
    return ("Loopback, 1M values (`python benchmarks/wire/scale.py`; seconds are CPU on loopback):\n\n"
            + table(["wire", "N", "scheme", "bytes × bound", "messages", "seconds"], rows)
            + f"\n\nShaped links, 2M values, fp16 (`{shaped['command']}`):\n\n"
            + table(["Mbit/s", "N", "scheme", "bytes × bound", "seconds", "× wire time"], rows_wan)
            + "\n\nMatchmaking of one round, in-memory DHT (per node, the most of any node):\n\n"
            + table(["N", "groups", "DHT gets", "DHT stores", "entries a read returns"], members))


def nat() -> str:
    data = load("swarm", "nat.json")
    rows = []
    for layout, kinds in data["layouts"].items():
        for kind, r in kinds.items():
            rows.append([layout, kind, f"{r['bytes_sent'] / 1e6:.1f}", f"{r['bytes_received'] / 1e6:.1f}",
                         f"{r['bytes_sent'] / r['bound_bytes']:.4f}", f"{r['allreduce_seconds']:.2f}"])
    return (f"{data['k']} nodes ({data['size']}, {data['parameters']:,} parameters, {data['compression']}) at "
            f"{data['rate_mbit']:g} Mbit/s:\n\n"
            + table(["layout", "member", "sent MB", "received MB", "sent × bound", "all-reduce s"], rows))


def planner() -> str:
    """`plan_check.py report`'s held-out count and `holdout`'s, for the shipped constants."""
    from benchmarks.planner import plan_check
    from diloco_p2p.planner import plan

    cal = plan.Calibration()
    lines = []
    for name, what in (("plan_check_quiet.json", "quiet machine, the shipped constants' own file"),
                       ("plan_check.json", "busy machine (load 6-14), the load share fitted on its calibration")):
        errs = plan_check.held_out(load("planner", name), cal)
        lines.append(f"{name} ({what}): held out {sum(abs(e) <= 0.15 for e in errs)} of {len(errs)} rows within 15% "
                     f"(worst {max(errs, key=abs):+.1%})")
    rows = plan_check.holdout(load("planner", "plan_check_quiet.json"))["rows"]
    for key, what in (("err_rate_out", "leave-one-rate-out"), ("err_k_out", "leave-one-k-out")):
        errs = [r[key] for r in rows if r[key] is not None]
        lines.append(f"{what} refits on plan_check_quiet.json: {sum(abs(e) <= 0.15 for e in errs)} of {len(errs)} "
                     f"within 15% (worst {max(errs, key=abs):+.1%})")
    return code("\n".join(lines))


def robust() -> str:
    data = load("swarm", "robust.json")
    free = data["summary"]["attacker-free"]["finals"]
    rows = []
    for key, r in data["summary"].items():
        if key == "attacker-free":
            continue
        attack, _, rule = key.partition("/")
        d = r["vs_free_pct"]
        spread = f"{min(d):+.2f}..{max(d):+.2f}%" if len(d) > 1 else "-"
        rows.append([attack, f"`{rule}`", f"{statistics.mean(d):+.2f}%", spread, len(d), "yes" if r["agree"] else "NO"])
    cost = [[f"`{rule}`", f"{c['allreduce_s']:.3f}", f"{c['bytes_sent']:,}", f"{1000 * c['reduce_part_s']:.1f}"]
            for rule, c in data["cost"].items()]
    return (f"Attacker-free final eval {min(free):.3f}-{max(free):.3f} over the seeds.\n\n"
            + table(["attack", "aggregation", "vs attacker-free (mean)", "range", "seeds", "θ agree"], rows)
            + f"\n\nCost, one all-reduce of {data['parameters']:,} values among 4 members on loopback:\n\n"
            + table(["aggregation", "all-reduce s", "bytes sent/member", "one part's reduction, ms"], cost))


def data_fetch() -> str:
    data = load("data", "data_fetch.json")
    best = {k: min(v, key=lambda r: r["first_round_s"]) for k, v in data["runs"].items()}
    names = {"local": "shards on disk", "swarm": "`swarm:<id>` (empty cache)"}
    rows = [[names.get(k, k), f"{r['first_step_s']:.1f} s", f"{r['first_round_s']:.1f} s", f"{r['joined_s']:.1f} s",
             f"{r['first_round_s'] - r['joined_s']:.1f} s", f"{r['fetched_mb']:.0f} MB", f"{r['peak_rss_mb']:.0f} MB"]
            for k, r in best.items()]
    after, copy = data["after_join_s"], data["fetch_data"]
    return (f"{data['size_mb']} MB of text in {data['shards']} shards of {data['shard_mb'] / 1.048576:.0f} MiB; fastest of "
            f"{len(data['runs']['local'])} each:\n\n"
            + table(["node", "start to first inner step", "to first committed round", "of which joining the DHT",
                     "round after joining", "fetched by then", "peak RSS"], rows)
            + f"\n\nFirst committed round from the swarm: {data['first_round_ratio']:.2f}× the time of a node with the "
            f"shards, from the process start; after joining the DHT {after['swarm']:.1f} s against "
            f"{after['local']:.1f} s. `fetch-data` copied the whole corpus at {copy['mb_per_s']:.0f} MB/s "
            f"(peak RSS {copy['peak_rss_mb']:.0f} MB).")


def data_scale() -> str:
    small, large = load("data", "data_scale.json"), load("data", "data_scale_3g.json")
    first = large["first_step_fastest_of_3"]
    prep = {**small["prepare_byte"], "3000": large["prepare_byte_again"]}
    default = first["default"]
    rows = [["default corpus (tokenized in memory at start)", "-", f"{default['first_step_s']:.1f} s",
             f"{default['peak_rss_mb']:.0f} MB"]]
    for size in ("300", "3000"):
        p, f = prep[size], first[size]
        rows.append([f"{int(size) // 1000} GB, prepared" if size == "3000" else f"{size} MB, prepared",
                     f"{p['mb_s']:.0f} MB/s ({p['cpu_s']:.1f} CPU-s; load {p['load_avg']:.1f})",
                     f"{f['first_step_s']:.1f} s ({f['first_step_s'] - default['first_step_s']:+.1f})",
                     f"{f['peak_rss_mb']:.0f} MB ({f['peak_rss_mb'] - default['peak_rss_mb']:+.0f})"])
    bpe, loader = small["bpe"], small["loader"]["loader_ms"]
    return (table(["corpus", "prepare (byte tokenizer)", "start to first inner step", "peak RSS"], rows)
            + f"\n\nAn 8k ByteLevel BPE: prepare {bpe['ratio']:.2f}× the `tokenizers` library's own `encode_batch` "
            f"on the same {bpe['mb']:.0f} MB. The loader's `next_batch`: {loader['shards']:.2f} ms on shards, "
            f"{loader['memory']:.2f} ms from memory.")


# --- churn, joins -----------------------------------------------------------------------------


def _churn(name: str) -> str:
    """churn.py's table and its restarts, as it wrote them (the fault log stays in the .txt)."""
    text = result("swarm", f"{name}.txt").read_text()
    return code(text.split("\nfaults: at s")[0])


def churn_4n_before() -> str:
    return _churn("churn_4n_before")


def churn_4n() -> str:
    return _churn("churn_4n")


def churn_8n() -> str:
    return _churn("churn_8n")


def join_stripes() -> str:
    return code(result("swarm", "join_stripes.txt").read_text())


def quality_sync() -> str:
    from benchmarks.quality import quality_sync as sync

    return code(sync.report(sync.collect()))


def gap_by_m() -> str:
    from benchmarks.quality import gap_by_m as by_m

    return code(by_m.report(by_m.gaps([f for f in by_m.DEFAULT if f.exists()])))


TABLES: dict[str, Callable[[], str]] = {name: functools.partial(quality_report, f"{name}.json") for name in QUALITY}
TABLES |= {f.__name__: f for f in (
    compression_wires, topk_carry, topk_carry_m3, topk_carry_d010, topk_seeds,
    swarm_matches_simulate, overlap_link, overlap_link_fragments, overlap_fragments, overlap_sweep_seed0,
    allreduce_paced, allreduce_ceiling, allreduce_paced_cubic, wan_line_rate, wan_topk, wan_256x4, hivemind, scale,
    nat, planner, robust, data_fetch, data_scale, churn_4n_before, churn_4n, churn_8n, join_stripes,
    quality_sync, gap_by_m)}


def render(doc: str) -> str:
    """`doc` with every generated block replaced by what the stored results give now."""
    names = [m["name"] for m in BLOCK.finditer(doc)]
    unknown = sorted(set(names) - set(TABLES))
    if unknown:
        raise SystemExit(f"{DOC}: no generator for block(s) {unknown}")
    return BLOCK.sub(lambda m: m[1] + TABLES[m["name"]]().rstrip() + "\n" + m[4], doc)


def plots() -> None:
    """Redraw the PNGs with the benchmarks' own plotting functions, from the same results."""
    from benchmarks.overlap import overlap_sweep
    from benchmarks.planner import plan_check
    from benchmarks.quality import gap_by_m, quality, quality_sync
    from benchmarks.swarm import robust
    from benchmarks.wire import allreduce_wan, compression, compression_decay

    for name in QUALITY:
        quality.report(load("quality", f"{name}.json"), result("quality", f"{name}.png"))
    quality_sync.plot(quality_sync.collect(), result("quality", "quality_sync.png"))
    gap_by_m.plot(gap_by_m.gaps([f for f in gap_by_m.DEFAULT if f.exists()]), result("quality", "gap_by_m.png"))
    compression.plot(load("wire", "compression.json")["results"], result("wire", "compression.png"))
    for name in ("compression_topk_carry", "compression_topk_seeds"):
        compression_decay.plot(load("wire", f"{name}.json")["results"], result("wire", f"{name}.png"))
    overlap_sweep.plot_means([load("overlap", f"overlap_fragments_seed{s}.json")["results"] for s in range(6)],
                             result("overlap", "overlap_fragments.png"))
    allreduce_wan.plot([result("wire", "allreduce_wan_ceiling_bbr.json"), result("wire", "allreduce_wan_ceiling_cubic.json")],
                       result("wire", "allreduce_wan_ceiling.png"))
    plan_check.stage_curves(argparse.Namespace(json=result("planner", "plan_check.json")))
    robust.plot(argparse.Namespace(seeds=[0], png=result("swarm", "robust.png")), load("swarm", "robust.json")["results"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if docs/benchmarks.md is stale")
    p.add_argument("--plots", action="store_true", help="also redraw the PNGs in benchmarks/AREA/results/")
    args = p.parse_args()
    doc = DOC.read_text()
    new = render(doc)
    if args.check:
        if new != doc:
            raise SystemExit(f"{DOC} is stale: run python benchmarks/report.py")
        print(f"{DOC}: up to date")
        return
    if new != doc:
        DOC.write_text(new)
    print(f"{DOC}: {'rewritten' if new != doc else 'up to date'} ({len(TABLES)} tables)")
    if args.plots:
        plots()


if __name__ == "__main__":
    main()
