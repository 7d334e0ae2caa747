"""deploy/: what can be checked without Docker.

Files parse; every metric the dashboard and the alert rules use is one a node or a seed exports;
promtool accepts the Prometheus config, the rules and the dashboard's queries, and the alert
rules fire on synthetic series exactly when they should; the command lines in compose and the
systemd units parse with the real CLI parser; the Dockerfile, compose file and units have the
properties operators rely on (non-root, SIGTERM, restart policy, matching ports).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco_p2p.cli import build_parser
from diloco_p2p.loop.metrics import NodeMetrics, SeedMetrics, exported_names, exposition

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "diloco.json"
ALERTS = DEPLOY / "alerts.yml"
PROMETHEUS = DEPLOY / "prometheus.yml"
COMPOSE = DEPLOY / "docker-compose.yml"
METRIC = re.compile(r"\bdiloco_[A-Za-z0-9_]+")
RECORDED = re.compile(r"\bdiloco:[A-Za-z0-9_:]+")
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (apt-get install -y prometheus)")

ROUND = {
    "round": 1, "status": "committed", "group_size": 2, "allreduce_seconds": 0.5, "bytes_sent": 10,
    "bytes_received": 10, "tokens_per_s": 100.0, "train_loss": 3.0, "eval_loss": 3.0, "dropped_peers": 0,
    "params_agree": True, "config_agree": True, "state_bytes": 10, "state_seconds": 0.1, "seconds": 1.0,
}


def exported() -> set[str]:
    """Sample names a node (after one step and one round) and a seed export."""
    node = NodeMetrics()
    node.observe_inner_step(64, 3.0)
    node.observe_round(ROUND)
    seed = SeedMetrics(peer_count=lambda: 1)
    seed.refresh()
    return exported_names(exposition(node.registry)) | exported_names(exposition(seed.registry))


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[str]:
    d = dashboard()
    queries = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    for var in d["templating"]["list"]:
        queries.append(var["definition"])
    return queries


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


# -- parsing and names ----------------------------------------------------------------------------


def test_every_yaml_and_json_file_parses():
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml", ".json"))
    assert {p.relative_to(DEPLOY).as_posix() for p in files} >= {
        "docker-compose.yml", "prometheus.yml", "alerts.yml", "grafana/dashboards/diloco.json",
        "grafana/provisioning/datasources/prometheus.yml", "grafana/provisioning/dashboards/diloco.yml",
    }
    for p in files:
        data = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
        assert isinstance(data, dict) and data, p


def test_dashboard_metrics_exist_in_the_exports():
    names = exported()
    used = {m for q in dashboard_queries() for m in METRIC.findall(q)}
    assert len(used) >= 10  # the regex finds the names (a broken regex would pass vacuously)
    assert used <= names, sorted(used - names)


def test_alert_metrics_exist_in_the_exports():
    names = exported()
    used = {m for rule in alert_rules() for m in METRIC.findall(rule["expr"])}
    assert len(used) >= 5
    assert used <= names, sorted(used - names)


def test_recorded_series_used_are_defined():
    defined = {r["record"] for r in alert_rules() if "record" in r}
    used = {m for q in dashboard_queries() + [r["expr"] for r in alert_rules()] for m in RECORDED.findall(q)}
    assert "diloco:eval_loss_baseline" in defined
    assert used <= defined, sorted(used - defined)


def test_the_required_alerts_are_there():
    alerts = {r["alert"]: r for r in alert_rules() if "alert" in r}
    assert {"DilocoRoundStalled", "DilocoParamsHashDisagreement", "DilocoEvalLossAboveBaseline",
            "DilocoPeersDropping"} <= set(alerts)
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"], name


def test_dashboard_structure_and_datasource():
    d = dashboard()
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    uid = ds[0]["uid"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    assert d["uid"] and d["title"]
    titles = " ".join(p["title"].lower() for p in d["panels"])
    for topic in ("loss", "tokens/s", "round progress", "all-reduce time", "traffic", "group size", "status"):
        assert topic in titles, topic
    for p in d["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == uid, p["title"]
        assert p["targets"] and all(t["expr"] and t["datasource"]["uid"] == uid for t in p["targets"]), p["title"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/diloco.yml").read_text())["providers"][0]
    compose = yaml.safe_load(COMPOSE.read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in mounts


# -- promtool -------------------------------------------------------------------------------------


@needs_promtool
def test_promtool_check_config_and_rules():
    out = promtool("check", "config", str(PROMETHEUS))  # resolves rule_files next to the config
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rule files found" in out.stdout
    out = promtool("check", "rules", str(ALERTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool parses each dashboard query as a recording rule (Grafana variables substituted)."""
    subst = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$instance": ".*"}
    rules = []
    for i, q in enumerate(dashboard_queries()):
        for k, v in subst.items():
            q = q.replace(k, v)
        if q.startswith("label_values("):  # a Grafana function; its first argument is PromQL
            q = q[len("label_values("):].rsplit(",", 1)[0]
        assert "$" not in q, q
        rules.append({"record": f"dashboard:query_{i}", "expr": q})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


