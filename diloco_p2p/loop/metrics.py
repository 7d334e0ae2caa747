"""Every Prometheus metric of diloco-p2p, declared once, and the endpoints that serve them.

A node exports its round, steps, tokens, losses, throughput, how each round ended, all-reduce
time and traffic, state downloads and whether its θ agrees with its group; a seed exports its
DHT peers and uptime. Names follow ``diloco_<noun>_<unit>``, counters end ``_total``, labels take
a small fixed set of values; the dashboards and alerts in ``deploy/`` use these names (a test
checks it). Each `NodeMetrics` / `SeedMetrics` owns its own registry (several nodes in one
process), is fed the same round record as ``metrics.jsonl``, and reports NaN, not 0, for what is
not known yet, so no alert fires on it. The conventions: docs/architecture.md, "Logs and metrics".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from diloco_p2p.contract import REJECTION_REASONS
from diloco_p2p.errors import UserError

log = logging.getLogger(__name__)

# The round outcomes a node reports (issue 3's round record `status`, plus `resynced` after a
# state download and `skipped`); the label set of diloco_rounds_total. Every value is exported
# from the start (at 0) so that rate() and the dashboard see a series before the first event.
ROUND_STATUSES = ("committed", "alone", "failed", "resynced", "skipped")
MOMENTS_STATUSES = ("ok", "partial", "failed")  # sync.average_moments' all-reduce (`RoundOutcome.moments`)
# All-reduce of a pseudo-gradient: ~10 ms on loopback for the tiny model, minutes for a 1B model
# over a home uplink; allreduce_timeout bounds it, so nothing lasts much beyond 10 minutes.
ALLREDUCE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# A full state download (θ + momentum, 2 x 4 bytes per parameter): same range, a bit longer.
STATE_BUCKETS = (0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# How often the seed refreshes its DHT peer count (a call into the DHT process; kept off the
# scrape path so a slow DHT never stalls a scrape).
SEED_REFRESH_SECONDS = 5.0
# File in the run directory that holds the bound metrics port (for ephemeral ports).
PORT_FILE = "metrics_port"

NAN = float("nan")


# -- shared by node and seed --------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def build_labels() -> dict[str, str]:
    """Versions that explain a run's behaviour: ours, torch's and hivemind's (not imported here)."""
    from diloco_p2p import __version__

    return {"version": __version__, "torch": _version("torch"), "hivemind": _version("hivemind")}


