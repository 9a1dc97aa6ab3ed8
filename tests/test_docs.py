"""The design document the code cites is in the repository, and every citation resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"DESIGN §(\d+)")


def cited_sections() -> dict[int, list[str]]:
    cited: dict[int, list[str]] = {}
    files = [*ROOT.glob("trinity_train/**/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("configs/**/*.toml"),
             *ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md"), *ROOT.glob("launch/*")]
    for path in files:
        for number in CITATION.findall(path.read_text(errors="replace")):
            cited.setdefault(int(number), []).append(str(path.relative_to(ROOT)))
    return cited


def test_every_design_citation_names_a_section_of_docs_design():
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", design, re.M)}
    cited = cited_sections()
    assert len(cited) >= 3  # the code does cite it: the check below is not vacuous
    missing = {n: where for n, where in cited.items() if n not in sections}
    assert not missing, f"cited but absent from docs/DESIGN.md: {missing}"


def test_the_readme_shows_the_released_sizes_page_as_written():
    # scripts/released_sizes.py writes both from one set of plans: the README's table rows are
    # the page's, so neither can be edited into a number no plan printed.
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- released-sizes:")
    rows = [line for line in readme[start:readme.index("<!-- /released-sizes -->")].splitlines()
            if line.startswith("| ") and not line.startswith("| job")]
    page = (ROOT / "docs" / "guides" / "released-sizes.md").read_text()
    assert len(rows) == 3 and all(row in page for row in rows)
