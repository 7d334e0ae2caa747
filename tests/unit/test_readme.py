"""The README's commands, the docs' commands and the config reference must match the code."""

import re
import shlex
from pathlib import Path

from diloco_p2p.config import config_reference

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
CONFIG_DOC = DOCS["config.md"]
REGENERATE = (
    "python -c \"import re, pathlib; from diloco_p2p.config import config_reference as r; "
    "p = pathlib.Path('docs/config.md'); p.write_text(re.sub(r'(?s)(<!-- config-reference:start -->\\n).*?"
    "(\\n<!-- config-reference:end -->)', lambda m: m[1] + r() + m[2], p.read_text()))\""
)


def _block_after(marker: str) -> str:
    m = re.search(re.escape(marker) + r"\n```\n(.*?)\n```", README, re.S)
    assert m, f"README has no code block after {marker}"
    return m.group(1)


def test_config_reference_is_generated_from_the_models():
    m = re.search(r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", CONFIG_DOC, re.S)
    assert m and m.group(1).strip() == config_reference().strip(), (
        f"docs/config.md's config reference is stale: regenerate it from the repository root with\n{REGENERATE}"
    )


def test_exactly_two_one_line_commands_near_the_top():
    main, test = _block_after("<!-- main-command -->"), _block_after("<!-- test-command -->")
    assert "\n" not in main and "\n" not in test
    assert "diloco-p2p" in main and "pytest" in test
    assert README.index("<!-- test-command -->") < README.index("\n## ")  # before the first section


def test_every_issue_field_is_documented():
    for field in ["run_id", "seed", "model.preset", "data.path", "data.eval_fraction", "inner.lr",
                  "inner.batch_size", "inner.seq_len", "inner.warmup_steps", "inner.weight_decay",
                  "inner.grad_clip", "outer.inner_steps", "outer.lr", "outer.momentum", "outer.nesterov",
                  "train.max_rounds", "train.eval_batches"]:
        assert f"`{field}`" in CONFIG_DOC


def _commands(text: str) -> list[str]:
    """`diloco-p2p ...` lines of the code blocks, and inline `diloco-p2p ...` spans that pass a flag."""
    blocks = [line.strip() for block in re.findall(r"```\n(.*?)\n\s*```", text, re.S) for line in block.splitlines()]
    inline = [span for span in re.findall(r"`(diloco-p2p [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
              if " --" in span]
    return [c for c in blocks if c.startswith("diloco-p2p ")] + inline


def test_every_command_in_the_readme_and_the_docs_parses_with_the_cli():
    from diloco_p2p.cli import build_parser

    placeholders = {"...": "/ip4/203.0.113.7/tcp/31337", "<seed>": "/ip4/203.0.113.7/tcp/31337", "<run_id>": "my-run",
                    "<id>": "0123abcd"}
    readme = _commands(README)
    assert len(readme) >= 5
    for command in readme + [c for text in DOCS.values() for c in _commands(text)]:
        argv = [placeholders.get(a, a) for a in shlex.split(command)[1:]]
        build_parser().parse_args(argv)  # argparse exits (SystemExit) on an unknown flag


def test_operator_page_explains_every_dashboard_panel_and_alert():
    import json

    import yaml

    section = re.search(r"^## Dashboard and alerts\n(.*?)(?=^## |\Z)", DOCS["operator.md"], re.S | re.M)
    assert section, "docs/operator.md has no '## Dashboard and alerts' section"
    text = " ".join(section.group(1).split())  # lines re-wrapped
    panels = json.loads((ROOT / "deploy/grafana/dashboards/diloco.json").read_text())["panels"]
    titles = {p["title"] for p in panels if p["type"] != "row"}
    named = set(re.findall(r"\*([^*`]+)\*", re.sub(r"\*\*[^*]+\*\*", "", text)))  # italics, not bold
    assert titles <= named, sorted(titles - named)
    assert named <= titles, sorted(named - titles)  # no panel the dashboard lacks
    rules = yaml.safe_load((ROOT / "deploy/alerts.yml").read_text())["groups"]
    alerts = {r["alert"] for g in rules for r in g["rules"] if "alert" in r}
    assert alerts and all(f"`{a}`" in text for a in alerts), sorted(a for a in alerts if f"`{a}`" not in text)
