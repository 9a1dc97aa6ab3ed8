"""metrics.jsonl's plotted fields as Arrow columns: what the dashboard reads, and the mirror the
trainer keeps of it so a long run opens in a fraction of a second.

metrics.jsonl stays the source of truth. A million-line file is ~700 MB of JSON; even pyarrow's
C++ JSON reader, told to keep only the plotted fields (`SCHEMA`), needs seconds for it. So the
process that writes metrics.jsonl also writes `metrics.columns.arrow` beside it: the same records'
plotted fields as an Arrow IPC stream, a batch every `BATCH_ROWS` records, each row carrying the
byte offset in metrics.jsonl just past its line (`_jsonl_end`). A reader memory-maps the mirror
(milliseconds), then parses only the lines of metrics.jsonl after the last mirrored one.

The mirror belongs to one metrics.jsonl: its schema metadata holds that file's device and inode.
Every trainer start rewrites metrics.jsonl (a resume moves what it goes back past to the
superseded file), so the start rebuilds the mirror from it; a mirror of another file, a torn last
batch (a crash mid-write) or a missing mirror just means more lines to parse.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.json as pa_json

from trinity_train import signals
from trinity_train.files import temp_sibling

# The plotted scalars of each record kind (contract: docs/CONTRACT.md "Run directory"); the guard's
# signals (their skipped steps' markers show their values) among them.
TRAIN_SCALARS = tuple(dict.fromkeys(("loss", "grad_norm", *(s.name for s in signals.SIGNALS), "lr", "lr_muon",
                                     "tokens_per_s", "mfu")))
VAL_SCALARS = ("val_loss",)
# val records: the loss by position bucket and each bucket's first position (lists by bucket).
VAL_LISTS = ("val_position_starts", "val_loss_by_position")
# passkey records: lists by prompt length (the control, passkey_logprob_other_key, absent in older runs' records).
PASSKEY_LISTS = ("passkey_lengths", "passkey_accuracy", "passkey_logprob", "passkey_logprob_other_key")
# Per-layer lists: train records carry one value per MoE layer, layers records one per layer.
TRAIN_LISTS = ("moe_max_load_per_layer",)
LAYER_LISTS = ("grad_norm_attn", "grad_norm_ffn", "residual_rms")
# ranks records: one value per rank (health/rank_stats.py).
RANK_LISTS = ("iter_s", "compute_s", "wait_s", "data_s", "comm_exposed_s")

_F64 = pa.float64()
SCHEMA = pa.schema(
    [("kind", pa.string()), ("iter", pa.int64()), ("step", pa.int64()), ("skipped", pa.bool_()),
     ("superseded_at", pa.int64()), ("moe_layers", pa.list_(pa.int64())),
     ("tokens_per_expert", pa.list_(pa.list_(_F64)))]
    + [(name, _F64) for name in TRAIN_SCALARS + VAL_SCALARS]
    + [(name, pa.list_(_F64)) for name in TRAIN_LISTS + LAYER_LISTS + RANK_LISTS + VAL_LISTS + PASSKEY_LISTS])
END_COLUMN = "_jsonl_end"  # byte offset in metrics.jsonl just past the row's line
MIRROR_SCHEMA = SCHEMA.append(pa.field(END_COLUMN, pa.int64()))
BATCH_ROWS = 256

_PARSE = pa_json.ParseOptions(explicit_schema=SCHEMA, unexpected_field_behavior="ignore")
_READ = pa_json.ReadOptions(block_size=8 << 20)


def parse_lines(data: bytes) -> pa.Table:
    """The records of complete JSON lines as a table with SCHEMA's columns (a garbled line, or one
    with a field of an unexpected type, is skipped)."""
    if not data or data.isspace():
        return SCHEMA.empty_table()
    try:
        return pa_json.read_json(pa.BufferReader(data), read_options=_READ, parse_options=_PARSE)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return _parse_line_by_line(data)


def _parse_line_by_line(data: bytes) -> pa.Table:
    tables = []
    for line in data.splitlines():
        try:
            record = json.loads(line)
            if isinstance(record, dict):
                tables.append(pa.Table.from_pylist([record], schema=SCHEMA))
        except (ValueError, TypeError, pa.ArrowInvalid, pa.ArrowTypeError):
            continue
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def _identity(path: Path) -> dict[bytes, bytes]:
    st = os.stat(path)
    return {b"jsonl_dev": str(st.st_dev).encode(), b"jsonl_ino": str(st.st_ino).encode()}


def _line_ends(data: bytes) -> list[int]:
    ends, start = [], 0
    while (i := data.find(b"\n", start)) >= 0:
        ends.append(i + 1)
        start = i + 1
    return ends


class MirrorWriter:
    """Keeps `mirror` in step with the metrics.jsonl at `jsonl` (which must exist): rebuilt from it
    on creation, then a row per `append`."""

    def __init__(self, mirror: Path, jsonl: Path, batch_rows: int = BATCH_ROWS):
        self.mirror, self.jsonl, self.batch_rows = Path(mirror), Path(jsonl), batch_rows
        self._rows: list[dict] = []
        self._stopped = False  # a line the mirror could not take: readers parse from there on
        tmp = temp_sibling(self.mirror)
        self._file = pa.OSFile(str(tmp), "wb")
        self._writer = pa.ipc.new_stream(self._file, MIRROR_SCHEMA.with_metadata(_identity(self.jsonl)))
        self._copy_existing_lines()
        os.replace(tmp, self.mirror)  # complete up to now; appended to from here on

    def _copy_existing_lines(self) -> None:
        with open(self.jsonl, "rb") as f:
            data = f.read()
        data = data[:data.rfind(b"\n") + 1]
        if not data:
            return
        # One row per complete line, parsed line by line only where pyarrow cannot: the row's end
        # offset is needed, so the lines are parsed in slices that keep their positions.
        ends = _line_ends(data)
        start = 0
        for first in range(0, len(ends), 65536):
            chunk_ends = ends[first:first + 65536]
            chunk = data[start:chunk_ends[-1]]
            table = parse_lines(chunk)
            if table.num_rows != len(chunk_ends):  # a garbled line: leave the rest to the readers
                self._stopped = True
                return
            self._write(table, chunk_ends)
            start = chunk_ends[-1]

    def _write(self, table: pa.Table, ends: list[int]) -> None:
        table = table.append_column(END_COLUMN, pa.array(ends, pa.int64()))
        for batch in table.to_batches():
            self._writer.write_batch(batch)
        self._file.flush()

    def append(self, record: dict, jsonl_end: int) -> None:
        """The record just written to metrics.jsonl, whose line ends at byte `jsonl_end`."""
        if self._stopped:
            return
        self._rows.append({**{k: record.get(k) for k in SCHEMA.names}, END_COLUMN: jsonl_end})
        if len(self._rows) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        if self._rows:
            rows, self._rows = self._rows, []
            try:
                batch = pa.RecordBatch.from_pylist(rows, schema=MIRROR_SCHEMA)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                self._stopped = True  # a field of an unexpected type: readers parse on from the JSON
                return
            self._writer.write_batch(batch)
            self._file.flush()

    def close(self) -> None:
        self.flush()
        self._writer.close()
        self._file.close()


def read_mirror(mirror: Path, jsonl: Path) -> tuple[pa.Table, int, tuple[int, int]] | None:
    """(the mirrored rows, the metrics.jsonl offset they reach, that file's (device, inode)), or
    None when there is no usable mirror of the metrics.jsonl that is at `jsonl` now."""
    try:
        source = pa.memory_map(str(mirror), "r")
        reader = pa.ipc.open_stream(source)
    except (OSError, pa.ArrowInvalid):
        return None
    try:
        identity = _identity(jsonl)
    except OSError:
        return None
    if reader.schema.metadata != identity or not reader.schema.remove_metadata().equals(MIRROR_SCHEMA):
        return None  # the mirror of another file, or written with other columns (another version)
    batches = []
    try:
        for batch in reader:
            batches.append(batch)
    except (OSError, pa.ArrowInvalid):
        pass  # a batch torn by a crash: the rows before it stand
    table = pa.Table.from_batches(batches, schema=reader.schema)
    end = int(table.column(END_COLUMN)[-1].as_py()) if table.num_rows else 0
    try:
        if os.stat(jsonl).st_size < end:
            return None
    except OSError:
        return None
    return (table.drop_columns([END_COLUMN]).replace_schema_metadata(None), end,
            (int(identity[b"jsonl_dev"]), int(identity[b"jsonl_ino"])))
