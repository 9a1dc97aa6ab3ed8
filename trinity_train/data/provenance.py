"""Where a global batch came from: for each row, the dataset, shard and document it was cut from,
and its first tokens decoded, so an incident report can name the data of an offending step."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from trinity_train.data.shards import TOKENIZER_FILE

FIRST_TOKENS = 24  # tokens of each row decoded into the report


@lru_cache(maxsize=8)
def _tokenizer(dataset_dir: str) -> Tokenizer | None:
    path = Path(dataset_dir) / TOKENIZER_FILE
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def batch_documents(loader, index: int, first_tokens: int = FIRST_TOKENS) -> list[dict]:
    """One entry per row of global batch `index`: `row`, `dataset`, `shard`, `document` (within
    the shard), `offset` (token offset within that document), `first_tokens` (decoded text, or
    the ids when the dataset's tokenizer is missing)."""
    rows, dataset_dirs = [], loader.dataset_dirs
    for row, (source, start) in enumerate(loader.row_origins(index)):
        split = loader.split(source)
        shard, document, offset = split.locate(start)
        ids = split.read(start, min(first_tokens, split.num_tokens - start)).tolist()
        tokenizer = _tokenizer(str(dataset_dirs[source]))
        rows.append({"row": row, "dataset": str(dataset_dirs[source]), "shard": shard, "document": document,
                     "offset": offset, "first_tokens": tokenizer.decode(ids) if tokenizer else ids})
    return rows
