"""Reading raw documents through `datasets`: local files and globs, or a hub dataset.

The result is always a `datasets.Dataset` with one string column, `text`, in a deterministic
order (files sorted, records in file order). Malformed records are reported with their file and
line, or, with `skip_bad_records`, counted and left out.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import fsspec
import pyarrow as pa

from trinity_train.errors import DataError

EXTENSION_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text",
                     ".csv": "csv"}
FORMATS = ("json", "parquet", "text", "csv")
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4")
HUB_PREFIX = "hub:"
TEXT = "text"  # the column every loaded dataset ends up with
_PROBLEM = "problem"  # column of the skip-bad-records reader: why a record was rejected
_EXAMPLES_KEPT = 3


@dataclass
class Inputs:
    """What `--input` resolved to: local files (sorted, with their format), or one hub dataset."""

    files: list[tuple[Path, str]] = field(default_factory=list)
    hub_name: str = ""
    hub_config: str = ""
    hub_split: str = "train"

    def fingerprint(self) -> list:
        """Identifies the input without reading it: paths, sizes and modification times."""
        if self.hub_name:
            return [HUB_PREFIX + self.hub_name, self.hub_config, self.hub_split]
        return [[str(p), fmt, p.stat().st_size, p.stat().st_mtime_ns] for p, fmt in self.files]

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p, _ in self.files)


@dataclass
class ReadReport:
    bad_records: int = 0
    bad_examples: list[str] = field(default_factory=list)  # "file:line: why", the first few


def format_of(path: Path, forced: str = "auto") -> str:
    if forced != "auto":
        return forced
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in _COMPRESSIONS:
        suffixes.pop()
    fmt = EXTENSION_FORMATS.get(suffixes[-1] if suffixes else "")
    if fmt is None:
        raise DataError(f"cannot tell the format of '{path}' from its extension (known: "
                        f"{', '.join(EXTENSION_FORMATS)}); pass --format {{{','.join(FORMATS)}}}")
    return fmt


def resolve_inputs(inputs: list[str], forced_format: str = "auto", hub_config: str = "",
                   hub_split: str = "train") -> Inputs:
    if not inputs:
        raise DataError("no input given: pass --input FILE|GLOB|DIR (repeatable) or --input hub:NAME")
    hub = [i for i in inputs if i.startswith(HUB_PREFIX)]
    if hub:
        if len(inputs) > 1:
            raise DataError("a hub dataset (--input hub:NAME) cannot be combined with other inputs; "
                            "prepare them separately and mix them with data.mix")
        return Inputs(hub_name=hub[0][len(HUB_PREFIX):], hub_config=hub_config, hub_split=hub_split)
    paths: list[Path] = []
    for spec in inputs:
        found = _expand(spec, forced_format)
        nonempty = [p for p in found if p.stat().st_size > 0]  # a glob may catch an empty file
        if not nonempty:
            raise DataError(f"input '{spec}' is empty" if len(found) == 1 else
                            f"every file input '{spec}' matches is empty")
        paths.extend(nonempty)
    unique = sorted({p.resolve() for p in paths})
    return Inputs(files=[(p, format_of(p, forced_format)) for p in unique])


def _expand(spec: str, forced_format: str) -> list[Path]:
    path = Path(spec).expanduser()
    if glob.has_magic(spec):
        found = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
        if not found:
            raise DataError(f"input '{spec}' matches no files")
        return found
    if path.is_dir():
        found = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                 and (forced_format != "auto" or _known_extension(p))]
        if not found:
            raise DataError(f"input directory '{spec}' holds no {', '.join(EXTENSION_FORMATS)} files")
        return found
    if not path.is_file():
        raise DataError(f"input '{spec}' does not exist")
    return [path]


def _known_extension(path: Path) -> bool:
    try:
        format_of(path)
        return True
    except DataError:
        return False


def load_documents(inputs: Inputs, text_field: str, cache_dir: Path, num_proc: int = 1,
                   skip_bad_records: bool = False, sample_by: str = "document",
                   encoding_errors: str = "strict") -> tuple[datasets.Dataset, ReadReport]:
    """All documents as a Dataset with one `text` column, and what was skipped on the way."""
    datasets.disable_progress_bars()
    # A file datasets cannot parse is reported below as one line (file, line, what to do); its
    # own log line about it would come first.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    report = ReadReport()
    if inputs.hub_name:
        parts = [_load_hub(inputs, text_field, num_proc, skip_bad_records, report)]
    else:
        parts = []
        for fmt in FORMATS:
            files = [p for p, f in inputs.files if f == fmt]
            if files:
                parts.append(_load_files(fmt, files, text_field, cache_dir, num_proc, skip_bad_records,
                                         sample_by, encoding_errors, report))
    docs = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if len(docs) == 0:
        raise DataError("the input holds no documents")
    return docs, report


def _load_hub(inputs: Inputs, text_field: str, num_proc: int, skip_bad_records: bool,
              report: ReadReport) -> datasets.Dataset:
    """Through the user's own Hugging Face cache, so a download is made once."""
    try:
        ds = datasets.load_dataset(inputs.hub_name, inputs.hub_config or None, split=inputs.hub_split,
                                   num_proc=num_proc if num_proc > 1 else None)
    except Exception as e:  # hub and network failures come in many types; all mean "cannot load"
        raise DataError(f"could not load '{inputs.hub_name}' from the Hugging Face hub "
                        f"({type(e).__name__}: {e}); check the name, or download it and pass files") from None
    return _text_column(ds, text_field, f"hub dataset '{inputs.hub_name}'", skip_bad_records, report,
                        num_proc)


