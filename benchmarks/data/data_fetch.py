"""Data through the swarm on loopback: start to first step and to first committed round from the swarm vs
from local shards, the transfer's MB/s, and memory.

A seed and a *holder* (a node training on a prepared corpus, parked at its first round's
delta by the ``hold`` fault so it only serves) run throughout. Then, interleaved, fresh
processes that join the same swarm and train one round (tiny preset, one inner step), each
with a partner (a fresh node with the shards on disk, started at the same moment, in a run of
their own) to commit that round with:

- ``local``: ``data.path`` = the prepared directory (all shards on disk);
- ``swarm``: ``data.path=swarm:<id>``, an empty cache: the manifest and the shards it needs
  come from the holder.

Each reports seconds from the interpreter's start to the end of its first inner step and to its
first committed round (and their ratio, swarm over local: the issue's goal is at most 1.2x), the
bytes it fetched, and its peak RSS (VmHWM). Last, ``diloco-p2p fetch-data`` copies the whole
corpus (MB/s of the shards on the wire, after joining the DHT; peak RSS of that process).

    python benchmarks/data/data_fetch.py [--size-mb 200] [--repeats 2] [--work DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # for benchmarks.*

from benchmarks.data.data_scale import make_corpus  # noqa: E402

MB = 1_000_000
_CHILD = r"""
import json, sys, time
t0 = float(sys.argv[1])
from pathlib import Path
from diloco_p2p.config import load_config
from diloco_p2p.contract import StopRequested
from diloco_p2p.swarm.sync import SwarmSync
cfg = load_config(None, json.loads(sys.argv[2]))
run_dir = Path(sys.argv[3])
sync = SwarmSync(cfg.sync, cfg.p2p, run_id=cfg.run_id, swarm_view=cfg.swarm_view(), run_dir=run_dir,
                 stop=StopRequested(), max_round=cfg.train.max_rounds)
joined = time.time() - t0
from diloco_p2p.loop.node import Node
node = Node(cfg, run_dir, sync, progress=False)
steps, step = [], node.trainer.step
node.trainer.step = lambda *a, **k: (step(*a, **k), steps.append(time.time() - t0))[0]
records = node.run()  # train.max_rounds=1: until its first round is committed
first_round = time.time() - t0
cache = getattr(getattr(node.data.source, "cache", None), "fetched_bytes", 0)
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
status = [r.status for r in records if r.round == 1]
print(json.dumps({"first_step_s": steps[0], "first_round_s": first_round, "round_status": status,
                  "joined_s": joined, "fetched_mb": cache / 1e6, "peak_rss_mb": int(hwm.split()[1]) / 1024}),
      flush=True)
