"""docs/benchmarks.md's tables are what `benchmarks/report.py` makes of the stored results."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _report():
    spec = importlib.util.spec_from_file_location("benchmarks_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_page_matches_the_stored_results():
    report = _report()
    doc = report.DOC.read_text()
    names = [m["name"] for m in report.BLOCK.finditer(doc)]
    assert sorted(names) == sorted(report.TABLES), "every generator has its block in docs/benchmarks.md, once"
    assert report.render(doc) == doc, "docs/benchmarks.md is stale: run python benchmarks/report.py"


def _expand(token: str) -> list[str]:
    """Shell-style braces: ``a.{json,txt}`` and ``seed{0..5}.json``."""
    m = re.search(r"\{([^{}]+)\}", token)
    if not m:
        return [token]
    body = m.group(1)
    if re.fullmatch(r"\d+\.\.\d+", body):
        lo, hi = (int(x) for x in body.split(".."))
        options = [str(i) for i in range(lo, hi + 1)]
    else:
        options = body.split(",")
    return [x for o in options for x in _expand(token[:m.start()] + o + token[m.end():])]


def test_every_result_file_is_named_in_the_benchmarks_index():
    """benchmarks/README.md names every file of benchmarks/results/ (whole, by braces or as ``stem.*``)."""
    index = (ROOT / "benchmarks" / "README.md").read_text()
    named = {Path(x).name for token in re.findall(r"`([^`\s]+)`", index) for x in _expand(token)}
    missing = [p.name for p in sorted((ROOT / "benchmarks" / "results").iterdir())
               if p.name not in named and f"{p.stem}.*" not in named]
    assert not missing, f"result files benchmarks/README.md does not name (name them, or delete them): {missing}"
