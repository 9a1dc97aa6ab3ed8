"""The docs site (mkdocs.yml, docs/): its generated config reference has every key of every
section with a description, its CLI reference every command, the README stays a short front door
whose links resolve, and the site builds with warnings as errors (broken links and anchors
included)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

from trinity_train import config

ROOT = Path(__file__).resolve().parents[1]


def _docs_site():
    spec = importlib.util.spec_from_file_location("docs_site", ROOT / "scripts" / "docs_site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs_site = _docs_site()


def dataclass_keys(cls: type = config.Config, prefix: str = "") -> list[str]:
    """Every settable key of the config tree, read from the dataclasses (lists of tables as `a.b[].c`)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys += dataclass_keys(hint, f"{prefix}{f.name}.")
            continue
        keys.append(f"{prefix}{f.name}")
        args = typing.get_args(hint)
        if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
            keys += dataclass_keys(args[0], f"{prefix}{f.name}[].")
    return keys


def test_the_config_reference_has_every_key_with_its_type_default_and_meaning():
    reference = docs_site.config_reference()
    keys = dataclass_keys()
    assert {"model.vocab_size", "data.mix[].weight", "data.phases[].start_tokens", "stability.inject[].fault",
            "watchdog.first_s", "run.dir"} <= set(keys)
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([\w.\[\]]+)` \|.*$", reference, re.M)}
    assert set(rows) == set(keys)
    for key in keys:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", rows[key])[1:-1]]
        assert len(cells) == 4 and all(cells), (key, cells)
    for table in ("[model]", "[watchdog]", "[[data.mix]]", "[[data.phases]]", "[[stability.inject]]"):
        assert f"## `{table}`" in reference
    # a meaning runs on over the comment lines below its field
    assert "gemma3: 6, i.e. 5 : 1" in rows["model.global_every"]
    assert "`8192`" in rows["model.vocab_size"] and "`\"trinity\"`" in rows["model.block"]


def test_a_config_key_without_a_description_fails_the_reference(tmp_path, monkeypatch):
    source = (ROOT / "trinity_train" / "config.py").read_text()
    line = re.search(r"^    hidden_size: int = \d+(  #.*)$", source, re.M)
    stripped = tmp_path / "config.py"
    stripped.write_text(source.replace(line.group(0), line.group(0).removesuffix(line.group(1))))
    monkeypatch.setattr(docs_site, "CONFIG_SOURCE", stripped)
    with pytest.raises(docs_site.MissingDescription, match=r"model\.hidden_size"):
        docs_site.config_reference()


def test_the_build_hook_refuses_what_it_cannot_generate_or_include():
    from mkdocs.exceptions import PluginError

    page = SimpleNamespace(file=SimpleNamespace(src_uri="reference/x.md"))
    for marker in ("<!-- generated: no-such-reference -->", "<!-- include: no/such/README.md -->"):
        with pytest.raises(PluginError, match="reference/x.md"):
            docs_site.on_page_markdown(f"# x\n\n{marker}\n", page, None, None)


def test_the_cli_reference_has_every_command_and_argument():
    from trinity_train.cli import build_parser

    reference = docs_site.cli_reference()
    commands = docs_site.cli_commands()
    names = [c for c, _, _ in commands]
    top = build_parser(["--help"])._subparsers._group_actions[0].choices
    expected = {f"trinity-train {n}" for n in top if n != "ckpt"} | {"trinity-train ckpt inspect",
                                                                   "trinity-train ckpt verify"}
    assert set(names) == expected and "trinity-train prepare-data" in expected
    for command, _, parser in commands:
        assert f"### `{command}`" in reference
        for action in parser._actions:
            for option in set(action.option_strings) - {"-h", "--help"}:
                assert option in reference, (command, option)


def test_the_readme_is_a_short_front_door_whose_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    first_block = readme.split("```")[1]
    assert first_block.strip().splitlines() == [
        "bash",
        "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e '.[dev]' "
        "&& .venv/bin/trinity-train train",
        "scripts/test.sh"]
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    assert len(targets) > 20
    assert [t for t in targets if not (ROOT / t).exists()] == []
    assert ".venv/bin/mkdocs serve" in readme


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a warning (a broken link or anchor, a page left out) fails it."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    command = [str(mkdocs)] if mkdocs.exists() else [shutil.which("mkdocs") or "mkdocs"]
    done = subprocess.run([*command, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    config_page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "stability.inject[].seconds" in config_page
    assert "trinity-train ckpt verify" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "Performance benchmarks" in (tmp_path / "site" / "benchmarks" / "index.html").read_text()
