"""Launching one benchmark script as N local ranks on this machine (gloo on loopback), for the
benchmarks that compare a node of N ranks with one: each rank is the same script, told it is a
rank by `marker` in its environment; rank 0's last stdout line is its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_ranks(script: str, argv: list[str], world: int, marker: str, threads: int = 1) -> dict:
    """Run `script argv` as `world` ranks and return rank 0's result; exit naming the failed ranks."""
    from diloco_p2p.local.launch import free_port

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **{marker: "1"})
    procs = [subprocess.Popen([sys.executable, script, *argv], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])
