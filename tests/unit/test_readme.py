"""The README's commands and config reference must match the code."""

import re
from pathlib import Path

from diloco_p2p.config import config_reference

README = (Path(__file__).parents[2] / "README.md").read_text()


def _block_after(marker: str) -> str:
    m = re.search(re.escape(marker) + r"\n```\n(.*?)\n```", README, re.S)
    assert m, f"README has no code block after {marker}"
    return m.group(1)


def test_config_reference_is_generated_from_the_models():
    m = re.search(r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", README, re.S)
    assert m and m.group(1).strip() == config_reference().strip(), (
        "README config reference is stale: regenerate it from diloco_p2p.config.config_reference()"
    )


def test_exactly_two_one_line_commands_near_the_top():
    main, test = _block_after("<!-- main-command -->"), _block_after("<!-- test-command -->")
    assert "\n" not in main and "\n" not in test
    assert "diloco-p2p" in main and "pytest" in test
    assert README.index("<!-- test-command -->") < README.index("## Quick start")


def test_every_issue_field_is_documented():
    for field in ["run_id", "seed", "model.preset", "data.path", "data.eval_fraction", "inner.lr",
                  "inner.batch_size", "inner.seq_len", "inner.warmup_steps", "inner.weight_decay",
                  "inner.grad_clip", "outer.inner_steps", "outer.lr", "outer.momentum", "outer.nesterov",
                  "train.max_rounds", "train.eval_batches"]:
        assert f"`{field}`" in README


def test_every_command_in_the_readme_parses_with_the_cli():
    import shlex

    from diloco_p2p.cli import build_parser

    commands = [line.strip() for block in re.findall(r"```\n(.*?)\n```", README, re.S)
                for line in block.splitlines() if line.strip().startswith("diloco-p2p ")]
    assert len(commands) >= 5
    for command in commands:
        argv = ["/ip4/203.0.113.7/tcp/31337" if a == "..." else a for a in shlex.split(command)[1:]]
        build_parser().parse_args(argv)  # argparse exits (SystemExit) on an unknown flag


def test_operator_section_explains_every_dashboard_panel_and_alert():
    import json

    import yaml

    root = Path(__file__).parents[2]
    section = re.search(r"^## Operating a swarm\n(.*?)^## ", README, re.S | re.M)
    assert section, "README has no '## Operating a swarm' section"
    text = " ".join(section.group(1).split())  # lines re-wrapped
    panels = json.loads((root / "deploy/grafana/dashboards/diloco.json").read_text())["panels"]
    titles = {p["title"] for p in panels if p["type"] != "row"}
    named = set(re.findall(r"\*([^*`]+)\*", re.sub(r"\*\*[^*]+\*\*", "", text)))  # italics, not bold
    assert titles <= named, sorted(titles - named)
    assert named <= titles, sorted(named - titles)  # no panel the dashboard lacks
    rules = yaml.safe_load((root / "deploy/alerts.yml").read_text())["groups"]
    alerts = {r["alert"] for g in rules for r in g["rules"] if "alert" in r}
    assert alerts and all(f"`{a}`" in text for a in alerts), sorted(a for a in alerts if f"`{a}`" not in text)
