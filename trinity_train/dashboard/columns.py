"""metrics.jsonl as columns: numpy arrays of the fields the dashboard draws, nothing else.

A million-line metrics file is ~700 MB of JSON; a list of dicts of it would take gigabytes and
`json.loads` per line ~15 s. The records arrive as Arrow tables of `columnar.SCHEMA` (the plotted
fields only): from the trainer's columnar mirror of metrics.jsonl, and from pyarrow's C++ JSON
reader for the lines after it. The values are kept as float32 (plenty for a chart; NaN where a
value is null or absent), so a million train records cost ~40 MB.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trinity_train.columnar import (LAYER_LISTS, PASSKEY_LISTS, RANK_LISTS, TRAIN_LISTS, TRAIN_SCALARS, VAL_LISTS,
                                   VAL_SCALARS, parse_lines)
from trinity_train.records import RecordKind



def float_column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False).astype(np.float32)


def int_column(table: pa.Table, name: str, missing: int = -1) -> np.ndarray:
    return table.column(name).fill_null(missing).to_numpy().astype(np.int64)


def list_column(table: pa.Table, name: str, depth: int = 1) -> np.ndarray:
    """A list (depth 1) or list-of-lists (depth 2) column as a float32 array [rows, n] or
    [rows, n, m], padded with NaN where a row's list is shorter or null."""
    column = table.column(name).combine_chunks()
    rows = [[] if v is None else v for v in column.to_pylist()] if depth == 2 else None
    if depth == 2:
        n = max((len(r) for r in rows), default=0)
        m = max((len(inner or []) for r in rows for inner in r), default=0)
        out = np.full((len(rows), n, m), np.nan, np.float32)
        for i, r in enumerate(rows):
            for j, inner in enumerate(r):
                if inner:
                    out[i, j, :len(inner)] = [np.nan if v is None else v for v in inner]
        return out
    lengths = column.value_lengths().fill_null(0).to_numpy()
    width = int(lengths.max()) if len(lengths) else 0
    out = np.full((len(column), width), np.nan, np.float32)
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    if width and len(values) == width * len(column):  # every row full (the usual case): a reshape
        return values.reshape(len(column), width)
    if width and len(values):
        rows_idx = np.repeat(np.arange(len(column)), lengths)
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[rows_idx, np.arange(len(values)) - starts] = values
    return out


class GrowingArray:
    """An array that rows are appended to (amortised O(1), capacity doubles); `.values` is a view
    of the rows so far. A view taken before an append stays valid: appends write past its end or
    into a new buffer."""

    def __init__(self, dtype, row_shape: tuple[int, ...] | None = None):
        self.dtype = dtype
        self.row_shape = row_shape     # fixed by the first append when None
        self._buffer: np.ndarray | None = None
        self._rows = 0

    def __len__(self) -> int:
        return self._rows

    @property
    def values(self) -> np.ndarray:
        if self._buffer is None:
            return np.empty((0, *(self.row_shape or ())), self.dtype)
        return self._buffer[:self._rows]

    def append(self, rows: np.ndarray) -> None:
        if len(rows) == 0:
            return
        if self.row_shape is None:
            self.row_shape = rows.shape[1:]
        rows = _fit(rows, self.row_shape)
        needed = self._rows + len(rows)
        if self._buffer is None or needed > len(self._buffer):
            capacity = max(needed, 2 * (0 if self._buffer is None else len(self._buffer)), 1024)
            grown = np.empty((capacity, *self.row_shape), self.dtype)
            if self._buffer is not None:
                grown[:self._rows] = self._buffer[:self._rows]
            self._buffer = grown
        self._buffer[self._rows:needed] = rows
        self._rows = needed


def _fit(rows: np.ndarray, row_shape: tuple[int, ...]) -> np.ndarray:
    """Rows cut or NaN-padded to `row_shape` (a list that got longer or shorter mid-run)."""
    if rows.shape[1:] == row_shape:
        return rows
    out = np.full((len(rows), *row_shape), np.nan, np.float32)
    common = tuple(slice(0, min(a, b)) for a, b in zip(rows.shape[1:], row_shape))
    out[(slice(None), *common)] = rows[(slice(None), *common)]
    return out


