"""The token files of other tools' tokenized corpora, read as (token file, dtype, document ends).

All three store tokens as a raw little-endian array without a header, like our shards; only the
index that cuts them into documents differs:

- datatrove (`DocumentTokenizer`): `NAME.ds` tokens (uint16, or uint32 for vocabularies over
  65,536: its `token_size`), `NAME.ds.index` the end of every document in tokens (uint64),
  optionally `NAME.ds.metadata` ("tokenizer|token_size", the token count) and `NAME.ds.loss`
  (a per-token loss mask, which trinity-train has no place for: refused).
- Megatron (`MMapIndexedDataset`, megatron/core/datasets/indexed_dataset.py): `PREFIX.bin`
  tokens, `PREFIX.idx` = b"MMIDIDX\\x00\\x00", version <Q 1, dtype code <B, sequence count <Q,
  document count <Q, then int32 sequence lengths, int64 sequence byte offsets, int64 document
  indices (the first sequence of every document, then the sequence count).
- dolma (`dolma tokens`, python/dolma/tokenizer/memmap_writer.py): `NAME.npy` a raw np.memmap
  (no .npy header despite the name; dtype uint16 unless the run set another), `NAME.csv.gz` one
  row `start,end,id,src,loc` per document, in file order.

Every reader checks its index against itself and its token file's size; a reader that finds
something else says so in one line (DataError).
"""

from __future__ import annotations

import csv
import gzip
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trinity_train.errors import DataError

FORMATS = ("datatrove", "megatron", "dolma")
# The token file's extension of each format (what `--format auto` and a directory input look for).
TOKEN_SUFFIXES = {"datatrove": ".ds", "megatron": ".bin", "dolma": ".npy"}

_MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_HEADER = struct.Struct("<9sQBQQ")
# Megatron's DType codes; int32 ids (its choice for vocabularies of 65,500 or more) are the bytes of
# uint32 ids as long as no id is negative, which the vocabulary check rules out.
_MEGATRON_DTYPES = {8: np.dtype("<u2"), 4: np.dtype("<u4")}
_MEGATRON_DTYPE_NAMES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
                         7: "float32", 8: "uint16"}


@dataclass
class TokenFile:
    """One token file of another tool's corpus and what its index says about it."""

    tokens: Path
    index: Path  # the file its document ends came from
    dtype: np.dtype | None  # as the tool recorded it; None where it records none (dolma)
    doc_ends: np.ndarray  # int64, ascending: the end (in tokens) of every document

    def check_size(self, dtype: np.dtype) -> None:
        """The index must account for exactly the tokens the token file holds."""
        size = self.tokens.stat().st_size
        expected = int(self.doc_ends[-1]) * dtype.itemsize if len(self.doc_ends) else 0
        if size != expected:
            raise DataError(f"'{self.index}' ends its last document at token {expected // dtype.itemsize:,} "
                            f"({expected:,} bytes of {dtype.name}) but '{self.tokens}' holds {size:,} bytes: the index "
                            "does not belong to this token file, or the dtype is another (--dtype)")


def token_files(fmt: str, path: Path) -> list[Path]:
    """The token files an input names: the file itself (or a Megatron prefix), or every token file
    of the format in a directory, sorted."""
    suffix = TOKEN_SUFFIXES[fmt]
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.name.endswith(suffix) and p.is_file())
        if not found:
            raise DataError(f"directory '{path}' holds no {fmt} token files (*{suffix})")
        return found
    if fmt == "megatron" and path.suffix in (".bin", ".idx"):
        path = path.with_suffix(".bin")
    elif fmt == "megatron" and not path.name.endswith(suffix):
        path = path.with_name(path.name + suffix)  # a Megatron data prefix
    if not path.is_file():
        raise DataError(f"input '{path}' does not exist; pass {fmt} token files (*{suffix}) or directories of them")
    return [path]


def index_files(fmt: str, tokens: Path) -> list[Path]:
    """The files beside a token file that describe it: its index first, then the optional ones."""
    if fmt == "datatrove":
        return [tokens.with_name(tokens.name + suffix) for suffix in (".index", ".metadata", ".loss")]
    if fmt == "megatron":
        return [tokens.with_suffix(".idx")]
    return [tokens.with_name(tokens.name.removesuffix(".npy") + ".csv.gz")]


def read_token_file(fmt: str, tokens: Path) -> TokenFile:
    return {"datatrove": _read_datatrove, "megatron": _read_megatron, "dolma": _read_dolma}[fmt](tokens)


def _missing_index(tokens: Path, index: Path, tool: str) -> DataError:
    return DataError(f"'{tokens}' has no index '{index}' beside it: its documents cannot be found without it; "
                     f"keep the {tool} file next to the token file it indexes")


def _ascending_ends(ends: np.ndarray, where: Path) -> np.ndarray:
    if len(ends) and (ends[0] < 0 or np.any(np.diff(ends) < 0)):
        raise DataError(f"'{where}' is damaged: its document ends do not ascend from 0")
    return ends.astype(np.int64)