def _load_files(fmt: str, files: list[Path], text_field: str, cache_dir: Path, num_proc: int,
                skip_bad_records: bool, sample_by: str, encoding_errors: str,
                report: ReadReport) -> datasets.Dataset:
    kwargs: dict = {}
    if fmt == "text":
        kwargs = {"sample_by": sample_by, "encoding_errors": encoding_errors}
    elif fmt in ("json", "csv"):
        kwargs = {"encoding_errors": encoding_errors}
    where = f"'{files[0]}'" if len(files) == 1 else f"the {len(files)} {fmt} input files"
    try:
        ds = datasets.load_dataset(fmt, data_files=[str(p) for p in files], split="train",
                                   cache_dir=str(cache_dir), num_proc=_procs(num_proc, len(files)),
                                   **kwargs)
    except (datasets.exceptions.DatasetGenerationError, ValueError, pa.ArrowException) as e:
        # (a malformed line can also surface as pyarrow's or the json module's own error)
        if fmt != "json":
            cause = e.__cause__ or e
            hint = " (pass --encoding-errors replace to replace undecodable bytes)" \
                if isinstance(cause, UnicodeDecodeError) else ""
            raise DataError(f"could not read {where} as {fmt}: {cause}{hint}") from None
        problem = first_json_problem(files, text_field)
        if not skip_bad_records:
            raise DataError(f"{problem or f'could not read {where} as JSON: {e.__cause__ or e}'}; "
                            "fix it, or pass --skip-bad-records to skip bad records") from None
        return _load_json_skipping_bad(files, text_field, cache_dir, report)
    if fmt == "json" and (_has_missing_text(ds, text_field) or not _holds_text(ds, text_field)):
        problem = first_json_problem(files, text_field)
        if problem and not skip_bad_records:  # a record lacks the field, or its value is no string
            raise DataError(f"{problem}; fix it, or pass --skip-bad-records to skip bad records")
        if problem:
            return _load_json_skipping_bad(files, text_field, cache_dir, report)
    # A text file's documents are its raw text: there is no field to choose.
    return _text_column(ds, TEXT if fmt == "text" else text_field, where, skip_bad_records, report, num_proc)


def _procs(num_proc: int, num_items: int) -> int | None:
    n = min(num_proc, num_items)
    return n if n > 1 else None


def _holds_text(ds: datasets.Dataset, text_field: str) -> bool:
    feature = ds.features.get(text_field)
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def _has_missing_text(ds: datasets.Dataset, text_field: str) -> bool:
    return text_field not in ds.column_names or ds.data.column(text_field).null_count > 0


