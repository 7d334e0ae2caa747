"""Settings that make any test run tiny, and the `--set` arguments that carry them."""

from __future__ import annotations

# A few hundred thousand parameters, a 300 kB corpus slice, 5 inner steps a round.
TINY = [
    "model.preset=tiny", "data.max_bytes=300000", "inner.batch_size=4", "inner.seq_len=64",
    "inner.warmup_steps=2", "inner.lr=0.003", "outer.inner_steps=5", "train.max_rounds=4",
    "train.eval_batches=2", "train.num_threads=1",
]

# A tiny swarm on loopback: short network timeouts so a fault costs seconds.
SWARM = TINY + [
    "run_id=swarm-test", "p2p.host_maddrs=['/ip4/127.0.0.1/tcp/0']", "p2p.connect_timeout=20",
    "sync.min_group_size=2", "sync.matchmaking_timeout=6", "sync.allreduce_timeout=8", "sync.state_timeout=16",
    "p2p.reachability=public",  # loopback: no dial-back probe at start (tests/integration/test_nat.py probes)
]


def set_args(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]
