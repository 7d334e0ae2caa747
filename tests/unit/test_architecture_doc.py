"""docs/architecture.md draws the package: its layer table names every module of `diloco_p2p`
once, under its path, in the layers' order bottom-up (`test_layout.PACKAGE_LAYERS`, and inside the
swarm `SWARM_LAYERS`), and describes each by the first line of the module's docstring.

So a module added, moved or renamed without its row fails here, and so does a row whose module
is gone or whose docstring now says something else.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.unit.test_layout import PACKAGE, PACKAGE_LAYERS, SWARM_LAYERS, swarm_unit

ROOT = PACKAGE.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^\| `(diloco_p2p/[^`]+\.py)` \| (.*) \|$")
FIRST_LINE_AT_MOST = 110


def table_rows(text: str) -> list[tuple[str, str]]:
    """(module path, description) of each row of the "## The layers" section, in order."""
    section = re.search(r"^## The layers\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "docs/architecture.md has no '## The layers' section"
    return [(m[1], m[2].strip()) for line in section[1].splitlines() if (m := ROW.match(line))]


def modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py"))


def first_line(path: str) -> str:
    doc = ast.get_docstring(ast.parse((ROOT / path).read_text())) or ""
    return doc.splitlines()[0].strip() if doc else ""


def layer_rank(path: str) -> tuple[int, int]:
    """Where `path` sits bottom-up: its package layer, and inside the swarm its swarm layer."""
    parts = Path(path).with_suffix("").parts
    top = parts[1] if len(parts) > 1 and parts[1] != "__init__" else "errors"  # the package's own docstring: a seam
    package = next(i for i, layer in enumerate(PACKAGE_LAYERS) if top in layer)
    if top != "swarm":
        return package, 0
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    unit = swarm_unit(name)
    return package, next(i for i, layer in enumerate(SWARM_LAYERS) if unit in layer)


def test_every_module_has_one_row_and_every_row_a_module():
    rows = [path for path, _ in table_rows(ARCHITECTURE.read_text())]
    assert len(rows) == len(set(rows)), sorted({p for p in rows if rows.count(p) > 1})
    assert sorted(set(modules()) - set(rows)) == [], "modules missing from docs/architecture.md's layer table"
    assert sorted(set(rows) - set(modules())) == [], "rows of docs/architecture.md naming no module"


def test_each_row_says_what_its_module_docstring_says_first():
    differ = [f"{path}: table {what!r}, docstring {first_line(path)!r}"
              for path, what in table_rows(ARCHITECTURE.read_text()) if what != first_line(path)]
    assert not differ


def test_every_module_opens_with_a_one_line_summary():
    bad = [f"{path}: {line!r}" for path in modules() if not (
        (line := first_line(path)) and len(line) <= FIRST_LINE_AT_MOST and line[-1] in ".?")]
    assert not bad, "each module's docstring opens with a sentence of at most 110 characters"


def test_the_table_draws_the_layers_bottom_up():
    ranks = [layer_rank(path) for path, _ in table_rows(ARCHITECTURE.read_text())]
    assert ranks, "the layer table has no rows"
    assert ranks == sorted(ranks)


def test_the_checks_catch_a_missing_row_a_stale_row_and_a_wrong_order():
    text = ARCHITECTURE.read_text()
    rows = table_rows(text)
    path, what = rows[-1]
    without = text.replace(f"| `{path}` | {what} |\n", "")
    assert {p for p, _ in table_rows(without)} == {p for p, _ in rows} - {path}
    stale = text.replace(f"| `{path}` | {what} |", f"| `{path}` | {what} (and more) |")
    assert [w for p, w in table_rows(stale) if p == path] != [first_line(path)]
    swapped = [layer_rank(p) for p, _ in [rows[-1], *rows[:-1]]]
    assert swapped != sorted(swapped)  # the entry point drawn first is out of order
