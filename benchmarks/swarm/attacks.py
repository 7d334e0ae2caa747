"""The strangers' attacks of issue 48 against real swarms, and what each achieved (the table).

Runs `tests.faults.strangers.attacked_swarm` (a seed, three honest `diloco-p2p train` processes,
Sybils and bad donors in this process with their own identities, then a newcomer) in two runs:

- ``witness``: the seed follows the run (``--witness``), the Sybils' made-up θ is of another size;
- ``no witness``: the seed witnesses nothing and the made-up θ has the model's size: a node with no
  standing of its own (every node before the run's first group, a newcomer) falls back to the
  headcount (the open gap docs/threat-model.md names).

Each row reads the nodes' records and logs: whether an honest node adopted the attacker's state,
crashed, or named the attacker. About 2 minutes.

    python benchmarks/swarm/attacks.py [--json benchmarks/swarm/results/attacks.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.faults

from tests.faults.strangers import MOMENTUM, OVERSIZED, RUN, SYBILS, WRONG_SIZE, attacked_swarm  # noqa: E402

TINY_PARAMETERS = 382_176  # the tiny preset's θ


def outcome(attacked, who: list[int], reason: str, victims: list) -> dict:
    """What the strangers `who` achieved against `victims`: adopted by, crashed, named by."""
    ids = [attacked.strangers.ids[i] for i in who]
    adopted = [n.run_dir.name for n in victims if any(r["params_sha256"] == attacked.forged_hash for r in n.records())]
    crashed = [n.run_dir.name for n in victims if "Traceback" in n.output()
               or (n.exited() and n.exit_code_within(0) != 0)]
    named = [n.run_dir.name for n in victims if all(f"refused peer {p}: {reason}" in n.output() for p in ids)]
    return {"adopted by": adopted, "crashed": crashed, "named by": named}


def newcomer_outcome(attacked) -> str:
    """Where the newcomer's resync ended: the honest θ of round 2, the forged one, or neither."""
    honest = attacked.nodes[0].by_round()[2]["params_sha256"]
    resynced = [r["params_sha256"] for r in attacked.d.records() if r["status"] == "resynced"]
    if attacked.forged_hash in resynced:
        return "adopted the forged state"
    return "on the honest θ bit for bit" if honest in resynced else "not joined (trains alone)"


def run(witness: bool) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="diloco-attacks-") as tmp, \
            attacked_swarm(Path(tmp), seed_args=("--witness", RUN) if witness else (),
                           forged_numel=16 if witness else TINY_PARAMETERS) as attacked:
        honest, d = attacked.nodes, attacked.d
        size = "another size" if witness else "the model's size"
        rows = [{"attack": f"3 Sybils back a made-up later θ ({size}) and serve it", "victims": "honest a, b, c",
                 **outcome(attacked, list(SYBILS), "unvouched-state", honest)}]
        if d is None:  # taken over before a newcomer could join
            return rows
        return [
            *rows,
            {"attack": "the same, against a newcomer", "victims": "newcomer d", "newcomer": newcomer_outcome(attacked),
             **outcome(attacked, list(SYBILS), "unvouched-state", [d])},
            {"attack": "the vouched θ with a made-up momentum, first in d's order", "victims": "newcomer d",
             **outcome(attacked, [MOMENTUM], "bad-state", [d])},
            {"attack": "the vouched θ with a momentum of another size", "victims": "newcomer d",
             **outcome(attacked, [WRONG_SIZE], "bad-state", [d])},
            {"attack": "a state announced at 2**62 bytes", "victims": "newcomer d",
             **outcome(attacked, [OVERSIZED], "bad-state", [d])},
        ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=Path, default=Path("benchmarks/swarm/results/attacks.json"))
    args = p.parse_args()
    table = {"witness": run(True), "no witness": run(False)}
    print(f"\n{'run':<11} {'attack':<62} {'adopted by':<11} {'crashed':<8} {'named by':<9} newcomer")
    for name, rows in table.items():
        for r in rows:
            print(f"{name:<11} {r['attack']:<62} {','.join(r['adopted by']) or '-':<11} "
                  f"{','.join(r['crashed']) or '-':<8} {','.join(r['named by']) or '-':<9} {r.get('newcomer', '')}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
