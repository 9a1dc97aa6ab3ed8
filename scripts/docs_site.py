"""The docs site's generated parts, and the MkDocs hook that puts them in (mkdocs.yml `hooks:`).

A page of `docs/` holds a marker on a line of its own, which the build replaces:

- `<!-- generated: config-reference -->`: every key of every config section, read from the
  dataclasses of `trinity_train/config.py` (name, type, default) and the `#` comment on the
  field's line with its continuation lines (the meaning). A key without a comment fails the build.
- `<!-- generated: cli-reference -->`: every command and subcommand of `trinity-train`, read from
  the argparse parsers of `trinity_train/cli.py`, with its arguments and their help.
- `<!-- include: PATH -->`: the Markdown file PATH of the repository, for the docs that live
  beside their code (benchmarks/README.md); `<!-- include-section: PATH -->` the same with its
  headings one level down, as a section of the page (launch/README.md).

Every page also gets a blank line before a list that follows a paragraph line, so that the
Markdown written for GitHub (the READMEs, DESIGN, CONTRACT) renders its lists here too.

Nothing generated is committed, so no page can go stale. tests/test_docs_site.py checks the
generated references against the code and builds the site with `mkdocs build --strict`.
This file stays outside the `trinity_train` package: the package never imports it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import re
import tokenize
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG_SOURCE = ROOT / "trinity_train" / "config.py"
MARKER = re.compile(r"^<!-- (generated|include|include-section): ([\w./-]+) -->$", re.M)


class MissingDescription(ValueError):
    """A config key has no `#` comment: the reference cannot say what it means."""


# ---------------------------------------------------------------------------- config reference


def field_comments(source: str) -> dict[str, tuple[str, dict[str, str]]]:
    """Class name -> (its note, {field name: meaning}) from the source of the config module.

    A field's meaning is the comment on its line plus the comment-only lines right below it (the
    source's continuation lines); a class's note is its docstring and the comment-only lines
    before its first field."""
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    found: dict[str, tuple[str, dict[str, str]]] = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        fields = [n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        note = [ast.get_docstring(cls) or ""]
        start = cls.body[0].end_lineno + 1 if ast.get_docstring(cls) else cls.lineno + 1
        stop = fields[0].lineno if fields else start
        note += [comments[i] for i in range(start, stop) if i in comments and i not in code_lines]
        meanings = {}
        for node in fields:
            line = node.end_lineno
            if line not in comments:
                continue
            parts = [comments[line]]
            line += 1
            while line in comments and line not in code_lines:
                parts.append(comments[line])
                line += 1
            meanings[node.target.id] = " ".join(p for p in parts if p)
        found[cls.name] = (" ".join(n for n in note if n), meanings)
    return found


def _annotations(source: str) -> dict[str, dict[str, str]]:
    """Class name -> field name -> the annotation as written."""
    return {cls.name: {n.target.id: ast.unparse(n.annotation) for n in cls.body
                       if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            for cls in ast.parse(source).body if isinstance(cls, ast.ClassDef)}


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _item_class(cls: type, name: str) -> type | None:
    """The dataclass of a list-of-tables field (`data.mix: list[DataSource]`), else None."""
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if dataclasses.is_dataclass(item):
            return item
    return None


# How the reference spells a type the source names for the code (config.UserPath: a str whose `~`
# is expanded when the config is read).
TYPE_NAMES = {"UserPath": "str (a path, ~ expanded)"}


def config_keys() -> list[dict]:
    """Every key of the config tree, in source order: section, key, type, default, meaning.

    Keys of a list of tables are named `section.field[].key`. Raises MissingDescription naming
    every key without a meaning."""
    from trinity_train import config

    source = CONFIG_SOURCE.read_text()
    comments = field_comments(source)
    annotations = _annotations(source)
    keys: list[dict] = []
    missing: list[str] = []

    def walk(cls: type, prefix: str, section: str) -> None:
        meanings = comments[cls.__name__][1]
        nested = []
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            item = _item_class(cls, f.name)
            meaning = meanings.get(f.name, "")
            if not meaning:
                missing.append(key)
            type_name = annotations[cls.__name__][f.name]
            keys.append({"section": section, "key": key, "type": TYPE_NAMES.get(type_name, type_name),
                         "default": _toml(_default(f)), "meaning": meaning,
                         "table": item.__name__ if item else None})
            if item is not None:
                nested.append((item, f"{key}[].", f"{key}[]"))
        for item, item_prefix, item_section in nested:
            walk(item, item_prefix, item_section)

    for section in dataclasses.fields(config.Config):
        walk(typing.get_type_hints(config.Config)[section.name], f"{section.name}.", section.name)
    if missing:
        raise MissingDescription(
            f"config keys without a description (a `#` comment on the field in {CONFIG_SOURCE.name}): "
            + ", ".join(missing))
    return keys


def config_reference() -> str:
    from trinity_train import config

    hints = typing.get_type_hints(config.Config)
    comments = field_comments(CONFIG_SOURCE.read_text())
    keys = config_keys()
    tables = {f"{k['key']}[]": k["table"] for k in keys if k["table"]}
    out: list[str] = []
    section = None
    for k in keys:
        if k["section"] != section:
            section = k["section"]
            table = section.endswith("[]")
            title = f"[[{section[:-2]}]]" if table else f"[{section}]"
            out += ["", f"## `{title}`", ""]
            cls = tables[section] if table else hints[section].__name__
            note = comments[cls][0]
            if table:
                note = (f"A list of tables: each `[[{section[:-2]}]]` in the TOML file (or an element of "
                        f"`--{section[:-2]}='[{{...}}, ...]'`) holds these keys. " + note)
            if note:
                out += [_cell(note), ""]
            out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        out.append(f"| `{k['key']}` | `{_cell(k['type'])}` | `{_cell(k['default'])}` | {_cell(k['meaning'])} |")
    return "\n".join(out).strip() + "\n"


# ---------------------------------------------------------------------------- CLI reference


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand of `parser`, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return []


def cli_commands() -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(full command, help, parser) of every command that does something, subcommands included.

    prepare-data's parser is only added for its own argv or --help, so the parser is built for
    --help: every command is in it."""
    from trinity_train.cli import build_parser

    found = []

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        for name, text, sub in _subcommands(parser):
            children = _subcommands(sub)
            if children:
                walk(f"{prefix} {name}", sub)
            else:
                found.append((f"{prefix} {name}", text, sub))

    walk("trinity-train", build_parser(["--help"]))
    return found