def _series(name: str, instance: str, values: str, **labels: str) -> dict[str, str]:
    lab = ",".join(f'{k}="{v}"' for k, v in {"instance": instance, "job": "diloco-node", **labels}.items())
    return {"series": f"{name}{{{lab}}}", "values": values}


def _fires(alert: str, at: str, *instances: str, severity: str = "warning") -> dict[str, Any]:
    return {"eval_time": at, "alertname": alert, "exp_alerts": [
        {"exp_labels": {"severity": severity, "instance": i, "job": "diloco-node"}} for i in instances]}


@needs_promtool
def test_alerts_fire_on_synthetic_series(tmp_path):
    """Node n1 misbehaves, n2 is healthy: each alert fires for n1 only, and only after its delay.
    Annotations are stripped (promtool compares them verbatim); `check rules` validates them."""
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    series = [
        # stuck since t=0 vs a round every minute
        _series("diloco_last_round_timestamp_seconds", "n1", "0+0x60"),
        _series("diloco_last_round_timestamp_seconds", "n2", "0+60x60"),
        _series("diloco_params_hash_agreement", "n1", "NaN 1 1 0 0 0"),
        _series("diloco_params_hash_agreement", "n2", "NaN 1 1 1 1 1"),
        _series("diloco_config_hash_agreement", "n1", "0x5"),
        _series("diloco_config_hash_agreement", "n2", "NaN 1 1 1 1 1"),
        _series("diloco_eval_loss", "n1", "6+0x30"),  # above the 5.6 baseline
        _series("diloco_eval_loss", "n2", "NaN 3+0x30"),
        _series("diloco_dropped_peers_total", "n1", "0+1x30"),  # one a minute
        _series("diloco_dropped_peers_total", "n2", "0x30"),
        _series("diloco_rounds_total", "n1", "0x90", status="committed"),
        _series("diloco_rounds_total", "n1", "0+1x90", status="alone"),
        _series("diloco_rounds_total", "n1", "0x90", status="failed"),
        _series("diloco_rounds_total", "n2", "0+1x90", status="committed"),
        _series("diloco_rounds_total", "n2", "0x90", status="alone"),
        _series("diloco_rounds_total", "n2", "0x90", status="failed"),
        _series("up", "n1", "1 1 0x20"),
        _series("up", "n2", "1x20"),
    ]
    checks = [
        _fires("DilocoRoundStalled", "20m"),
        _fires("DilocoRoundStalled", "40m", "n1"),
        _fires("DilocoParamsHashDisagreement", "2m"),
        _fires("DilocoParamsHashDisagreement", "3m", "n1", severity="critical"),
        _fires("DilocoConfigHashDisagreement", "1m", "n1"),
        _fires("DilocoEvalLossAboveBaseline", "5m"),
        _fires("DilocoEvalLossAboveBaseline", "20m", "n1"),
        _fires("DilocoPeersDropping", "1m"),
        _fires("DilocoPeersDropping", "20m", "n1"),
        _fires("DilocoRoundsNotAveraging", "10m"),
        _fires("DilocoRoundsNotAveraging", "85m", "n1"),
        _fires("DilocoTargetDown", "5m"),
        _fires("DilocoTargetDown", "10m", "n1"),
    ]
    test = {"rule_files": ["alerts.yml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}]}
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(test))
    out = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    alerts = {r["alert"] for r in alert_rules() if "alert" in r}
    assert alerts == {c["alertname"] for c in checks}  # every alert is exercised


# -- compose, CLI flags, Dockerfile, systemd --------------------------------------------------------


def _parse_cli(argv: list[str], capsys) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"the CLI rejects {shlex.join(argv)}: {capsys.readouterr().err.strip()}")


