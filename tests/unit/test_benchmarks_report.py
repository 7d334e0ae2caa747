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


def test_compute_efficiency_interpolates_in_log_tokens_and_never_extrapolates():
    spec = importlib.util.spec_from_file_location("benchmarks_quality", ROOT / "benchmarks" / "quality.py")
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    curve = [(100.0, 3.0), (1000.0, 2.0), (10000.0, 1.999)]  # a flat, decayed end
    assert abs(quality.interpolate_tokens(curve, 2.5) - 1000 ** 0.5 * 10) < 1e-6  # halfway in log tokens
    assert abs(quality.interpolate_tokens(curve, 3.5) - 100.0) < 1e-9  # above the start: its first point
    below = quality.interpolate_tokens(curve, 1.9)  # below the end: more than the curve's tokens, unmeasured
    assert below == float("inf") and quality.efficiency(below / 10000.0) == ">100%"
    assert quality.efficiency(0.53) == "53%"
