"""Join time and state-transfer throughput on loopback, for a few model sizes.

For each size: a seed and two nodes (real processes, `tests.harness.swarm.ProcessSwarm`) train until
round `--join-at`; then a third node starts with an empty run directory. It downloads the
swarm's state (θ and outer momentum) from a donor, records `status: resynced` with
`state_bytes` / `state_seconds`, and averages with the others from the next round on.

Printed per size: parameters, state bytes, the transfer (seconds and MB/s as the node records
them: from withdrawing its own announcement to holding the verified blob), and the join time
split into process start -> joined (Python imports, DHT join, model build, `started` record),
joined -> resync record (reading the progress records, the download) and resync record -> first
committed round in agreement with the others (inner steps, then
waiting for the round's group, which closes at most `sync.matchmaking_timeout` after its first
member arrived).

    python benchmarks/swarm/join_time.py [--sizes tiny,256x4,512x4] [--join-at 3] [--set a.b=v ...]

A size is `tiny` or `HIDDENxLAYERS` (intermediate = 3 x hidden, 64-wide heads). The download
alone, from 1, 2 and 4 donors at once on shaped links and on loopback beside the transport's
ceiling, is `benchmarks/swarm/join_stripes.py`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for benchmarks.*, tests.harness

from benchmarks.model_sizes import parameters, size_overrides  # noqa: E402
from tests.harness.procs import wait_until  # noqa: E402
from tests.harness.swarm import ProcessSwarm  # noqa: E402


def measure(size: str, join_at: int, extra: list[str], root: Path) -> dict:
    model = size_overrides(size)
    overrides = [*model, f"train.max_rounds={join_at + 4}", "sync.target_group_size=3",
                 "sync.matchmaking_timeout=6", *extra]
    swarm = ProcessSwarm(root)
    try:
        a, b = swarm.node("a", overrides), swarm.node("b", overrides)
        swarm.release(a, b)
        wait_until(lambda: join_at in a.by_round(), 600, f"round {join_at}", a, b)
        started = time.monotonic()
        c = swarm.node("c", overrides)
        ready = root / f"{swarm.gate.name}.ready-{c.pid}"  # written once it joined the DHT, model built
        wait_until(ready.exists, 300, "the joiner to join the DHT", c)
        joined = time.monotonic()
        wait_until(lambda: any(r["status"] == "resynced" for r in c.records()), 300, "the joiner's resync", c)
        resynced = time.monotonic()
        resync = next(r for r in c.records() if r["status"] == "resynced")

        def agreed() -> dict | None:
            for r in c.records():
                if r["round"] > resync["round"] and r["status"] == "committed" and r["round"] in a.by_round():
                    return r
            return None

        wait_until(lambda: agreed() is not None, 300, "the joiner's first committed round", c, a)
        committed = time.monotonic()
        first = agreed()
        return {
            "size": size, "parameters": parameters(model), "state_bytes": resync["state_bytes"],
            "state_seconds": resync["state_seconds"], "joined_at_round": resync["joined_at_round"],
            "to_joined_s": joined - started, "joined_to_resync_s": resynced - joined,
            "resync_to_commit_s": committed - resynced,
            "join_s": committed - started, "first_round": first["round"],
            "agrees": first["params_sha256"] == a.by_round()[first["round"]]["params_sha256"],
        }
    finally:
        swarm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,256x4,512x4")
    parser.add_argument("--join-at", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    print(f"{'size':>7} {'params':>10} {'state MB':>9} {'xfer s':>7} {'MB/s':>7} {'start->joined s':>15} "
          f"{'joined->resync s':>16} "
          f"{'resync->commit s':>17} {'join s':>7}  agrees")
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory(prefix="join-time-") as tmp:
            r = measure(size, args.join_at, args.overrides, Path(tmp))
        mb = r["state_bytes"] / 1e6
        print(f"{r['size']:>7} {r['parameters']:>10,} {mb:>9.2f} {r['state_seconds']:>7.3f} "
              f"{mb / r['state_seconds']:>7.1f} {r['to_joined_s']:>15.1f} {r['joined_to_resync_s']:>16.1f} "
              f"{r['resync_to_commit_s']:>17.1f} "
              f"{r['join_s']:>7.1f}  {r['agrees']} (joined at round {r['joined_at_round']}, "
              f"first committed round {r['first_round']})", flush=True)


if __name__ == "__main__":
    main()