def _read_datatrove(tokens: Path) -> TokenFile:
    index, metadata, loss = index_files("datatrove", tokens)
    if not index.is_file():
        raise _missing_index(tokens, index, "datatrove .ds.index")
    if loss.is_file():
        raise DataError(f"'{tokens}' has a loss mask '{loss}', which trinity-train cannot apply (it trains on "
                        "every token); tokenize without save_loss_metadata, or remove the mask to train on all")
    if index.stat().st_size % 8:
        raise DataError(f"'{index}' is not a datatrove index: {index.stat().st_size} bytes, not whole uint64 "
                        "document ends")
    ends = _ascending_ends(np.fromfile(index, dtype="<u8").astype(np.int64), index)
    return TokenFile(tokens, index, _datatrove_dtype(metadata), ends)


def _datatrove_dtype(metadata: Path) -> np.dtype | None:
    """The token size a .ds.metadata records ("tokenizer|token_size" on its first line), if any."""
    if not metadata.is_file():
        return None
    first = metadata.read_text(encoding="utf-8", errors="replace").split("\n", 1)[0]
    size = first.rsplit("|", 1)[-1].strip()
    if size not in ("2", "4"):
        raise DataError(f"'{metadata}' is not a datatrove metadata file: its first line '{first}' does not end "
                        "in |2 or |4 (the token size)")
    return np.dtype("<u2" if size == "2" else "<u4")


def _read_megatron(tokens: Path) -> TokenFile:
    (index,) = index_files("megatron", tokens)
    if not index.is_file():
        raise _missing_index(tokens, index, "Megatron .idx")
    size = index.stat().st_size
    with open(index, "rb") as f:
        head = f.read(_MEGATRON_HEADER.size)
    if len(head) < _MEGATRON_HEADER.size or not head.startswith(_MEGATRON_MAGIC):
        raise DataError(f"'{index}' is not a Megatron MMapIndexedDataset index (no MMIDIDX header)")
    _, version, code, sequences, documents = _MEGATRON_HEADER.unpack(head)
    if version != 1:
        raise DataError(f"'{index}' is a Megatron index of version {version}; trinity-train reads version 1")
    if code not in _MEGATRON_DTYPES:
        raise DataError(f"'{index}' stores {_MEGATRON_DTYPE_NAMES.get(code, f'dtype code {code}')} tokens; "
                        "trinity-train reads uint16 or int32 token ids (Megatron's own choices for token ids)")
    expected = _MEGATRON_HEADER.size + sequences * (4 + 8) + documents * 8
    if size != expected:
        raise DataError(f"'{index}' is damaged or multimodal: {size:,} bytes where {sequences:,} sequences and "
                        f"{documents:,} document indices take {expected:,}")
    lengths = np.memmap(index, dtype="<i4", mode="r", offset=_MEGATRON_HEADER.size, shape=(sequences,))
    pointers = np.memmap(index, dtype="<i8", mode="r", offset=_MEGATRON_HEADER.size + 4 * sequences,
                         shape=(sequences,))
    doc_index = np.memmap(index, dtype="<i8", mode="r", offset=_MEGATRON_HEADER.size + 12 * sequences,
                          shape=(documents,))
    dtype = _MEGATRON_DTYPES[code]
    seq_starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    if np.any(lengths < 0) or not np.array_equal(pointers, seq_starts[:-1] * dtype.itemsize):
        raise DataError(f"'{index}' is damaged: its sequences are not laid end to end in '{tokens}'")
    if documents < 1 or doc_index[0] != 0 or doc_index[-1] != sequences or np.any(np.diff(doc_index) < 0):
        raise DataError(f"'{index}' is damaged: its document indices do not run from 0 to its {sequences:,} sequences")
    return TokenFile(tokens, index, dtype, seq_starts[np.asarray(doc_index[1:])])


def _read_dolma(tokens: Path) -> TokenFile:
    (index,) = index_files("dolma", tokens)
    if not index.is_file():
        raise _missing_index(tokens, index, "dolma .csv.gz")
    starts, ends = [], []
    try:
        with gzip.open(index, "rt", encoding="utf-8", newline="") as f:
            for line, row in enumerate(csv.reader(f), 1):
                try:
                    starts.append(int(row[0]))
                    ends.append(int(row[1]))
                except (IndexError, ValueError):
                    raise DataError(f"'{index}' line {line} is not a dolma metadata row (start,end,id,src,loc): "
                                    f"{','.join(row)[:80]!r}") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"'{index}' is not a gzipped dolma metadata file ({e})") from None
    starts_a, ends_a = np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)
    if len(ends_a) and (starts_a[0] != 0 or np.any(starts_a[1:] != ends_a[:-1]) or np.any(ends_a < starts_a)):
        raise DataError(f"'{index}' is damaged: its documents do not follow one another from token 0")
    return TokenFile(tokens, index, None, ends_a)
