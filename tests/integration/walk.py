"""Walking a `--set` field from the CLI to the round, as data: how often the walk climbs back up.

A node is started the way a user starts one (`diloco_p2p.cli.main(["train", ...])`, tiny settings)
and joins a real swarm (a seed and one more node, processes) for one round with an all-reduce. Every read of a watched config field (`outer.lr`, ...) records the
call stack that reached it. Each stack, from the CLI down to the read, is a walk through rooms (the
package's modules; consecutive frames of one module are one step). A step *climbs back up* when it
enters a room of a higher layer than the room it leaves (`PACKAGE_LAYERS`, `SWARM_LAYERS` of the
layout test): a lower layer calling into a higher one through a callback or an object handed down.
A step *returns* when it enters a room the walk already left. Issue 50's goal: at most 5 climbs.

    python -m tests.integration.walk [--json PATH]   # each field's reads, climbs, returns; the worst walk
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import diloco_p2p
from diloco_p2p import cli
from diloco_p2p.config.section import Section
from diloco_p2p.config.tree import Config
from tests.harness.procs import read_records
from tests.harness.settings import SWARM, set_args
from tests.harness.swarm import ProcessSwarm
from tests.unit.test_layout import PACKAGE_LAYERS, SWARM_LAYERS

PACKAGE = Path(diloco_p2p.__file__).parent
FIELDS = ("outer.lr", "outer.inner_steps", "inner.lr", "inner.batch_size", "sync.aggregation", "sync.compression",
          "sync.matchmaking_timeout", "sync.overlap", "train.max_rounds", "model.preset", "data.max_bytes")
# Both nodes wait for each other in matchmaking long enough that round 1 is averaged, not trained alone.
ROUND = ["train.max_rounds=1", "sync.matchmaking_timeout=30", "outer.lr=0.5"]
SWARM_FACADE = {"sync", "multirank", "vouching", "datashare", "__init__"}


class Walk(NamedTuple):
    rooms: tuple[str, ...]
    climbs: int
    returns: int


def layer(module: str) -> float:
    """The layer of a package module, bottom up; inside the swarm, its sub-layer as a fraction."""
    parts = module.split(".")[1:] or ["__init__"]
    top = parts[0]
    index = next(i for i, units in enumerate(PACKAGE_LAYERS) if top in units)
    if top != "swarm":
        return float(index)
    unit = parts[1] if len(parts) > 1 and parts[1] not in SWARM_FACADE else "facade"
    sub = next(i for i, units in enumerate(SWARM_LAYERS) if unit in units)
    return index + (sub + 1) / (len(SWARM_LAYERS) + 1)


def walk(rooms: list[str]) -> Walk:
    """Climbs and returns along one stack's rooms, outermost first."""
    steps = [r for i, r in enumerate(rooms) if i == 0 or r != rooms[i - 1]]
    climbs = sum(layer(b) > layer(a) for a, b in zip(steps, steps[1:], strict=False))
    returns = sum(b in steps[:i] for i, b in enumerate(steps[1:]))
    return Walk(tuple(steps), climbs, returns)


def _module_of(filename: str) -> str | None:
    path = Path(filename)
    if PACKAGE not in path.parents:
        return None
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sections() -> dict[type, str]:
    """Each section class of the config tree -> its name (`outer`, `sync`, ...)."""
    out = {}
    for name, field in Config.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            out[field.annotation] = name
    return out


def record_walks(root: Path, fields: tuple[str, ...] = FIELDS) -> tuple[dict[str, list[Walk]], list[dict]]:
    """Run one averaged round from the CLI beside a node of a real swarm; return the walk of every
    read of each field, and the node's records."""
    sections = _sections()
    watched = {tuple(f.split(".", 1)) for f in fields}
    seen: dict[str, list[Walk]] = defaultdict(list)
    original = Section.__getattribute__

    def reading(self, name):
        section = sections.get(type(self))
        if section is not None and (section, name) in watched:
            rooms = [m for m in (_module_of(f.filename) for f in traceback.extract_stack()[:-1]) if m]
            seen[f"{section}.{name}"].append(walk(rooms))
        return original(self, name)

    with ProcessSwarm(root) as swarm:
        other = swarm.node("other", [*ROUND, "train.max_rounds=2"])
        swarm.release(other)
        Section.__getattribute__ = reading
        try:
            code = cli.main(["train", *set_args([*SWARM, *ROUND]), "--initial-peers", swarm.maddr,
                             "--run-dir", str(root / "walker"), "--metrics-port", "0", "--log-level", "WARNING"])
        finally:
            Section.__getattribute__ = original
    if code != 0:
        raise RuntimeError(f"train exited {code}")
    return dict(seen), read_records(root / "walker")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--json", type=Path, help="also write the walks and the node's last record here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        walks, records = record_walks(Path(tmp))
    if args.json:
        args.json.write_text(json.dumps({"walks": {f: [w._asdict() for w in ws] for f, ws in walks.items()},
                                         "record": records[-1]}))
    print(f"round 1: {records[-1].get('status')}, group of {records[-1].get('group_size')}")
    print(f"{'field':20s} {'reads':>5s} {'distinct walks':>14s} {'max climbs':>10s} {'max returns':>11s}")
    for field in FIELDS:
        ws = walks.get(field, [])
        distinct = set(ws)
        print(f"{field:20s} {len(ws):5d} {len(distinct):14d} {max((w.climbs for w in ws), default=0):10d} "
              f"{max((w.returns for w in ws), default=0):11d}")
    worst = max((w for ws in walks.values() for w in ws), key=lambda w: (w.climbs, w.returns), default=None)
    if worst is not None:
        print(f"\nthe worst walk ({worst.climbs} climbs, {worst.returns} returns):")
        print("  " + "\n  -> ".join(r.removeprefix("diloco_p2p.") for r in worst.rooms))


if __name__ == "__main__":
    sys.exit(main())