def test_compose_commands_parse_with_the_cli(capsys):
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    commands = {name: s["command"] for name, s in services.items() if "command" in s and "build" in s}
    assert {"seed", "node1", "node2"} <= set(commands)
    for name in commands:  # the Dockerfile's inputs: a base image and the wheelhouse
        build = services[name]["build"]
        assert "BASE_IMAGE" in build["args"] and "wheels" in build["additional_contexts"], name
    for argv in commands.values():
        _parse_cli([str(a) for a in argv], capsys)


def _flag(argv: list[Any], name: str) -> str:
    argv = [str(a) for a in argv]
    return argv[argv.index(name) + 1]


def test_prometheus_scrapes_every_compose_process_on_its_metrics_port():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = {t for job in config["scrape_configs"] if job["job_name"].startswith("diloco-")
               for sc in job["static_configs"] for t in sc["targets"]}
    expected = set()
    for name, s in services.items():
        if "build" in s:
            assert _flag(s["command"], "--metrics-host") == "0.0.0.0", name  # reachable from Prometheus
            expected.add(f"{name}:{_flag(s['command'], '--metrics-port')}")
    assert targets == expected
    for mount in services["prometheus"]["volumes"] + services["grafana"]["volumes"]:
        source = mount.split(":")[0]
        if source.startswith("./"):
            assert (DEPLOY / source).exists(), mount


def test_compose_nodes_read_the_seed_address_from_its_volume():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    seed = services["seed"]
    maddrs = _flag(seed["command"], "--maddrs-file")
    seed_volume, seed_mount = seed["volumes"][0].split(":")[:2]
    assert maddrs.startswith(seed_mount + "/")
    for node in ("node1", "node2"):
        peers_file = _flag(services[node]["command"], "--initial-peers-file")
        mount = next(v for v in services[node]["volumes"] if v.startswith(seed_volume + ":"))
        node_mount = mount.split(":")[1]
        assert peers_file == node_mount + maddrs[len(seed_mount):], node
        assert services[node]["depends_on"]["seed"]["condition"] == "service_healthy"
    announce = _flag(seed["command"], "--announce-maddrs")
    assert announce.split("/")[2] == seed["networks"]["swarm"]["ipv4_address"]


