"""The checks of deploy/smoke.sh (standard library only: runs on the host, outside the image).

    python3 deploy/smoke_checks.py committed RUN_DIR...           # prints the fewest committed rounds
    python3 deploy/smoke_checks.py theta ROUNDS RUN_DIR...          # same θ after rounds 1..ROUNDS
    python3 deploy/smoke_checks.py dashboard PROMETHEUS_URL [DASHBOARD]  # every panel query has data

`dashboard` evaluates every query of the Grafana dashboard (each panel target and the
`$instance` variable) as an instant query against a live Prometheus and fails for a query that
returns no series, or only NaN (Grafana draws nothing for either). Grafana's variables are
substituted as a 1 s scrape interval makes them: `$__rate_interval` and `$__interval` by 1m (the
smoke swarm runs for about a minute; `rate()` needs two samples in the window), `$instance` by
its "All" value.
"""

from __future__ import annotations

import json
import math
import sys
import urllib.parse
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent / "grafana" / "dashboards" / "diloco.json"
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$instance": ".*"}


def records(run_dir: str) -> list[dict]:
    """The round records of a run directory (a line still being written is left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def committed(run_dirs: list[str]) -> int:
    """The number of committed rounds of the node that has committed fewest."""
    return min(sum(r["status"] == "committed" for r in records(d)) for d in run_dirs)


def same_theta(rounds: int, run_dirs: list[str]) -> list[str]:
    """Problems with rounds 1..`rounds`: each committed by every node with one params_sha256, and θ
    moving from round to round. Empty = fine."""
    per_node = [{r["round"]: r for r in records(d)} for d in run_dirs]
    problems, hashes = [], []
    for round_ in range(1, rounds + 1):
        rows = [n.get(round_) for n in per_node]
        if any(r is None or r["status"] != "committed" for r in rows):
            problems.append(f"round {round_}: not committed by every node: "
                            f"{[None if r is None else r['status'] for r in rows]}")
            continue
        round_hashes = {r["params_sha256"] for r in rows}
        if len(round_hashes) != 1:
            problems.append(f"round {round_}: θ differs: {sorted(round_hashes)}")
        hashes.append(round_hashes.pop())
        print(f"round {round_}: {len(rows)} nodes, group sizes {[r['group_size'] for r in rows]}, "
              f"params_sha256 {hashes[-1][:16]}")
    if len(set(hashes)) != len(hashes):
        problems.append("θ did not change between rounds")
    return problems


def grafana_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every query of the dashboard, Grafana's variables substituted."""
    out = []

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dashboard["panels"]):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t.get('refId', '')}", t["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        definition = var["definition"]
        if definition.startswith("label_values("):  # Grafana's function: its first argument is PromQL
            definition = definition[len("label_values("):].rsplit(",", 1)[0]
        out.append((f"variable ${var['name']}", definition))
    result = []
    for where, q in out:
        for k, v in GRAFANA_VARIABLES.items():
            q = q.replace(k, v)
        if "$" in q:
            raise SystemExit(f"{where}: unknown Grafana variable in {q!r}")
        result.append((where, q))
    return result


def query(url: str, promql: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}), timeout=10) as r:
        body = json.loads(r.read())
    if body.get("status") != "success":
        raise SystemExit(f"query {promql!r} failed: {body}")
    return body["data"]["result"]


def check_dashboard(url: str, path: str) -> list[str]:
    problems = []
    for where, q in grafana_queries(json.loads(Path(path).read_text())):
        series = query(url, q)
        values = [float(s["value"][1]) for s in series]
        finite = [v for v in values if math.isfinite(v)]
        shown = ", ".join(f"{v:.4g}" for v in values[:4]) + (" ..." if len(values) > 4 else "")
        print(f"{'ok ' if finite else 'NO '} {where}: {len(series)} series [{shown}]  {q}")
        if not finite:
            problems.append(f"{where}: {'only NaN' if series else 'no data'} for {q}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "committed":
        print(committed(argv[1:]))
        return 0
    if len(argv) >= 3 and argv[0] == "theta":
        problems = same_theta(int(argv[1]), argv[2:])
    elif len(argv) in (2, 3) and argv[0] == "dashboard":
        problems = check_dashboard(argv[1].rstrip("/"), argv[2] if len(argv) == 3 else str(DASHBOARD))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