def process_start_time() -> float:
    """Unix time this process started (from /proc on Linux; else the time of the first call)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); fields[0] is field 3
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _FALLBACK_START


_FALLBACK_START = time.time()


class _UptimeCollector:
    """diloco_uptime_seconds computed at scrape time (a stored gauge would be stale between refreshes)."""

    def __init__(self, start: float):
        self.start = start

    def _family(self, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily("diloco_uptime_seconds", "Seconds since this process started.", value=value)

    def describe(self) -> Iterable[Metric]:
        yield self._family(0.0)

    def collect(self) -> Iterable[Metric]:
        yield self._family(max(0.0, time.time() - self.start))


def _register_process_metrics(registry: CollectorRegistry) -> None:
    start = process_start_time()
    g = Gauge("diloco_process_start_time_seconds", "Start time of the process since the unix epoch.",
              registry=registry)
    g.set(start)
    Info("diloco_build", "Versions of diloco-p2p, torch and hivemind in this process.",
         registry=registry).info(build_labels())
    registry.register(_UptimeCollector(start))


# -- the node -----------------------------------------------------------------------------------


class NodeMetrics:
    """A training node's metrics. The node calls `observe_inner_step` after every inner step,
    `observe_round` with every round record, `set_dht_peers` when it looks at the DHT."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        _register_process_metrics(r)
        self.round = Gauge("diloco_round", "Outer round this node has completed (its copy of the swarm's round).",
                           registry=r)
        self.last_round_time = Gauge(
            "diloco_last_round_timestamp_seconds",
            "Unix time the last round ended; the process start time before the first round.", registry=r)
        self.last_round_time.set(process_start_time())
        self.round_duration = Gauge("diloco_round_duration_seconds",
                                    "Wall time of the last round (inner steps, averaging, evaluation).", registry=r)
        self.inner_steps = Counter("diloco_inner_steps", "Inner AdamW steps taken by this process.", registry=r)
        self.tokens = Counter("diloco_tokens", "Training tokens processed by this process.", registry=r)
        self.train_loss = Gauge("diloco_train_loss", "Training loss of the latest inner step.", registry=r)
        self.round_train_loss = Gauge("diloco_round_train_loss",
                                      "Mean training loss over the inner steps of the last round.", registry=r)
        self.eval_loss = Gauge("diloco_eval_loss", "Held-out loss of the global parameters at the last evaluation.",
                               registry=r)
        self.tokens_per_second = Gauge("diloco_tokens_per_second",
                                       "Training tokens per second over the last round.", registry=r)
        self.rounds = Counter("diloco_rounds", "Rounds ended, by outcome.", ["status"], registry=r)
        self.moments = Counter("diloco_moments_averages", "All-reduces of the inner first moments "
                               "(sync.average_moments) after committed rounds, by outcome.", ["status"], registry=r)
        self.group_size = Gauge("diloco_group_size", "Peers (this node included) that averaged in the last round.",
                                registry=r)
        self.allreduce_seconds = Histogram("diloco_allreduce_seconds",
                                           "Time of one all-reduce of the pseudo-gradient.",
                                           buckets=ALLREDUCE_BUCKETS, registry=r)
        self.allreduce_sent = Counter("diloco_allreduce_sent_bytes", "Bytes this node sent in all-reduces.",
                                      registry=r)
        self.allreduce_received = Counter("diloco_allreduce_received_bytes",
                                          "Bytes this node received in all-reduces.", registry=r)
        self.exposed_seconds = Gauge("diloco_exposed_sync_seconds",
                                     "Seconds the last round's training stood still for the swarm (matchmaking + "
                                     "all-reduce).", registry=r)
        self.outer_seconds = Gauge("diloco_outer_step_seconds",
                                   "Seconds of the last round's outer work: θ into the model, Δ back, the outer "
                                   "step and the hash of the new θ.", registry=r)
        self.utilization = Gauge("diloco_compute_utilization_ratio",
                                 "Inner-step seconds over round seconds, last round.", registry=r)
        self.wire_ratio = Gauge("diloco_allreduce_wire_time_ratio",
                                "Last all-reduce's seconds over the wire time of its bytes at sync.link_mbit "
                                "(1.0 = line rate; NaN without sync.link_mbit).", registry=r)
        self.state_bytes = Counter("diloco_state_download_bytes",
                                   "Bytes of swarm state (parameters, momentum) downloaded from donors.", registry=r)
        self.state_seconds = Histogram("diloco_state_download_seconds", "Time of one state download.",
                                       buckets=STATE_BUCKETS, registry=r)
        self.dht_peers = Gauge("diloco_dht_peers", "DHT peers this process sees.", registry=r)
        self.public = Gauge("diloco_reachable", "1 if other peers can dial this node, 0 behind NAT "
                            "(p2p.reachability; NaN: no swarm).", registry=r)
        self.public.set(NAN)
        self.dropped_peers = Counter("diloco_dropped_peers",
                                     "Group members whose contribution was missing from a round.", registry=r)
        self.params_agree = Gauge(
            "diloco_params_hash_agreement",
            "1 if this node's parameter hash matched its group's after the last round, 0 if not, NaN if unknown.",
            registry=r)
        self.config_agree = Gauge(
            "diloco_config_hash_agreement",
            "1 if this node's swarm config hash matches the swarm's, 0 if not, NaN if unknown.", registry=r)
        self.rejections = Counter(
            "diloco_rejections", "Peers this node refused, by reason (once per peer and reason per round; "
            "diloco_p2p.swarm.trust.guard).", ["reason"], registry=r)
        self._liveness_gauges(r)
        for status in ROUND_STATUSES:
            self.rounds.labels(status=status)
        for status in MOMENTS_STATUSES:
            self.moments.labels(status=status)
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason=reason)
        for g in (self.train_loss, self.round_train_loss, self.eval_loss, self.params_agree, self.config_agree,
                  self.dht_peers, self.exposed_seconds, self.outer_seconds, self.utilization, self.wire_ratio):
            g.set(NAN)
        self._warned: set[str] = set()

    def _liveness_gauges(self, r: CollectorRegistry) -> None:
        """Liveness (`diloco_p2p.swarm.membership.liveness`): per peer as this node saw it, and the deadlines."""
        self.peer_missed = Gauge("diloco_peer_missed_rounds", "Rounds of this node that did not wait for the peer "
                                 "(it was behind, silent or distrusted).", ["peer"], registry=r)
        self.peer_away_seconds = Gauge("diloco_peer_away_seconds", "Seconds this node has not waited for the peer, "
                                       "in all (the current absence included).", ["peer"], registry=r)
        self.peer_away = Gauge("diloco_peer_away", "1 while the peer is not waited for, 0 once it is back.", ["peer"],
                               registry=r)
        self.waited_for = Gauge("diloco_peers_waited_for", "Peers the last round's matchmaking waited for.", registry=r)
        self.matchmaking_deadline = Gauge("diloco_matchmaking_deadline_seconds", "How long the last round's group "
                                          "waited at most for the peers it expected (adaptive, at most "
                                          "sync.matchmaking_timeout).", registry=r)
        self.allreduce_deadline = Gauge("diloco_allreduce_deadline_seconds", "The last all-reduce's deadline "
                                        "(adaptive, at most sync.allreduce_timeout).", registry=r)
        self.first_commit = Gauge("diloco_first_commit_seconds", "Seconds from this process's start to its first "
                                  "round committed with the swarm (a restart's time to be back; NaN until then).",
                                  registry=r)
        for g in (self.waited_for, self.matchmaking_deadline, self.allreduce_deadline, self.first_commit):
            g.set(NAN)

    def observe_inner_step(self, tokens: int, loss: float) -> None:
        self.inner_steps.inc()
        self.tokens.inc(tokens)
        self.train_loss.set(float(loss))

    def observe_round(self, record: Mapping[str, Any]) -> None:
        """Take one round record (the dict written to metrics.jsonl). Missing or None keys are
        skipped: a solo node has no all-reduce, a resync has no losses."""
        get = record.get
        if (v := _number(get("round"))) is not None:
            self.round.set(v)
        self.last_round_time.set(time.time())
        if (v := _number(get("seconds"))) is not None:
            self.round_duration.set(v)
        status = get("status")
        if status in ROUND_STATUSES:
            self.rounds.labels(status=status).inc()
        elif status is not None and status not in self._warned:
            # A label outside the fixed set would be an unbounded series; an unknown status is a
            # bug in the record's producer, but it must not stop training.
            self._warned.add(status)
            log.warning("metrics: round status %r is not one of %s; not counted", status, ROUND_STATUSES)
        if get("moments") in MOMENTS_STATUSES:
            self.moments.labels(status=get("moments")).inc()
        if (v := _number(get("group_size"))) is not None:
            self.group_size.set(v)
        if (v := _number(get("allreduce_seconds"))) is not None and v > 0:
            self.allreduce_seconds.observe(v)  # 0 = no all-reduce took place (solo, alone, resync)
        if (v := _number(get("bytes_sent"))) is not None:
            self.allreduce_sent.inc(v)
        if (v := _number(get("bytes_received"))) is not None:
            self.allreduce_received.inc(v)
        for key, gauge in (("exposed_seconds", self.exposed_seconds), ("outer_seconds", self.outer_seconds),
                           ("utilization", self.utilization), ("wire_ratio", self.wire_ratio)):
            if (v := _number(get(key))) is not None:
                gauge.set(v)
        if (v := _number(get("tokens_per_s"))) is not None:
            self.tokens_per_second.set(v)
        if (v := _number(get("train_loss"))) is not None:
            self.round_train_loss.set(v)
        if (v := _number(get("eval_loss"))) is not None:
            self.eval_loss.set(v)
        if (v := _number(get("dropped_peers"))) is not None:
            self.dropped_peers.inc(v)
        for key, gauge in (("params_agree", self.params_agree), ("config_agree", self.config_agree)):
            if isinstance(get(key), bool):
                gauge.set(1.0 if get(key) else 0.0)
        if (v := _number(get("state_bytes"))) is not None:
            self.state_bytes.inc(v)
        if (v := _number(get("state_seconds"))) is not None:
            self.state_seconds.observe(v)
        for key, gauge in (("waited_for", self.waited_for), ("matchmaking_deadline", self.matchmaking_deadline),
                           ("allreduce_deadline", self.allreduce_deadline), ("first_commit_seconds", self.first_commit)):
            if (v := _number(get(key))) is not None:
                gauge.set(v)
        for peer, seen in (get("away") or {}).items():
            if isinstance(seen, Mapping):
                self.peer_missed.labels(peer=peer).set(_number(seen.get("missed")) or 0.0)
                self.peer_away_seconds.labels(peer=peer).set(_number(seen.get("away_s")) or 0.0)
                self.peer_away.labels(peer=peer).set(1.0 if seen.get("away") else 0.0)
        for reasons in (get("rejections") or {}).values():
            for reason in reasons if isinstance(reasons, list) else [reasons]:
                if reason in REJECTION_REASONS:
                    self.rejections.labels(reason=reason).inc()

    def set_dht_peers(self, n: int) -> None:
        self.dht_peers.set(n)

    def set_reachability(self, reachability: str | None) -> None:
        self.public.set(NAN if reachability is None else float(reachability == "public"))