def _argument_row(action: argparse.Action) -> str:
    if action.option_strings:
        name = ", ".join(action.option_strings)
        if action.nargs != 0:
            name += " " + (action.metavar or action.dest.upper())
    else:
        name = action.metavar or action.dest.upper()
        if action.nargs in ("+", "*"):
            name += " ..."
    notes = []
    if action.required and action.option_strings:
        notes.append("required")
    text = action.help or ""
    if action.choices:
        notes.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    if (action.option_strings and action.nargs != 0 and action.default not in (None, "", argparse.SUPPRESS)
            and "default" not in text):
        notes.append(f"default `{action.default}`")
    extra = f" ({', '.join(notes)})" if notes else ""
    return f"| `{_cell(name)}` | {_cell(text)}{extra} |"


def cli_reference() -> str:
    out: list[str] = []
    for command, text, parser in cli_commands():
        usage = " ".join(parser.format_usage().split())
        usage = usage.removeprefix("usage: ")
        out += ["", f"### `{command}`", "", _cell(text[:1].upper() + text[1:]) + "." if text else ""]
        if parser.description:
            out += ["", _cell(parser.description)]
        out += ["", "```", usage, "```", ""]
        rows = [_argument_row(a) for a in parser._actions if not isinstance(a, argparse._HelpAction)]
        if rows:
            out += ["| argument | meaning |", "|---|---|", *rows]
        if command == "trinity-train train":
            out += ["", "Any other `--section.key=value` (or `--section.key value`) sets that key of the config; "
                        "every key is in the [config reference](config.md)."]
    return "\n".join(out).strip() + "\n"


# ---------------------------------------------------------------------------- the hook


def _demote(markdown: str) -> str:
    """Every heading one level down (not inside code blocks)."""
    lines, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,5} ", line):
            line = "#" + line
        lines.append(line)
    return "\n".join(lines) + "\n"


LIST_ITEM = re.compile(r"([-*+]|\d+\.) ")


def _blank_before_lists(markdown: str) -> str:
    """A blank line before a list that follows a paragraph line: GitHub starts a list there,
    Python-Markdown (MkDocs) would run it into the paragraph. Code blocks are left alone."""
    lines, fenced, previous = [], False, ""
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif (not fenced and LIST_ITEM.match(line) and previous.strip() and not LIST_ITEM.match(previous)
              and not previous[:1].isspace()):
            lines.append("")
        lines.append(line)
        previous = line
    return "\n".join(lines) + "\n"


GENERATORS = {"config-reference": config_reference, "cli-reference": cli_reference}


def expand(markdown: str) -> str:
    def replace(match: re.Match) -> str:
        kind, what = match.groups()
        if kind == "generated":
            return GENERATORS[what]()
        text = (ROOT / what).read_text()
        return _demote(text) if kind == "include-section" else text

    return _blank_before_lists(MARKER.sub(replace, markdown))


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs' signature)
    from mkdocs.exceptions import PluginError

    try:
        return expand(markdown)
    except (MissingDescription, KeyError, OSError) as e:
        raise PluginError(f"{page.file.src_uri}: {e}") from e