sync.close()
"""
_FETCH = r"""
import json, sys
from pathlib import Path
from diloco_p2p.ops.transfer import fetch_dataset
r = fetch_dataset([sys.argv[1]], sys.argv[2], Path(sys.argv[3]), 120.0, 4)
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({**r, "peak_rss_mb": int(hwm.split()[1]) / 1024}), flush=True)
"""
COMMON = ["model.preset=tiny", "inner.batch_size=8", "inner.seq_len=128", "train.num_threads=1", "train.device=cpu",
          "train.eval_batches=1", "p2p.host_maddrs=['/ip4/127.0.0.1/tcp/0']",
          "p2p.connect_timeout=60", "train.max_rounds=100", "outer.inner_steps=1"]


# The measured node and its partner (a fresh node with the shards, started with it, in a run of
# their own): one round of one inner step, committed once both are in its group of two. The
# parked holder only serves the data.
JOINER = ["train.max_rounds=1", "sync.min_group_size=2", "sync.target_group_size=2", "sync.matchmaking_timeout=10"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _python(*args: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "w") if log else subprocess.PIPE  # noqa: SIM115 - the child holds it
    return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT if log else None,
                            env=env or _env(), cwd=REPO, text=True)


def start_swarm(work: Path, prepared: Path) -> tuple[list[subprocess.Popen], str]:
    maddrs = work / "seed.maddrs"
    maddrs.unlink(missing_ok=True)
    seed = _python("-m", "diloco_p2p", "seed", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(maddrs),
                   log=work / "seed.log")
    deadline = time.time() + 120
    while not (maddrs.exists() and maddrs.read_text().strip()):
        if time.time() > deadline or seed.poll() is not None:
            raise SystemExit(f"the seed did not start; see {work / 'seed.log'}")
        time.sleep(0.2)
    maddr = maddrs.read_text().split()[0]
    args = [a for o in [*COMMON, f"data.path={prepared}", "sync.min_group_size=2", "run_id=data-fetch-bench"]
            for a in ("--set", o)]
    holder = _python("-m", "tests.faults.node", "train", *args, "--initial-peers", maddr, "--run-dir", str(work / "holder"),
                     env={**_env(), "DILOCO_P2P_FAULTS": "hold@delta:1"}, log=work / "holder.log")
    while "round 0:" not in (work / "holder.log").read_text():  # built, serving
        if time.time() > deadline + 120 or holder.poll() is not None:
            raise SystemExit(f"the holder did not start; see {work / 'holder.log'}")
        time.sleep(0.5)
    return [seed, holder], maddr


def first_round(work: Path, name: str, overrides: list[str], partner: list[str]) -> dict:
    """The node of `overrides` and its `partner`, started together: the node's first step and round."""
    procs = {}
    t0 = time.time()
    for who, extra in (("node", overrides), ("partner", partner)):
        run_dir = work / f"{name}-{who}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        procs[who] = subprocess.Popen([sys.executable, "-c", _CHILD, repr(t0), json.dumps(extra), str(run_dir)],
                                      stdout=subprocess.PIPE, stderr=open(work / f"{name}-{who}.log", "w"),  # noqa: SIM115
                                      env=_env(), cwd=REPO, text=True)
    out = {who: proc.communicate(timeout=600)[0] for who, proc in procs.items()}
    for who, proc in procs.items():
        if proc.returncode != 0:
            raise SystemExit(f"{name} {who} failed; see {work / f'{name}-{who}.log'}")
    return {**json.loads(out["node"].strip().splitlines()[-1]),
            "partner_round_s": json.loads(out["partner"].strip().splitlines()[-1])["first_round_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=200)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", type=Path)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "data_fetch.json")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="data-fetch-"))
    work.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        corpus = make_corpus(work / f"corpus-{args.size_mb}", args.size_mb)
        prepared = work / f"prepared-{args.size_mb}"
        if not (prepared / "manifest.json").exists():
            subprocess.run([sys.executable, "-m", "diloco_p2p", "prepare", str(corpus), "--out", str(prepared)],
                           check=True, env=_env(), cwd=REPO, capture_output=True)
        manifest = json.loads((prepared / "manifest.json").read_text())
        procs, maddr = start_swarm(work, prepared)
        runs = {"local": [f"data.path={prepared}"], "swarm": [f"data.path=swarm:{manifest['id']}"]}
        results: dict[str, list[dict]] = {k: [] for k in runs}
        for i in range(args.repeats):
            for name, extra in runs.items():
                pair = [*COMMON, *JOINER, f"run_id=data-fetch-{name}-{i}", f"p2p.initial_peers=['{maddr}']"]
                r = first_round(work, f"{name}-{i}", [*pair, *extra], [*pair, *runs["local"]])
                results[name].append(r)
                print(f"{name} #{i}: {r}", file=sys.stderr)
        shutil.rmtree(work / "copy", ignore_errors=True)
        fetch = subprocess.run([sys.executable, "-c", _FETCH, maddr, manifest["id"], str(work / "copy")],
                               capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)
        if fetch.returncode != 0:
            raise SystemExit(f"fetch-data failed:\n{fetch.stderr[-3000:]}")
        copy = json.loads(fetch.stdout.strip().splitlines()[-1])
    finally:
        for proc in reversed(procs):
            proc.kill()
            proc.wait()
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    report(manifest, results, copy, args)


def report(manifest: dict, results: dict[str, list[dict]], copy: dict, args: argparse.Namespace) -> None:
    shard_mb = manifest["shard_tokens"] * 2 / MB
    best = {k: min(v, key=lambda r: r["first_round_s"]) for k, v in results.items()}
    # After joining the DHT: the part that depends on where the data is (joining is the same work
    # for both and, on a loaded machine, the noisiest part), fastest of the repeats.
    after = {k: min(r["first_round_s"] - r["joined_s"] for r in v) for k, v in results.items()}
    print(f"\ncorpus: {args.size_mb} MB of text, {manifest['total_tokens'] * 2 / MB:.0f} MB of tokens in "
          f"{len(manifest['shards'])} shards of {shard_mb:.0f} MB; loopback, tiny preset, fastest of {args.repeats}\n")
    print("| node | start to first inner step | to first committed round | of which joining the DHT "
          "| round after joining | fetched by then | peak RSS |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in best.items():
        print(f"| {name} | {r['first_step_s']:.1f} s | {r['first_round_s']:.1f} s ({'/'.join(r['round_status'])}) "
              f"| {r['joined_s']:.1f} s | {r['first_round_s'] - r['joined_s']:.1f} s "
              f"| {r['fetched_mb']:.0f} MB | {r['peak_rss_mb']:.0f} MB |")
    ratio = best["swarm"]["first_round_s"] / best["local"]["first_round_s"]
    print(f"\nfirst committed round, swarm:<id> over local shards: {ratio:.2f}x from the process start "
          f"(fastest of each); after joining the DHT {after['swarm']:.1f} s vs {after['local']:.1f} s "
          f"= {after['swarm'] / after['local']:.2f}x (load average {os.getloadavg()[0]:.1f})")
    print(f"\nfetch-data, the whole corpus: {copy['bytes'] / MB:.0f} MB in {copy['seconds']:.1f} s = "
          f"{copy['mb_per_s']:.0f} MB/s (peak RSS {copy['peak_rss_mb']:.0f} MB)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"size_mb": args.size_mb, "shards": len(manifest["shards"]), "shard_mb": shard_mb,
                                    "runs": results, "first_round_ratio": ratio,
                                    "after_join_s": after, "fetch_data": copy, "load_avg": os.getloadavg()}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
