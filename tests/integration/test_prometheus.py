"""Operations against a live 2-node swarm: a real Prometheus server scrapes it, `promtool`
checks each exposition, every metric deploy/ uses is really exported, and `status --json`
agrees with the nodes' own metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from diloco_p2p.launch import free_port
from diloco_p2p.metrics import exported_names, read_port_file
from tests.conftest import run_cli
from tests.swarm_procs import Proc, Swarm, wait_until
from tests.unit.test_deploy_files import alert_rules, dashboard_queries

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                reason="needs the prometheus package (apt-get install -y prometheus)")

OVERRIDES = ["train.max_rounds=200", "sync.target_group_size=2", "metrics.port=-1"]


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


class Prometheus:
    """A real Prometheus server scraping `targets` every second (it cannot bind port 0: a free
    port is picked and the start retried if another process took it meanwhile)."""

    def __init__(self, root: Path, targets: list[str]):
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                  "scrape_configs": [{"job_name": "diloco", "static_configs": [{"targets": targets}]}]}
        (root / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        for _ in range(3):
            self.port = free_port()
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._ready(timeout=30):
                return
            self.stop()
        raise AssertionError("prometheus did not start")

    def _ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                return _get(f"http://127.0.0.1:{self.port}/-/ready") is not None
            except OSError:
                time.sleep(0.2)
        return False

    def query(self, promql: str) -> dict[str, float]:
        """Instance -> value of an instant query."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        body = json.loads(_get(url))
        assert body["status"] == "success", body
        return {r["metric"]["instance"]: float(r["value"][1]) for r in body["data"]["result"]}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    root = tmp_path_factory.mktemp("ops")
    swarm = Swarm(root)
    prometheus = None
    try:
        nodes = [swarm.node(name, OVERRIDES) for name in ("a", "b")]
        swarm.release(*nodes)
        for n in nodes:
            wait_until(lambda n=n: read_port_file(n.run_dir) is not None, 60, "the metrics port", n)
        seed_port = free_port()
        seed = swarm._add(Proc(["seed", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--metrics-port", str(seed_port)],
                               root / "seed2.log"))
        wait_until(lambda: b"diloco_" in _try_get(f"http://127.0.0.1:{seed_port}/metrics"), 60, "seed metrics", seed)
        targets = {n.run_dir.name: f"127.0.0.1:{read_port_file(n.run_dir)}" for n in nodes}
        prometheus = Prometheus(root, list(targets.values()))
        yield swarm, nodes, targets, prometheus, f"127.0.0.1:{seed_port}"
    finally:
        if prometheus is not None:
            prometheus.stop()
        swarm.close()


def _try_get(url: str) -> bytes:
    try:
        return _get(url)
    except OSError:
        return b""


def test_prometheus_sees_both_nodes_advance_and_train(ops):
    _, nodes, targets, prometheus, _ = ops
    instances = set(targets.values())

    def rounds() -> dict[str, float]:
        return prometheus.query("diloco_round")

    wait_until(lambda: set(rounds()) == instances and min(rounds().values()) >= 1, 90, "rounds in Prometheus", *nodes)
    first = rounds()
    wait_until(lambda: all(rounds()[i] > first[i] for i in instances), 90, "the round gauge to advance", *nodes)
    tokens_per_s = prometheus.query("diloco_tokens_per_second")
    assert set(tokens_per_s) == instances and min(tokens_per_s.values()) > 0
    committed = prometheus.query('diloco_rounds_total{status="committed"}')
    assert set(committed) == instances and min(committed.values()) >= 1
    assert set(prometheus.query("up == 1")) == instances


def test_promtool_finds_each_exposition_clean(ops):
    _, _, targets, _, seed = ops
    for target in [*targets.values(), seed]:
        text = _get(f"http://{target}/metrics")
        result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
        assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
            target, result.stdout.decode(), result.stderr.decode())


def test_every_metric_deploy_uses_is_exported_by_a_live_process(ops):
    _, _, targets, _, seed = ops
    live = set()
    for target in [*targets.values(), seed]:
        live |= exported_names(_get(f"http://{target}/metrics"))
    used = set()
    for expr in dashboard_queries() + [rule["expr"] for rule in alert_rules() if "expr" in rule]:
        used |= set(_metric_names(expr))
    assert used and used <= live, sorted(used - live)


def _metric_names(expr: str) -> list[str]:
    return re.findall(r"\bdiloco_[A-Za-z0-9_]+", expr)


def test_status_json_lists_both_nodes_at_the_rounds_their_metrics_show(ops):
    swarm, nodes, targets, prometheus, _ = ops

    def gauges() -> dict[str, float]:
        out = {}
        for n in nodes:
            for line in _get(f"http://{targets[n.run_dir.name]}/metrics").decode().splitlines():
                if line.startswith("diloco_round "):
                    out[n.run_dir.name] = float(line.split()[1])
        return out

    before = gauges()
    result = run_cli(["status", "--initial-peers", swarm.maddr, "--run-id", "swarm-test", "--json"], timeout=60)
    after = gauges()
    assert result.returncode == 0, result.stderr
    rounds = {row["peer_id"]: row["round"] for row in json.loads(result.stdout)}
    peer_ids = {n.run_dir.name: re.search(r"\(peer id (\w+)\)", n.output()).group(1) for n in nodes}
    assert set(rounds) == set(peer_ids.values())
    for name, peer in peer_ids.items():
        # A node sets its gauge, then publishes the round's record: status sees round r-1 or r.
        assert before[name] - 1 <= rounds[peer] <= after[name], (name, rounds[peer], before, after)


def test_status_against_a_run_with_no_nodes_is_one_clear_line(ops):
    swarm, _, _, _, _ = ops
    result = run_cli(["status", "--initial-peers", swarm.maddr, "--run-id", "nobody-here", "--json",
                      "--timeout", "10"], timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: no progress records for run id 'nobody-here'")