def _text_column(ds: datasets.Dataset, text_field: str, where: str, skip_bad_records: bool,
                 report: ReadReport, num_proc: int) -> datasets.Dataset:
    """Keep only `text_field`, renamed `text`, after checking it holds strings."""
    if text_field not in ds.column_names:
        raise DataError(f"{where}: no field '{text_field}' (fields: {', '.join(ds.column_names)}); "
                        "choose the text field with --text-field")
    if not _holds_text(ds, text_field):
        raise DataError(f"{where}: field '{text_field}' holds {ds.features[text_field]}, not text; "
                        "choose the text field with --text-field")
    ds = ds.select_columns([text_field])
    if text_field != TEXT:
        ds = ds.rename_column(text_field, TEXT)
    missing = ds.data.column(TEXT).null_count
    if missing:
        if not skip_bad_records:
            raise DataError(f"{where}: {missing} records have no '{text_field}' value; "
                            "fix them, or pass --skip-bad-records to skip them")
        report.bad_records += missing
        report.bad_examples.append(f"{where}: {missing} records without a '{text_field}' value")
        ds = ds.filter(_is_present, batched=True, input_columns=[TEXT], num_proc=_procs(num_proc, len(ds)))
    return ds


def _is_present(texts: list) -> list[bool]:
    return [t is not None for t in texts]


# ---------------------------------------------------------------------------- JSON diagnosis


def json_records(path: Path, text_field: str) -> Iterator[tuple[str, str | None, str | None]]:
    """(location, text, problem) for each record of a JSON-lines file or a JSON array file."""
    with fsspec.open(str(path), "rt", compression="infer", encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 16)
        if head.lstrip().startswith("["):
            yield from _json_array_records(path, head + f.read(), text_field)
            return
        f.seek(0)
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except ValueError as e:
                yield where, None, f"malformed JSON ({e})"
                continue
            yield (where, *_text_of(record, text_field))


def _json_array_records(path: Path, content: str, text_field: str):
    try:
        records = json.loads(content)
    except json.JSONDecodeError as e:
        yield f"{path}:{e.lineno}", None, f"malformed JSON ({e.msg})"
        return
    for i, record in enumerate(records):
        yield (f"{path} item {i}", *_text_of(record, text_field))


def _text_of(record, text_field: str) -> tuple[str | None, str | None]:
    if not isinstance(record, dict):
        return None, "not a JSON object"
    value = record.get(text_field)
    if text_field in record and not isinstance(value, str):
        what = "null" if value is None else f"{type(value).__name__} {json.dumps(value)[:40]}"
        return None, f"field '{text_field}' holds {what}, not a string"
    if not isinstance(value, str):
        fields = ", ".join(record) or "none"
        return None, f"no string field '{text_field}' (fields: {fields}; choose one with --text-field)"
    return value, None


def first_json_problem(files: list[Path], text_field: str) -> str | None:
    for path in files:
        for where, _, problem in json_records(path, text_field):
            if problem:
                return f"{where}: {problem}"
    return None


def _good_and_bad_json(paths: list[str], text_field: str):
    for path in paths:
        for where, text, problem in json_records(Path(path), text_field):
            yield {TEXT: text, _PROBLEM: f"{where}: {problem}" if problem else None}


def _load_json_skipping_bad(files: list[Path], text_field: str, cache_dir: Path,
                            report: ReadReport) -> datasets.Dataset:
    """The slow, forgiving reader: parse line by line in Python, keep good records, count the rest."""
    features = datasets.Features({TEXT: datasets.Value("string"), _PROBLEM: datasets.Value("string")})
    ds = datasets.Dataset.from_generator(
        _good_and_bad_json, features=features, cache_dir=str(cache_dir),
        gen_kwargs={"paths": [str(p) for p in files], "text_field": text_field})
    problems = ds.data.column(_PROBLEM).drop_null().to_pylist()
    report.bad_records += len(problems)
    report.bad_examples.extend(problems[:_EXAMPLES_KEPT])
    ds = ds.filter(_is_present, batched=True, input_columns=[TEXT])
    return ds.remove_columns([_PROBLEM])