class RecordColumns:
    """The records of one kind as named columns that grow as lines arrive."""

    def __init__(self, floats: tuple[str, ...], lists: tuple[str, ...] = (), nested: tuple[str, ...] = (),
                 ints: tuple[str, ...] = ("iter", "step"), width: int | None = None):
        """`width`: the lists' fixed length (longer ones cut, shorter ones NaN-padded) where a run's
        lists may grow (more position buckets after a context extension); else the first row's."""
        self.ints, self.floats, self.lists, self.nested = ints, floats, lists, nested
        self.columns: dict[str, GrowingArray] = {name: GrowingArray(np.int64, ()) for name in ints}
        self.columns.update({name: GrowingArray(np.float32, ()) for name in floats})
        self.columns.update({name: GrowingArray(np.float32, None if width is None else (width,)) for name in lists})
        self.columns.update({name: GrowingArray(np.float32) for name in nested})

    def __len__(self) -> int:
        return len(self.columns["iter"])

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name].values

    def append(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        for name in self.ints:
            self.columns[name].append(int_column(table, name))
        for name in self.floats:
            self.columns[name].append(float_column(table, name))
        for name in self.lists:
            self.columns[name].append(list_column(table, name))
        for name in self.nested:
            self.columns[name].append(list_column(table, name, depth=2))


def train_columns() -> RecordColumns:
    return RecordColumns(TRAIN_SCALARS + ("skipped", "superseded_at"), TRAIN_LISTS)


# The most position buckets and passkey lengths a run's dashboard shows (the first ones).
MAX_POSITION_BUCKETS = 64
MAX_PASSKEY_LENGTHS = 32


def val_columns() -> RecordColumns:
    return RecordColumns(VAL_SCALARS + ("superseded_at",), VAL_LISTS, width=MAX_POSITION_BUCKETS)


def passkey_columns() -> RecordColumns:
    return RecordColumns(("superseded_at",), PASSKEY_LISTS, width=MAX_PASSKEY_LENGTHS)


def layer_columns() -> RecordColumns:
    return RecordColumns(("superseded_at",), LAYER_LISTS, ("tokens_per_expert",))


def rank_columns() -> RecordColumns:
    return RecordColumns(("superseded_at",), RANK_LISTS)


class MetricsColumns:
    """One metrics file (metrics.jsonl or metrics.superseded.jsonl) as columns per record kind;
    `moe_layers` is the MoE layer indices of the latest layers record."""

    KINDS = (RecordKind.TRAIN, RecordKind.VAL, RecordKind.LAYERS, RecordKind.RANKS,
             RecordKind.PASSKEY)  # the kinds it holds, by attribute

    def __init__(self):
        self.train = train_columns()
        self.val = val_columns()
        self.layers = layer_columns()
        self.ranks = rank_columns()
        self.passkey = passkey_columns()
        self.moe_layers: list[int] = []

    def append_lines(self, data: bytes) -> dict[str, int]:
        """Add the records of complete JSON lines; returns how many of each kind arrived."""
        return self.append_table(parse_lines(data))

    def append_table(self, table: pa.Table) -> dict[str, int]:
        """Add records given as a table of `columnar.SCHEMA`; returns how many of each kind arrived."""
        table = table.set_column(table.schema.get_field_index("skipped"), "skipped",
                                 table.column("skipped").cast(pa.float64()))
        table = table.set_column(table.schema.get_field_index("superseded_at"), "superseded_at",
                                 table.column("superseded_at").cast(pa.float64()))
        kinds = table.column("kind")
        counts = {}
        for kind in self.KINDS:
            columns = getattr(self, kind)
            # Only this kind's columns are filtered: copying every column (the layers records'
            # nested lists) for a million train rows would cost seconds.
            wanted = list(columns.columns) + (["moe_layers"] if kind == RecordKind.LAYERS else [])
            rows = table.select(wanted).filter(pc.and_kleene(pc.equal(kinds, kind.value),
                                                             pc.is_valid(table.column("iter"))))
            columns.append(rows)
            counts[kind] = rows.num_rows
            if kind == RecordKind.LAYERS and rows.num_rows:
                latest = rows.column("moe_layers")[-1].as_py()
                self.moe_layers = [int(i) for i in latest or []]
        return counts
