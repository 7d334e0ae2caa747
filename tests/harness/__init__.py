"""The one test harness for integration and fault tests.

- `settings`: the tiny run settings (`TINY`, `SWARM`) and `set_args`.
- `procs`: a child process in its own session (`Proc`), a set of them (`Procs`), `run_cli`,
  bounded waits (`wait_until`) and a run directory's `metrics.jsonl` records (`read_records`).
- `swarm`: a seed and training nodes started with the CLI (`ProcessSwarm`, `Node`).
- `loopback`: hivemind DHTs on loopback with their P2P replicas, in this process (`LoopbackPeers`).
- `reaping`: finding and killing whatever a test started, also what escaped its process group.

Modules are imported one by one (`from tests.harness.swarm import ProcessSwarm`): a test that only
starts processes does not import hivemind.
"""
