"""The docs cannot drift from what they describe: DESIGN §1 names every module of the package and
nothing else, the home page links every page of the site's navigation and nothing outside it,
every measured figure's page is dated and says how and on what it was measured, the benchmark
guide names every script, and the README quotes no machine load (figures live on docs/results/)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "trinity_train"
ENTRY = re.compile(r"^( +)([\w.]+(?:\.py|/))(?:\s|$)")


def layout_block(design: str) -> str:
    """The first code block of DESIGN §1."""
    section = design[design.index("\n## 1. "):]
    section = section[:section.index("\n## 2. ")]
    return section.split("```")[1]


def named_in_layout(block: str) -> tuple[set[str], set[str]]:
    """(modules, packages) the `trinity_train/` tree of the layout block names, as paths inside the
    package: an entry is a `name.py` or `name/` whose indentation (2 spaces a level below
    `trinity_train/`) says which package it is in; lines indented further (column 20 and on) are
    descriptions continued."""
    modules: set[str] = set()
    packages: set[str] = set()
    inside, parents = False, []
    for line in block.splitlines():
        if line.startswith(f"{PACKAGE}/"):
            inside, parents = True, []
            continue
        if inside and line[:1] not in ("", " "):
            inside = False  # the next top-level entry (configs/, ...)
        match = ENTRY.match(line) if inside else None
        if not match or len(match.group(1)) >= 20:
            continue
        level = len(match.group(1)) // 2 - 1
        parents = parents[:level]
        path = "/".join([*parents, match.group(2).rstrip("/")])
        if match.group(2).endswith("/"):
            packages.add(path)
            parents.append(match.group(2).rstrip("/"))
        else:
            modules.add(path)
    return modules, packages


def package_modules() -> set[str]:
    root = ROOT / PACKAGE
    return {str(p.relative_to(root)) for p in root.rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}


def test_the_layout_parser_follows_nested_packages():
    block = (f"README.md  x\n{PACKAGE}/   the package\n  cli.py   a\n  parallel/   b\n    mesh.py   c\n"
             "                        continued: not_a_module.py\n    gloo/   d\n      tuning.py   e\n"
             "    fsdp.py   f\n  model/   g\n    moe.py   h\nconfigs/   i\n  x.py   not in the package\n")
    assert named_in_layout(block) == ({"cli.py", "parallel/mesh.py", "parallel/gloo/tuning.py", "parallel/fsdp.py",
                                       "model/moe.py"}, {"parallel", "parallel/gloo", "model"})


def test_design_section_1_names_every_module_of_the_package_and_nothing_else():
    named, packages = named_in_layout(layout_block((ROOT / "docs" / "DESIGN.md").read_text()))
    actual = package_modules()
    assert len(actual) > 100 and {"cli.py", "parallel/fsdp.py", "plan/trace.py"} <= actual  # not vacuous
    missing = sorted(actual - named)
    stale = sorted(named - actual)
    assert not missing, (
        "docs/DESIGN.md §1 (the trinity_train/ tree) lacks these modules; add each as a line "
        f"'<indent>name.py  what it is' under its package: {missing}")
    assert not stale, (
        f"docs/DESIGN.md §1 names modules that do not exist (renamed or removed?); remove or rename: {stale}")
    absent = sorted(p for p in packages if not (ROOT / PACKAGE / p).is_dir())
    assert not absent, f"docs/DESIGN.md §1 names packages that do not exist: {absent}"


def nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node] if node.endswith(".md") else []
    if isinstance(node, list):
        return [page for item in node for page in nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in nav_pages(value)]
    return []


def mkdocs_nav() -> list[str]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return nav_pages(config["nav"])


def md_links(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"\]\(([^)#\s:]+\.md)(?:#[^)]*)?\)", text)}


def test_the_home_page_links_every_page_of_the_navigation_and_only_those():
    nav = set(mkdocs_nav())
    assert len(nav) > 30 and "status.md" in nav and "results/index.md" in nav
    linked = md_links((ROOT / "docs" / "index.md").read_text())
    assert sorted(nav - {"index.md"} - linked) == [], "in mkdocs.yml's nav but not linked from docs/index.md"
    assert sorted(linked - nav) == [], "linked from docs/index.md but not a page of mkdocs.yml's nav"
    assert all((ROOT / "docs" / page).exists() for page in nav)


RESULTS = ROOT / "docs" / "results"
COMMAND = re.compile(r"python3? benchmarks/\w+\.py|trinity-train \w|launch/\w+\.sh|\.ci/run|scripts/test\.sh")


def results_pages() -> list[Path]:
    return sorted(p for p in RESULTS.glob("*.md") if p.name != "index.md")


def test_every_results_page_is_dated_says_how_and_on_what_and_is_listed():
    pages = results_pages()
    index = md_links((RESULTS / "index.md").read_text())
    nav = set(mkdocs_nav())
    assert len(pages) >= 10
    for page in pages:
        text = page.read_text()
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", page.name), page.name
        assert COMMAND.search(text), f"{page.name}: no command that produced its figures"
        assert "2-core" in text and "GPU" in text, f"{page.name}: does not say what hardware it ran on"
        assert re.search(r"\bload\b", text), f"{page.name}: gives no machine load for its CPU timings"
        assert page.name in index, f"{page.name}: not listed in docs/results/index.md"
        assert f"results/{page.name}" in nav, f"{page.name}: not in mkdocs.yml's nav"


def test_the_benchmark_guide_names_every_script_and_its_results_pages_exist():
    guide = (ROOT / "benchmarks" / "README.md").read_text()
    assert len(guide.splitlines()) < 200  # a guide, not a log: the figures are on docs/results/
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    assert len(scripts) > 20  # the glob found the scripts
    assert [s for s in scripts if f"`{s}`" not in guide] == []
    named = set(re.findall(r"docs/results/[\w.-]+\.md", guide))
    assert named and sorted(p for p in named if not (ROOT / p).exists()) == []


def test_the_readme_quotes_no_load_and_points_at_status_and_results():
    readme = (ROOT / "README.md").read_text()
    assert not re.search(r"\bload (average )?\d", readme), "machine loads belong on docs/results/ pages"
    assert "## Measured" not in readme
    links = md_links(readme)
    assert {"docs/status.md", "docs/results/index.md", "docs/guides/launching.md"} <= links
