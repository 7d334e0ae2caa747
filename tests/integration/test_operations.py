"""Operations against a live swarm of real processes: a seed and two nodes on loopback, every
metrics endpoint on an ephemeral port (`metrics.port=-1`, `seed --metrics-port -1`), scraped
by a real Prometheus server.

The nodes park in round `HOLD_ROUND` (fault `hold@delta`: the training loop blocks while the
metrics endpoint, the DHT records and the state server keep answering), so every read below
sees the same, known round: Prometheus recorded both nodes at round 0 before the start gate
opened and at round `HOLD_ROUND - 1` now; `status --json` must give exactly that round and the
last round's tokens/s and loss that the nodes' own endpoints export.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from hivemind.p2p import P2P

from diloco_p2p.local.launch import free_port
from diloco_p2p.loop.metrics import exported_names, read_port_file
from diloco_p2p.swarm.transport.dht import peer_id_of
from tests.harness.procs import run_cli, run_clis, wait_until
from tests.harness.swarm import Node, ProcessSwarm
from tests.unit.test_deploy_files import METRIC, alert_rules, dashboard_queries

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                reason="needs the prometheus package (apt-get install -y prometheus)")

HOLD_ROUND = 4  # the nodes complete rounds 1-3 and park inside round 4
DONE = HOLD_ROUND - 1
OVERRIDES = ["train.max_rounds=50", "sync.target_group_size=2", "metrics.port=-1"]
HOLD = {"DILOCO_P2P_FAULTS": f"hold@delta:{HOLD_ROUND}"}


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


class Prometheus:
    """A real Prometheus server scraping `targets` every second. It cannot bind port 0: a free
    port is picked and the start retried if another process took it in between."""

    def __init__(self, root: Path, targets: list[str]):
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                  "scrape_configs": [{"job_name": "diloco", "static_configs": [{"targets": targets}]}]}
        (root / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = root / "prometheus.log"
        for _ in range(3):
            self.port = free_port()
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen(
                    ["prometheus", f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
                     f"--web.listen-address=127.0.0.1:{self.port}"], stdout=log, stderr=subprocess.STDOUT)
            if self._ready(timeout=30):
                return
            self.stop()
        raise AssertionError(f"prometheus did not start:\n{self.log.read_text()[-3000:]}")

    def _ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                return _get(f"http://127.0.0.1:{self.port}/-/ready") is not None
            except OSError:
                time.sleep(0.2)
        return False

    def query(self, promql: str) -> dict[str, float]:
        """Instance -> value of an instant query (one series per instance)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        body = json.loads(_get(url))
        assert body["status"] == "success", body
        out = {r["metric"].get("instance", ""): float(r["value"][1]) for r in body["data"]["result"]}
        assert len(out) == len(body["data"]["result"]), body  # one series per instance
        return out

    def names(self) -> set[str]:
        """Every metric name Prometheus has stored from its targets."""
        url = f"http://127.0.0.1:{self.port}/api/v1/label/__name__/values"
        return set(json.loads(_get(url))["data"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Ops:
    swarm: ProcessSwarm
    nodes: dict[str, Node]
    targets: dict[str, str]  # "a", "b", "seed" -> host:port of its metrics endpoint
    prometheus: Prometheus

    def exposition(self, name: str) -> str:
        return _get(f"http://{self.targets[name]}/metrics").decode()

    def gauge(self, name: str, metric: str) -> float:
        values = [float(line.split()[1]) for line in self.exposition(name).splitlines()
                  if line.startswith(metric + " ")]
        assert len(values) == 1, (name, metric)
        return values[0]


def _seed_metrics_port(swarm: ProcessSwarm) -> int | None:
    m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", swarm.seed.output())
    return int(m.group(1)) if m else None


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    root = tmp_path_factory.mktemp("ops")
    swarm = ProcessSwarm(root, seed_args=["--metrics-port", "-1"])
    prometheus = None
    try:
        nodes = {name: swarm.node(name, OVERRIDES, env=HOLD) for name in ("a", "b")}
        swarm.wait_joined(*nodes.values())  # metrics are served before the node joins
        wait_until(lambda: _seed_metrics_port(swarm) is not None, 30, "the seed's metrics port", swarm.seed)
        targets = {name: f"127.0.0.1:{read_port_file(n.run_dir)}" for name, n in nodes.items()}
        targets["seed"] = f"127.0.0.1:{_seed_metrics_port(swarm)}"
        prometheus = Prometheus(root, list(targets.values()))
        # Prometheus has both nodes at round 0 before any round starts ...
        at_zero = {targets["a"]: 0.0, targets["b"]: 0.0}
        wait_until(lambda: prometheus.query("diloco_round") == at_zero, 60, "Prometheus to scrape round 0",
                   *nodes.values())
        swarm.release(*nodes.values())
        # ... and both park in round HOLD_ROUND, rounds 1..DONE done and published.
        for n in nodes.values():
            wait_until(lambda n=n: f"fault injection: hold at delta of round {HOLD_ROUND}" in n.output(), 120,
                       f"{n.run_dir.name} to park in round {HOLD_ROUND}", n)
        yield Ops(swarm, nodes, targets, prometheus)
    finally:
        if prometheus is not None:
            prometheus.stop()
        swarm.close()


def test_prometheus_sees_both_nodes_advance_from_round_0_and_train(ops):
    p, t = ops.prometheus, ops.targets
    nodes = {t["a"], t["b"]}
    wait_until(lambda: p.query("diloco_round") == {i: DONE for i in nodes}, 30, f"Prometheus to see round {DONE}")
    assert p.query("min_over_time(diloco_round[10m])") == {i: 0.0 for i in nodes}  # scraped before release
    tokens_per_s = p.query("diloco_tokens_per_second")
    assert set(tokens_per_s) == nodes and min(tokens_per_s.values()) > 0, tokens_per_s
    ended = p.query("sum by (instance) (diloco_rounds_total)")
    assert set(ended) == nodes and min(ended.values()) >= DONE, ended
    committed = p.query('diloco_rounds_total{status="committed"}')
    assert set(committed) == nodes and min(committed.values()) >= 1, committed
    assert p.query("up") == {i: 1.0 for i in t.values()}
    # The seed sees both nodes in its routing table (refreshed every few seconds).
    wait_until(lambda: p.query("diloco_dht_peers").get(t["seed"], 0) >= 2, 30, "the seed's DHT peer count")


def test_promtool_finds_each_live_exposition_clean(ops):
    for name in ("a", "b", "seed"):
        text = ops.exposition(name)
        assert "diloco_uptime_seconds" in text
        result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
            name, result.stdout, result.stderr)


def test_every_metric_deploy_uses_is_exported_by_each_live_node_and_stored_by_prometheus(ops):
    used = {m for expr in dashboard_queries() + [r["expr"] for r in alert_rules()] for m in METRIC.findall(expr)}
    assert len(used) >= 10
    for name in ("a", "b"):
        live = exported_names(ops.exposition(name))
        assert used <= live, (name, sorted(used - live))
    stored = ops.prometheus.names()
    assert used <= stored, sorted(used - stored)


def _status(*args: str) -> subprocess.CompletedProcess:
    return run_cli(["status", *args], timeout=90)


def test_status_json_lists_both_nodes_at_the_round_and_rate_their_metrics_show(ops):
    result = _status("--initial-peers", ops.swarm.maddr, "--run-id", "swarm-test", "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["peer_id"]: row for row in json.loads(result.stdout)}
    peers = {name: peer_id_of(n.run_dir / "identity.key") for name, n in ops.nodes.items()}
    assert set(rows) == set(peers.values())
    for name, peer in peers.items():
        row, last = rows[peer], ops.nodes[name].records()[-1]
        assert row["round"] == last["round"] == ops.gauge(name, "diloco_round") == DONE, (name, row)
        assert row["tokens_per_s"] == pytest.approx(ops.gauge(name, "diloco_tokens_per_second"), rel=1e-9)
        assert row["tokens_per_s"] == pytest.approx(last["tokens_per_s"], rel=1e-9) and row["tokens_per_s"] > 0
        if last["train_loss"] is not None:  # a resynced round has none
            assert row["train_loss"] == pytest.approx(ops.gauge(name, "diloco_round_train_loss"), rel=1e-9)
        assert row["params_sha256"] == last["params_sha256"]
        assert row["hash_agrees"] and row["config_agrees"], row
        assert row["last_seen_s"] < 60, row


def _one_error_line(result: subprocess.CompletedProcess, start: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), result.stderr


def test_status_against_a_fresh_seed_with_no_swarm_is_one_clear_line(tmp_path):
    with ProcessSwarm(tmp_path) as empty:
        result = _status("--initial-peers", empty.maddr, "--run-id", "swarm-test", "--json", "--timeout", "10")
    _one_error_line(result, "error: no progress records for run id 'swarm-test'")


def test_status_against_an_unreachable_or_malformed_address_is_one_clear_line(tmp_path):
    key = tmp_path / "nobody.key"
    P2P.generate_identity(str(key))
    unreachable = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{peer_id_of(key)}"  # nothing listens there
    unreached, malformed, no_peer_id = run_clis(  # three independent one-line failures, at once
        ["status", "--initial-peers", unreachable, "--run-id", "swarm-test", "--timeout", "5"],
        ["status", "--initial-peers", "seed.example.org:31337", "--run-id", "swarm-test"],
        ["status", "--initial-peers", f"/ip4/127.0.0.1/tcp/{free_port()}", "--run-id", "swarm-test"], timeout=90)
    _one_error_line(unreached, "error: could not reach any initial peer")
    _one_error_line(malformed, "error: p2p.initial_peers: 'seed.example.org:31337' is not a valid multiaddr")
    _one_error_line(no_peer_id, "error: p2p.initial_peers:")  # no /p2p/<peer id> part