def _number(value: Any) -> float | None:
    """A record value as a float, or None when absent (None, bool, or not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


# -- the seed -----------------------------------------------------------------------------------


class SeedMetrics:
    """A seed's metrics: DHT peers it sees (its routing table), uptime, start time, build info.
    `peer_count` is called by `refresh()`; an error keeps the last value (and is logged once)."""

    def __init__(self, registry: CollectorRegistry | None = None, peer_count: Callable[[], int] | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        _register_process_metrics(self.registry)
        self.dht_peers = Gauge("diloco_dht_peers", "DHT peers this process sees.", registry=self.registry)
        self.dht_peers.set(NAN)
        self.peer_count = peer_count
        self._failing = False

    def refresh(self) -> None:
        if self.peer_count is None:
            return
        try:
            self.dht_peers.set(int(self.peer_count()))
            self._failing = False
        except Exception as e:  # the DHT process may be restarting or gone; the seed loop handles that
            if not self._failing:
                log.warning("metrics: cannot read the DHT peer count (%s); keeping the last value", e)
            self._failing = True


class MetricsServer:
    """A running HTTP endpoint (a daemon thread); `shutdown()` frees the port. A port that cannot be
    bound is a `UserError` naming the address and `option`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, option: str = "metrics.port"):
        self.registry = registry
        self.host = host
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise UserError(
                f"cannot serve metrics on {host}:{port} ({e.strerror or e}); choose a free port with {option} "
                "(or 0 to turn metrics off)"
            ) from None
        self.port: int = self._httpd.server_port

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class SeedMetricsServer(MetricsServer):
    """The seed's endpoint plus the thread that refreshes the DHT peer count."""

    def __init__(self, metrics: SeedMetrics, host: str, port: int, interval: float = SEED_REFRESH_SECONDS):
        self.metrics = metrics
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._run, args=(interval,), name="seed-metrics", daemon=True)
        super().__init__(metrics.registry, host, port, option="--metrics-port")
        self._refresher.start()

    def _run(self, interval: float) -> None:
        self.metrics.refresh()
        while not self._stop.wait(interval):
            self.metrics.refresh()

    def shutdown(self) -> None:
        self._stop.set()
        super().shutdown()
        self._refresher.join(timeout=5)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics. Port 0 binds an ephemeral port (read it
    from `.port`); whether 0 means "off" is the caller's decision (config: it does). A port
    that cannot be bound raises `UserError` naming it and ``metrics.port``."""
    return MetricsServer(registry, host, port)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve `registry` for the life of the process; return the bound port (see `start_metrics_server`)."""
    return start_metrics_server(registry, host, port).port


