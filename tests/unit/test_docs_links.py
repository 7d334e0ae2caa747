"""Every docs/ page is reachable from the README (a protocol page from the architecture page), and
every relative link in the docs resolves."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # not inside code blocks
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # relative ones only


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(ROOT / "README.md")}
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    assert not [p.name for p in pages if p.resolve() not in linked]


def test_every_protocol_page_is_linked_from_the_architecture_page():
    architecture = ROOT / "docs" / "architecture.md"
    linked = {(architecture.parent / t.partition("#")[0]).resolve() for t in _links(architecture)}
    pages = sorted((ROOT / "docs" / "protocol").glob("*.md"))
    assert len(pages) >= 4, "docs/protocol/ lost its pages"
    assert not [p.name for p in pages if p.resolve() not in linked]


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in _links(page):
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken
