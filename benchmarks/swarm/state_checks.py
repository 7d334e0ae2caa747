"""What checking a state as a whole costs (issue 48), at a preset's state size (default 150m).

Every member hashes the whole state it serves once a round (`codec.state_sha256`: θ's hash is
cached, so the new work is the outer momentum's hash); a joiner checks a download's layout on its
header, every value finite, and the whole state's hash (θ and momentum) against the one vouched for,
where before it hashed θ alone. Measured on this machine's CPU (medians of `--repeats`), and set
against one round of the preset: H inner steps of its batch at the tokens/s measured on an H100
(`benchmarks/gpu/results/gpu_h100.txt`: 150m with torch.compile, 490,153 tokens/s).

    python benchmarks/swarm/state_checks.py [--preset 150m] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from diloco_p2p.config import load_config  # noqa: E402
from diloco_p2p.hashing import tensor_sha256  # noqa: E402
from diloco_p2p.model.build import build_model, build_tokenizer, count_parameters  # noqa: E402
from diloco_p2p.swarm.state.codec import THETA, pack_state, state_sha256, unpack_state  # noqa: E402
from diloco_p2p.swarm.vouching import layout_of  # noqa: E402

H100_TOKENS_PER_S = {"150m": 490_153}  # gpu_h100.txt, "ours+compile"


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="150m")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    cfg = load_config(Path(f"configs/{args.preset}.yaml"), ["train.compile=false"])
    model = build_model(cfg.model, build_tokenizer(cfg.model).vocab_size, seed=0)
    n = count_parameters(model)
    theta = torch.cat([q.detach().reshape(-1).float() for q in model.parameters()])
    del model
    state = {THETA: theta, "outer.momentum": torch.randn_like(theta) * 1e-3}
    meta = {"round": 7, "averaged_round": 7}
    theta_hash = tensor_sha256(theta)
    blob = pack_state(state, meta)
    layout = layout_of(state)
    rows = {
        "member, per round: the whole-state hash (θ's cached)":
            _median_s(lambda: state_sha256(state, 7, 7, known={THETA: theta_hash}), args.repeats),
        "joiner, before: unpack, θ's hash":
            _median_s(lambda: tensor_sha256(unpack_state(blob)[0][THETA]), args.repeats),
        "joiner, now: unpack with layout and finite checks, whole-state hash":
            _median_s(lambda: state_sha256(unpack_state(blob, layout)[0], 7, 7), args.repeats),
    }
    steps, batch = cfg.outer.inner_steps, cfg.inner.batch_size * cfg.inner.seq_len
    tokens_per_s = H100_TOKENS_PER_S.get(args.preset)
    round_s = steps * batch / tokens_per_s if tokens_per_s else None
    print(f"preset {args.preset}: {n:,} parameters, state of {len(blob) / 2**30:.2f} GiB (θ and momentum, fp32); "
          f"{torch.get_num_threads()} CPU threads")
    if round_s:
        print(f"one round: H={steps} x {batch:,} tokens at {tokens_per_s:,} tokens/s (one H100) = {round_s:.1f} s")
    print(f"{'check':<70} {'seconds':>8} {'of a round':>11}")
    for what, seconds in rows.items():
        share = f"{100 * seconds / round_s:.2f}%" if round_s else "-"
        print(f"{what:<70} {seconds:>8.3f} {share:>11}")
    added = rows["joiner, now: unpack with layout and finite checks, whole-state hash"] - \
        rows["joiner, before: unpack, θ's hash"]
    print(f"{'joiner, added by the checks':<70} {added:>8.3f} "
          f"{(f'{100 * added / round_s:.2f}%' if round_s else '-'):>11}")


if __name__ == "__main__":
    main()
