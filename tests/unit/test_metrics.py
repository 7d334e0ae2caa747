"""Prometheus metrics: values of an observed round, naming rules, build info, endpoints, promtool."""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import socket
import subprocess
import time
import urllib.request
from importlib import metadata
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from diloco_p2p import __version__
from diloco_p2p.errors import UserError
from diloco_p2p.loop.metrics import (
    ALLREDUCE_BUCKETS,
    ROUND_STATUSES,
    NodeMetrics,
    SeedMetrics,
    exported_names,
    exposition,
    read_port_file,
    serve_metrics,
    start_metrics_server,
    start_seed_metrics,
    write_port_file,
)

ROUND = {
    "round": 3, "step": 150, "status": "committed", "group_size": 3, "allreduce_seconds": 0.25,
    "bytes_sent": 1000, "bytes_received": 900, "tokens_per_s": 1234.5, "train_loss": 3.25,
    "eval_loss": 3.5, "dropped_peers": 1, "params_agree": True, "config_agree": False,
    "state_bytes": 4096, "state_seconds": 1.5, "seconds": 12.0, "params_sha256": "ab" * 32,
}


def samples(metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, parsed back from the text exposition."""
    text = exposition(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


def test_observed_round_appears_in_exposition():
    m = NodeMetrics()
    m.observe_round(ROUND)
    s = samples(m)
    assert s[("diloco_round", ())] == 3
    assert s[("diloco_rounds_total", (("status", "committed"),))] == 1
    for status in ROUND_STATUSES:  # every status is exported from the start
        if status != "committed":
            assert s[("diloco_rounds_total", (("status", status),))] == 0
    assert s[("diloco_group_size", ())] == 3
    assert s[("diloco_allreduce_seconds_count", ())] == 1
    assert s[("diloco_allreduce_seconds_sum", ())] == 0.25
    assert s[("diloco_allreduce_seconds_bucket", (("le", "0.1"),))] == 0
    assert s[("diloco_allreduce_seconds_bucket", (("le", "0.25"),))] == 1
    assert s[("diloco_allreduce_sent_bytes_total", ())] == 1000
    assert s[("diloco_allreduce_received_bytes_total", ())] == 900
    assert s[("diloco_tokens_per_second", ())] == 1234.5
    assert s[("diloco_round_train_loss", ())] == 3.25
    assert s[("diloco_eval_loss", ())] == 3.5
    assert s[("diloco_dropped_peers_total", ())] == 1
    assert s[("diloco_params_hash_agreement", ())] == 1
    assert s[("diloco_config_hash_agreement", ())] == 0
    assert s[("diloco_state_download_bytes_total", ())] == 4096
    assert s[("diloco_state_download_seconds_count", ())] == 1
    assert s[("diloco_state_download_seconds_sum", ())] == 1.5
    assert s[("diloco_round_duration_seconds", ())] == 12.0
    assert time.time() - s[("diloco_last_round_timestamp_seconds", ())] < 60


def test_counters_accumulate_over_rounds_and_steps():
    m = NodeMetrics()
    for loss in (4.0, 3.0, 2.5):
        m.observe_inner_step(512, loss)
    m.observe_round(ROUND)
    m.observe_round({**ROUND, "round": 4, "status": "alone", "bytes_sent": 24, "params_agree": False})
    assert value(m, "diloco_inner_steps_total") == 3
    assert value(m, "diloco_tokens_total") == 3 * 512
    assert value(m, "diloco_train_loss") == 2.5  # the latest step's
    assert value(m, "diloco_round") == 4
    assert value(m, "diloco_rounds_total", status="committed") == 1
    assert value(m, "diloco_rounds_total", status="alone") == 1
    assert value(m, "diloco_allreduce_sent_bytes_total") == 1024
    assert value(m, "diloco_params_hash_agreement") == 0
    assert value(m, "diloco_moments_averages_total", status="ok") == 0  # exported before any
    for moments in ("ok", "ok", "partial", "bogus", None):
        m.observe_round({**ROUND, "moments": moments})
    assert value(m, "diloco_moments_averages_total", status="ok") == 2
    assert value(m, "diloco_moments_averages_total", status="partial") == 1
    assert value(m, "diloco_moments_averages_total", status="failed") == 0


def test_unknown_values_are_nan_until_observed():
    """NaN, not 0: a 0 would read as a perfect loss or a hash disagreement and fire alerts."""
    m = NodeMetrics()
    for name in ("diloco_eval_loss", "diloco_train_loss", "diloco_round_train_loss",
                 "diloco_params_hash_agreement", "diloco_config_hash_agreement", "diloco_dht_peers"):
        assert math.isnan(value(m, name)), name
    m.set_dht_peers(7)
    assert value(m, "diloco_dht_peers") == 7
    assert math.isnan(value(m, "diloco_reachable"))
    m.set_reachability("private")
    assert value(m, "diloco_reachable") == 0
    m.set_reachability("public")
    assert value(m, "diloco_reachable") == 1


def test_missing_and_none_keys_are_skipped():
    m = NodeMetrics()
    m.observe_round({"round": 1, "status": "alone", "eval_loss": None, "train_loss": None,
                     "allreduce_seconds": 0.0, "params_agree": None})
    assert value(m, "diloco_round") == 1
    assert value(m, "diloco_rounds_total", status="alone") == 1
    assert math.isnan(value(m, "diloco_eval_loss"))
    assert math.isnan(value(m, "diloco_params_hash_agreement"))
    assert value(m, "diloco_allreduce_seconds_count") == 0  # no all-reduce took place
    assert value(m, "diloco_allreduce_sent_bytes_total") == 0
    m.observe_round({})  # nothing at all: still no error
    assert value(m, "diloco_round") == 1


def test_unknown_status_is_not_a_label(caplog):
    m = NodeMetrics()
    with caplog.at_level(logging.WARNING, logger="diloco_p2p.loop.metrics"):
        m.observe_round({"round": 1, "status": "exploded"})
        m.observe_round({"round": 2, "status": "exploded"})
    statuses = {dict(k[1]).get("status") for k in samples(m) if k[0] == "diloco_rounds_total"}
    assert statuses == set(ROUND_STATUSES)
    assert sum("exploded" in r.getMessage() for r in caplog.records) == 1  # warned once


def test_naming_conventions():
    m = NodeMetrics()
    m.observe_round(ROUND)
    seed = SeedMetrics(peer_count=lambda: 2)
    seed.refresh()
    allowed_labels = {"status", "le", "version", "torch", "hivemind", "reason"}
    for registry in (m.registry, seed.registry):
        families = list(text_string_to_metric_families(exposition(registry).decode()))
        assert families
        for family in families:
            assert family.name.startswith("diloco_"), family.name
            for s in family.samples:
                assert set(s.labels) <= allowed_labels, (s.name, s.labels)
                if family.type == "counter":
                    assert s.name.endswith("_total"), s.name
        counters = {f.name for f in families if f.type == "counter"}
        gauges = {f.name for f in families if f.type == "gauge"}
        # The brief's names: anything counted ends _total, nothing else does.
        assert not any(g.endswith("_total") for g in gauges)
        if registry is m.registry:
            assert {"diloco_inner_steps", "diloco_tokens", "diloco_rounds", "diloco_dropped_peers",
                    "diloco_allreduce_sent_bytes", "diloco_allreduce_received_bytes",
                    "diloco_state_download_bytes"} <= counters


def test_allreduce_buckets_span_10ms_to_10min():
    assert ALLREDUCE_BUCKETS[0] == 0.01 and ALLREDUCE_BUCKETS[-1] == 600
    assert list(ALLREDUCE_BUCKETS) == sorted(ALLREDUCE_BUCKETS)


def test_build_info_and_process_times():
    m = NodeMetrics()
    info = [k for k in samples(m) if k[0] == "diloco_build_info"]
    assert len(info) == 1
    labels = dict(info[0][1])
    assert labels == {"version": __version__, "torch": metadata.version("torch"),
                      "hivemind": metadata.version("hivemind")}
    assert samples(m)[info[0]] == 1
    start = value(m, "diloco_process_start_time_seconds")
    uptime = value(m, "diloco_uptime_seconds")
    now = time.time()
    assert now - 24 * 3600 < start <= now + 1  # this test process started today, not in 1970
    assert 0 <= uptime and abs((now - start) - uptime) < 5
    # Before the first round, "last round" is the start time, so a node stuck joining is stale.
    assert value(m, "diloco_last_round_timestamp_seconds") == start


def test_registries_are_separate():
    a, b = NodeMetrics(), NodeMetrics()
    a.observe_round(ROUND)
    assert value(a, "diloco_round") == 3 and value(b, "diloco_round") == 0
    registry = CollectorRegistry()
    NodeMetrics(registry)
    with pytest.raises(ValueError):  # a name is declared once per registry
        NodeMetrics(registry)


def test_seed_metrics_refresh_keeps_last_value_on_error():
    counts = iter([5])

    def peer_count() -> int:
        return next(counts)  # the second call raises StopIteration, like a DHT that went away

    seed = SeedMetrics(peer_count=peer_count)
    assert math.isnan(value(seed, "diloco_dht_peers"))  # unknown until the first refresh
    seed.refresh()
    assert value(seed, "diloco_dht_peers") == 5
    seed.refresh()
    assert value(seed, "diloco_dht_peers") == 5
    assert "diloco_uptime_seconds" in exported_names(exposition(seed.registry))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_server_binds_ephemeral_port_and_shuts_down():
    m = NodeMetrics()
    m.observe_round(ROUND)
    server = start_metrics_server(m.registry, "127.0.0.1", 0)
    try:
        assert server.port > 0
        assert "diloco_round 3.0" in scrape(server.port)
    finally:
        server.shutdown()
    with pytest.raises(OSError):
        scrape(server.port)


def test_serve_metrics_returns_the_bound_port():
    m = NodeMetrics()
    port = serve_metrics(m.registry, "127.0.0.1", 0)
    m.observe_inner_step(64, 1.5)
    assert "diloco_tokens_total 64.0" in scrape(port)


@pytest.mark.parametrize("start, option", [
    (lambda port: serve_metrics(NodeMetrics().registry, "127.0.0.1", port), "metrics.port"),
    (lambda port: start_seed_metrics("127.0.0.1", port, dht=None), "--metrics-port"),
])
def test_a_port_in_use_is_one_line_naming_it_and_the_setting(start, option):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError) as e:
            start(port)
    msg = str(e.value)
    assert msg.startswith(f"cannot serve metrics on 127.0.0.1:{port} (") and "\n" not in msg
    assert f"choose a free port with {option}" in msg and e.value.exit_code == 2


def test_start_seed_metrics_reads_the_dht():
    # dht_peer_count runs a coroutine inside the DHT process; this fake runs it here.
    node = SimpleNamespace(protocol=SimpleNamespace(routing_table=SimpleNamespace(uid_to_peer_id={1: "a", 2: "b", 3: "c"})))

    class FakeDHT:
        def run_coroutine(self, fn):
            return asyncio.run(fn(self, node))

    server = start_seed_metrics("127.0.0.1", 0, FakeDHT(), interval=0.05)
    try:
        deadline = time.monotonic() + 10
        while "diloco_dht_peers 3.0" not in (text := scrape(server.port)):
            assert time.monotonic() < deadline, text
            time.sleep(0.05)
        assert "diloco_build_info{" in text
    finally:
        server.shutdown()


def test_port_file_roundtrip(tmp_path):
    assert read_port_file(tmp_path) is None
    path = write_port_file(tmp_path / "run", 43123)
    assert path.read_text() == "43123\n"
    assert read_port_file(tmp_path / "run") == 43123
    assert not list((tmp_path / "run").glob("*.tmp"))


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (apt-get install -y prometheus)")
def test_promtool_check_metrics_is_clean():
    m = NodeMetrics()
    m.observe_inner_step(512, 3.0)
    m.observe_round(ROUND)
    seed = SeedMetrics(peer_count=lambda: 4)
    seed.refresh()
    for registry in (m.registry, seed.registry):
        out = subprocess.run(["promtool", "check", "metrics"], input=exposition(registry),
                             capture_output=True, timeout=30)
        # promtool prints one line per lint problem and exits non-zero; clean = silent and 0.
        assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), (out.stdout + out.stderr).decode()


def test_rejections_are_counted_by_reason_from_the_round_record():
    m = NodeMetrics()
    m.observe_round({**ROUND, "rejections": {"QmA": ["forged-record", "unvouched-state"], "QmB": ["not-admitted"],
                                             "QmC": ["bogus"]}})
    m.observe_round({**ROUND, "rejections": {"QmA": ["forged-record"]}})
    counts = {dict(k[1])["reason"]: v for k, v in samples(m).items() if k[0] == "diloco_rejections_total"}
    assert counts == {"forged-record": 2.0, "not-admitted": 1.0, "past-max-rounds": 0.0, "unvouched-state": 1.0,
                      "bad-state": 0.0, "weight": 0.0, "norm": 0.0, "reducer": 0.0, "malformed": 0.0, "opposed": 0.0}
