"""docs/benchmarks.md's tables are what `benchmarks/report.py` makes of the stored results."""

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _report():
    return importlib.import_module("benchmarks.report")


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


def test_every_result_file_is_named_in_its_area_of_the_benchmarks_index():
    """benchmarks/README.md names every file of benchmarks/AREA/results/ (whole, by braces or as
    ``stem.*``) in AREA's section."""
    index = (ROOT / "benchmarks" / "README.md").read_text()
    sections = dict(re.findall(r"^## (\w+)/:.*?\n(.*?)(?=^## |\Z)", index, re.M | re.S))
    missing = []
    for path in sorted((ROOT / "benchmarks").glob("*/results/*")):
        area = path.parents[1].name
        named = {Path(x).name for token in re.findall(r"`([^`\s]+)`", sections.get(area, "")) for x in _expand(token)}
        if path.name not in named and f"{path.stem}.*" not in named:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"result files benchmarks/README.md does not name in their area (name them, or delete them): {missing}"


# a path under benchmarks/, not one in an old tree (`git show COMMIT:benchmarks/...`)
BENCH_PATH = re.compile(r"(?<![\w:/.-])benchmarks/[\w./{},-]*[\w}]")


def test_every_benchmarks_path_the_docs_and_code_name_exists():
    """Every benchmark script (a ``.py`` or ``.sh`` under benchmarks/) that the docs, the package, the
    configs, the tests and the benchmarks name exists, and so does every path under benchmarks/ that
    the pages name: a script or a result moved without its mentions fails here."""
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("**/*.md"), ROOT / "benchmarks" / "README.md"]
    code = [*(ROOT / "diloco_p2p").glob("**/*.py"), *(ROOT / "tests").glob("**/*.py"), *(ROOT / "configs").glob("*"),
            *(ROOT / "benchmarks").glob("**/*.py"), *(ROOT / "benchmarks").glob("**/*.sh"),
            *(ROOT / "benchmarks").glob("*/results/*.txt")]
    broken = []
    for file in pages + code:
        for token in BENCH_PATH.findall(file.read_text()):
            for path in _expand(token.rstrip(".")):
                if (file in pages or path.endswith((".py", ".sh"))) and not (ROOT / path).exists():
                    broken.append(f"{file.relative_to(ROOT)}: {path}")
    assert not broken, broken


def test_compute_efficiency_interpolates_in_log_tokens_and_never_extrapolates():
    quality = importlib.import_module("benchmarks.quality.quality")
    curve = [(100.0, 3.0), (1000.0, 2.0), (10000.0, 1.999)]  # a flat, decayed end
    assert abs(quality.interpolate_tokens(curve, 2.5) - 1000 ** 0.5 * 10) < 1e-6  # halfway in log tokens
    assert abs(quality.interpolate_tokens(curve, 3.5) - 100.0) < 1e-9  # above the start: its first point
    below = quality.interpolate_tokens(curve, 1.9)  # below the end: more than the curve's tokens, unmeasured
    assert below == float("inf") and quality.efficiency(below / 10000.0) == ">100%"
    assert quality.efficiency(0.53) == "53%"