def start_seed_metrics(host: str, port: int, dht: Any, interval: float = SEED_REFRESH_SECONDS) -> SeedMetricsServer:
    """The seed's endpoint; its DHT peer count is refreshed every `interval` seconds in a thread.
    Start it after the DHT (hivemind forks it; threads must come after the fork)."""
    from diloco_p2p.swarm.transport.dht import dht_peer_count

    return SeedMetricsServer(SeedMetrics(peer_count=lambda: dht_peer_count(dht)), host, port, interval)


# -- helpers for callers and tests ---------------------------------------------------------------


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format, as served at /metrics."""
    return generate_latest(registry)


def exported_names(text: bytes | str) -> set[str]:
    """Every sample name in an exposition (histograms give _bucket/_sum/_count, counters _total)."""
    if isinstance(text, bytes):
        text = text.decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def write_port_file(run_dir: Path | str, port: int) -> Path:
    """Write the bound metrics port to ``<run_dir>/metrics_port`` atomically (readers polling for
    it never see a partial file); with an ephemeral port this is how a scraper finds the node."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / PORT_FILE
    tmp = path.with_name(PORT_FILE + ".tmp")
    tmp.write_text(f"{int(port)}\n")
    os.replace(tmp, path)
    return path


def read_port_file(run_dir: Path | str) -> int | None:
    """The port `write_port_file` wrote, or None if there is none yet."""
    try:
        return int((Path(run_dir) / PORT_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