def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    # No registry is needed: the base image is a build argument (deploy/smoke.sh makes one with
    # debootstrap), and pip installs offline from the `wheels` build context, mounted for that step.
    assert re.search(r"^ARG BASE_IMAGE=\S*debian:bookworm\S*$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS base$", text, re.M)
    assert re.search(r"--mount=type=bind,from=wheels,target=/wheels", text)
    pip = re.findall(r"\bpip install\b[^\n]*", text)
    assert pip and all("--no-index" in line and "--find-links /wheels" in line for line in pip), pip
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M))
    assert {"torch-cpu", "torch-cuda"} <= stages
    assert re.search(r"^FROM torch-\$\{VARIANT\}$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["diloco-p2p"\]$', text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0")
    for src in re.findall(r"^COPY (?!--)(.+) \S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    assert "!diloco_p2p/**" in ignore and "!configs/**" in ignore


def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd unit -> section -> key -> values (keys may repeat; continuation lines joined)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, val = line.partition("=")
        current.setdefault(key, []).append(val)
    return sections


def _env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines()
                if line.strip() and not line.startswith("#"))


@pytest.mark.parametrize("unit, env, command", [
    ("diloco-p2p-seed.service", ROOT / "bootstrap" / "seed.env", "seed"),
    ("diloco-p2p-node.service", DEPLOY / "systemd" / "node.env", "train"),
])
def test_systemd_units(unit, env, command, capsys):
    u = _unit(DEPLOY / "systemd" / unit)
    service = u["Service"]
    assert service["User"][0] not in ("root", "0")
    assert service["Restart"] == ["on-failure"]
    assert service["KillSignal"] == ["SIGTERM"]
    assert int(service["TimeoutStopSec"][0]) > 0
    assert u["Install"]["WantedBy"] == ["multi-user.target"]
    # ExecStart with the example settings substituted, parsed by the real CLI.
    exec_start = service["ExecStart"][0]
    values = _env(env)
    for name in re.findall(r"\$\{?([A-Z_]+)\}?", exec_start):
        assert name in values, f"{unit} uses ${name}, which {env.name} does not set"
    exec_start = re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: values[m.group(1)], exec_start)
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/diloco-p2p") and argv[1] == command
    _parse_cli(argv[1:], capsys)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path):
    for unit in (DEPLOY / "systemd").glob("*.service"):
        # verify insists that ExecStart's binary exists here; the rest is checked as written.
        text = unit.read_text().replace("/opt/diloco-p2p/venv/bin/diloco-p2p", shutil.which("true") or "/bin/true")
        (tmp_path / unit.name).write_text(text)
        out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / unit.name)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and not out.stderr.strip(), out.stdout + out.stderr


def test_readme_metric_table_matches_the_exports():
    """deploy/README.md documents exactly the metric families a node and a seed export."""
    from prometheus_client.parser import text_string_to_metric_families

    node, seed = NodeMetrics(), SeedMetrics()
    families = set()
    for registry in (node.registry, seed.registry):
        for f in text_string_to_metric_families(exposition(registry).decode()):
            if f.name.endswith("_created"):  # prometheus_client's creation timestamps of counters
                continue
            families.add(f.name + "_total" if f.type == "counter" else f.name)
    documented = set(re.findall(r"^\| `(diloco_[a-z_]+)[`{]", (DEPLOY / "README.md").read_text(), re.M))
    assert documented == families, (sorted(families - documented), sorted(documented - families))


# -- deploy/smoke.sh's checks (the script itself runs in tests/integration/test_deploy_image.py) --


def _smoke_checks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("smoke_checks", DEPLOY / "smoke_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_checks_evaluate_every_dashboard_query():
    queries = _smoke_checks().grafana_queries(dashboard())
    targets = [t for p in dashboard()["panels"] for t in p.get("targets", [])]
    assert len(queries) == len(targets) + len(dashboard()["templating"]["list"])
    assert all("$" not in q for _, q in queries)
    assert {m for _, q in queries for m in METRIC.findall(q)} == {m for q in dashboard_queries()
                                                                 for m in METRIC.findall(q)}


def _write_records(run_dir: Path, rows: list[tuple[int, str, str]]) -> str:
    run_dir.mkdir()
    lines = [{"round": r, "status": status, "params_sha256": h, "group_size": 2} for r, status, h in rows]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"round": 4')
    return str(run_dir)


def test_smoke_checks_theta(tmp_path):
    checks = _smoke_checks()
    a = _write_records(tmp_path / "a", [(0, "init", "0"), (1, "committed", "1"), (2, "committed", "2")])
    b = _write_records(tmp_path / "b", [(0, "init", "0"), (1, "committed", "1"), (2, "committed", "2")])
    c = _write_records(tmp_path / "c", [(0, "init", "0"), (1, "committed", "1"), (2, "committed", "x")])
    d = _write_records(tmp_path / "d", [(0, "init", "0"), (1, "alone", "1"), (2, "committed", "2")])
    e = _write_records(tmp_path / "e", [(0, "init", "0"), (1, "committed", "1"), (2, "committed", "1")])
    assert checks.committed([a, b]) == 2 and checks.committed([a, d]) == 1  # the half line is left out
    assert checks.same_theta(2, [a, b]) == []
    assert checks.same_theta(3, [a, b]) == ["round 3: not committed by every node: [None, None]"]
    assert checks.same_theta(2, [a, c]) == ["round 2: θ differs: ['2', 'x']"]
    assert checks.same_theta(2, [a, d]) == ["round 1: not committed by every node: ['committed', 'alone']"]
    assert checks.same_theta(2, [e, e]) == ["θ did not change between rounds"]


def test_smoke_script_parses_and_cleans_up_on_every_exit():
    script = (DEPLOY / "smoke.sh").read_text()
    out = subprocess.run(["bash", "-n", str(DEPLOY / "smoke.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "trap cleanup EXIT" in script and "trap 'exit 130' INT TERM" in script
    assert "--runtime runc" in script and "--ulimit nofile=1024:1024 --ulimit nproc=4096:4096" in script
