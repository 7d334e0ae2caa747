"""`diloco-p2p plan`: predict a round's cost for 4 to 1,024 nodes, and the settings to change.

A round's seconds, compute utilization, bytes per node and the bottleneck
(`diloco_p2p.planner.plan`), then the settings that best raise utilization
(`diloco_p2p.planner.recommend`); nothing is started. The swarm's settings are a config's
(`--config`, `--set`, and the flags standing for its fields, `SETTINGS`), checked and defaulted
as `train` would; the model's size and the machines are the flags'.
"""

from __future__ import annotations

import argparse
import json
import re

from diloco_p2p.errors import UserError

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}
# The flags that stand for a config field (unset: the config's value).
SETTINGS = {"inner_steps": "outer.inner_steps", "dylu": "outer.dynamic_local_updates", "group": "sync.target_group_size",
            "compression": "sync.compression", "density": "sync.topk_density", "overlap": "sync.overlap",
            "overlap_steps": "sync.overlap_steps", "fragments": "sync.fragments", "average_moments": "sync.average_moments"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    from diloco_p2p.planner import plan

    p = sub.add_parser("plan", help="predict round time, utilization, bytes per node and the bottleneck at N nodes")
    p.add_argument("--params", required=True, help="model parameters, e.g. 150M, 1.2B, 3500000")
    p.add_argument("--step-seconds", type=float, required=True, help="one inner step's compute on a typical node")
    p.add_argument("--config", help="the run's YAML or TOML config file (see configs/): its outer and sync settings")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override a config field, as `train` takes it (repeatable)")
    p.add_argument("--inner-steps", type=int, default=None, help="H, inner steps per round (outer.inner_steps)")
    p.add_argument("--uplink", default="20", help="Mbit/s per node: one rate, or LO-HI (log-uniform over nodes)")
    p.add_argument("--downlink", default=None, help="Mbit/s per node like --uplink (default: the uplink's)")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="round-trip time between two nodes")
    p.add_argument("--fail-rate", type=float, default=0.0, help="probability a node dies during a round")
    p.add_argument("--step-spread", type=float, default=0.0,
                   help="spread of per-node compute speed (coefficient of variation; 0 = identical nodes)")
    p.add_argument("--dylu", action="store_true", default=None,
                   help="dynamic local updates: slow nodes do fewer steps (outer.dynamic_local_updates)")
    p.add_argument("--scheme", default="auto", help=f"averaging scheme: {', '.join(plan.SCHEMES)}")
    p.add_argument("--group", type=int, default=None, help="butterfly size; a grid's row size (sync.target_group_size)")
    p.add_argument("--compression", default=None, help=f"wire format: {', '.join(plan.COMPRESSIONS)} (sync.compression)")
    p.add_argument("--density", type=float, default=None, help="top-k: fraction of values sent (sync.topk_density)")
    p.add_argument("--overlap", default=None,
                   help=f"{', '.join(plan.OVERLAPS)}: hide the all-reduce behind compute (sync.overlap)")
    p.add_argument("--overlap-steps", type=int, default=None,
                   help="overlap inner: τ, the inner steps of the next round the all-reduce runs behind; "
                   "0 = as soon as it is known (sync.overlap_steps)")
    p.add_argument("--fragments", type=int, default=None,
                   help="sync.fragments: each round averages 1/P of the parameters (give --inner-steps per round)")
    p.add_argument("--average-moments", action="store_true", default=None,
                   help="sync.average_moments: each round also all-reduces the inner first moments (twice the bytes)")
    p.add_argument("--nodes", default=",".join(str(n) for n in plan.DEFAULT_NODES), help="N values, comma-separated")
    p.add_argument("--json", action="store_true", help="one JSON object per N instead of the table")
    p.add_argument("--no-recommend", action="store_true", help="the table only: no recommended settings")
    p.set_defaults(run=run)


def parse_count(text: str) -> int:
    """'150M' -> 150000000; '3.5e6' -> 3500000."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbg]?)\s*", text.lower())
    if not m:
        raise UserError(f"plan: --params {text!r} is not a count; write e.g. 150M, 1.2B or 3500000")
    return int(float(m.group(1)) * _SUFFIX[m.group(2)])


def parse_links(text: str, flag: str):
    from diloco_p2p.planner.plan import Links

    try:
        lo, _, hi = text.partition("-")
        links = Links(float(lo), float(hi or lo))
    except ValueError:
        raise UserError(f"plan: {flag} {text!r} is not a rate; write Mbit/s like 20 or a range like 10-100") from None
    if not 0 < links.lo <= links.hi:
        raise UserError(f"plan: {flag} {text!r} must be > 0 Mbit/s with LO <= HI")
    return links


def settings(args: argparse.Namespace):
    """The config whose swarm settings are planned: defaults < `--config` < `--set` < the flags of
    `SETTINGS`; an invalid one is one line naming the argument that gave it."""
    from diloco_p2p.config import apply_override, config_tree, validate_config

    tree, sources = config_tree(args.config, args.overrides)
    for flag, field in SETTINGS.items():
        value = getattr(args, flag)
        if value is not None:
            apply_override(tree, field.split("."), value)
            sources[tuple(field.split("."))] = f"--{flag.replace('_', '-')} {value}"
    try:
        return validate_config(tree, source=args.config or "config", sources=sources)
    except UserError as e:
        raise UserError(f"plan: {e}") from None


def _inputs(args: argparse.Namespace):
    from diloco_p2p.planner.plan import Inputs

    try:
        nodes = tuple(int(n) for n in args.nodes.split(","))
    except ValueError:
        raise UserError(f"plan: --nodes {args.nodes!r} must be integers separated by commas, e.g. 4,16,64") from None
    if not nodes or min(nodes) < 1:
        raise UserError(f"plan: --nodes {args.nodes!r} must be at least 1 each")
    up = parse_links(args.uplink, "--uplink")
    down = parse_links(args.downlink, "--downlink") if args.downlink else up
    cfg = settings(args)
    try:
        inp = Inputs.from_config(cfg, scheme=args.scheme, params=parse_count(args.params), step_seconds=args.step_seconds,
                                 uplink=up, downlink=down, rtt_ms=args.rtt_ms, fail_rate=args.fail_rate,
                                 step_spread=args.step_spread)
    except ValueError as e:
        raise UserError(f"plan: {e}") from None
    return inp, nodes


def run(args: argparse.Namespace) -> int:
    from diloco_p2p.planner.plan import Calibration, sweep

    inp, nodes = _inputs(args)
    predictions = sweep(inp, nodes)
    if args.json:
        for p in predictions:
            print(json.dumps(p.as_dict()))
        return 0
    cal = Calibration()
    print(f"{inp.params:,} parameters, {inp.compression}, H={inp.inner_steps} x {inp.step_seconds:g} s, "
          f"overlap {inp.overlap}{f' (τ={inp.overlap_steps})' if inp.overlap == 'inner' else ''}"
          f"{f', {inp.fragments} fragments (a round averages 1/{inp.fragments})' if inp.fragments > 1 else ''}"
          f"{', inner first moments averaged too' if inp.moments else ''}; "
          f"constants: {cal.source}")
    print(f"{'N':>5} {'scheme':>9} {'round s':>9} {'util':>5} {'MB sent':>9} {'streams':>7} {'all-reduce s':>12} "
          f"{'exposed s':>9}  bottleneck")
    for p in predictions:
        print(f"{p.nodes:>5} {p.scheme:>9} {p.round_seconds:>9.1f} {p.utilization:>5.2f} {p.bytes_sent / 1e6:>9.2f} "
              f"{p.messages:>7} {p.allreduce_seconds:>12.2f} {p.exposed_seconds:>9.2f}  {p.bottleneck} "
              f"({p.parts.get(p.bottleneck, 0.0) / p.round_seconds:.0%} of the round)")
    if not args.no_recommend:
        from diloco_p2p.planner.recommend import recommend, render

        print("\n".join(render(recommend(inp, nodes, cal))))
    return 0
