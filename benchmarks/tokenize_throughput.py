"""Tokenization throughput per process, side by side on the same documents (issue 31, item 2):

1. bare `tokenizers`: `encode_batch` over the documents in batches (and `encode_batch_fast`,
   which skips the character offsets), nothing else: the ceiling;
2. our pipeline step (`prepare_steps.TokenizeToShards`): hash split, `encode_batch_fast`, ids into
   one array, shards written and hashed; and each of its parts alone, to say where its time goes;
3. datatrove's own `DocumentTokenizer` step (unshuffled, writing its `.ds` files);
4. the path before datatrove (`datasets.map` of a `DocumentEncoder` into an Arrow list column,
   then flattened into the shard writer), rebuilt here for the comparison.

One process, one tokenizer thread (RAYON_NUM_THREADS=1): a rate per process, which is what a
task count multiplies. The variants alternate, each repetition runs every one once, and the best
of the repetitions is reported with the median beside it (a shared machine: see the README).

    python benchmarks/tokenize_throughput.py [--input-mb 8] [--vocab 8192] [--repeats 5] [--documents paragraph]

Documents are the standard library's source files (`--documents file`: ~13 kB each) or their
paragraphs (`--documents paragraph`, split at blank lines: ~200 bytes each, where a cost per
document shows).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers starts its thread pool
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from datatrove.data import Document  # noqa: E402
from datatrove.pipeline.tokens import DocumentTokenizer  # noqa: E402
from loguru import logger  # noqa: E402

from trinity_harness.jobs import loadavg  # noqa: E402
from trinity_harness.table import markdown_table, ratio  # noqa: E402
from trinity_train.data.default_corpus import corpus_files, stdlib_root  # noqa: E402
from trinity_train.data.prepare_steps import (ENCODE_BATCH, DocumentEncoder, ShardOptions,  # noqa: E402
                                              TokenizeToShards, is_validation)
from trinity_train.data.shards import ShardWriter, TokenSizedShards  # noqa: E402
from trinity_train.data.tokenizer import EOS_TOKEN, train_byte_level_bpe  # noqa: E402


def stdlib_documents(megabytes: float, unit: str) -> list[str]:
    texts, size = [], 0
    for file in corpus_files(stdlib_root()):
        text = file.read_text(encoding="utf-8", errors="replace")
        texts.extend(p for p in text.split("\n\n") if p.strip()) if unit == "paragraph" else texts.append(text)
        size += len(text.encode())
        if size >= megabytes * 1e6:
            break
    return texts


def batches(texts: list[str], size: int = ENCODE_BATCH):
    for start in range(0, len(texts), size):
        yield texts[start:start + size]


class Variants:
    """Each variant tokenizes every document once; returns the tokens it produced."""

    def __init__(self, texts: list[str], tokenizer, work: Path):
        self.texts, self.tokenizer, self.work = texts, tokenizer, work
        self.eos_id = tokenizer.token_to_id(EOS_TOKEN)
        self.json = tokenizer.to_str()
        self.tokenizer_path = work / "tokenizer.json"
        tokenizer.save(str(self.tokenizer_path))
        self.encoder = DocumentEncoder(self.json, self.eos_id, np.dtype("<u2"))
        self.round = 0

    def out(self, name: str) -> Path:
        self.round += 1
        return Path(tempfile.mkdtemp(prefix=f"{name}-{self.round}-", dir=self.work))

    def bare_encode_batch(self) -> int:
        return sum(len(e.ids) + 1 for b in batches(self.texts) for e in self.tokenizer.encode_batch(b))

    def bare_encode_batch_fast(self) -> int:
        return sum(len(e.ids) + 1 for b in batches(self.texts) for e in self.tokenizer.encode_batch_fast(b))

    def our_step(self) -> int:
        out = self.out("ours")
        step = TokenizeToShards(self.json, self.eos_id, ShardOptions(out, "bench", "<u2", 1 << 30, 0.02, 0), out)
        for _ in step.run((Document(text=t, id=str(i)) for i, t in enumerate(self.texts)), 0, 1):
            pass
        return int(step.stats["tokens"].total)

    def part_hash_split(self) -> int:
        for b in batches(self.texts):
            is_validation(b, 0, 0.02)
        return 0

    def part_encode_to_array(self) -> int:
        return sum(len(self.encoder(b)[0]) for b in batches(self.texts))

    def part_write_shards(self, encoded=None) -> int:
        encoded = encoded or [self.encoder(b) for b in batches(self.texts)]
        shards = TokenSizedShards(self.out("write"), 0, np.dtype("<u2"), "bench", 1 << 30)
        start = time.perf_counter()
        for tokens, lengths in encoded:
            shards.add(tokens, lengths)
        shards.finish()
        self.write_seconds = time.perf_counter() - start
        return sum(len(t) for t, _ in encoded)

    def datatrove_tokenizer(self) -> int:
        step = DocumentTokenizer(str(self.out("datatrove")), str(self.tokenizer_path), eos_token=EOS_TOKEN,
                                 batch_size=ENCODE_BATCH, shuffle_documents=False, save_final_metadata=False)
        step.run((Document(text=t, id=str(i)) for i, t in enumerate(self.texts)), 0, 1)  # not a generator
        return int(step.stats["tokens"].total)

    def before_datatrove(self) -> int:
        """The previous prepare-data's tokenizing: datasets.map into an Arrow column, then flattened."""
        ds = datasets.Dataset.from_dict({"text": self.texts})

        def encode(texts):
            return {"ids": [e.ids + [self.eos_id] for e in self.tokenizer.encode_batch(texts)]}

        mapped = ds.map(encode, batched=True, batch_size=512, input_columns=["text"], remove_columns=["text"],
                        features=datasets.Features({"ids": datasets.List(datasets.Value("uint32"))}),
                        keep_in_memory=True, new_fingerprint=f"bench-{self.round}")
        total = 0
        with ShardWriter(self.out("before"), 0, np.dtype("<u2"), "bench") as writer:
            for table in mapped.with_format("arrow").iter(batch_size=8192):
                ids = table.column("ids").combine_chunks()
                writer.add(pc.list_flatten(ids).to_numpy(), pc.list_value_length(ids).to_numpy())
            total = writer.finish()["num_tokens"]
        return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-mb", type=float, default=8.0)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--documents", choices=("file", "paragraph"), default="file")
    args = parser.parse_args()
    logger.disable("datatrove")
    datasets.disable_progress_bars()
    print(f"# load: {loadavg()}")
    texts = stdlib_documents(args.input_mb, args.documents)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    tokenizer = train_byte_level_bpe([texts], args.vocab, len(texts))
    names = ["bare_encode_batch", "bare_encode_batch_fast", "our_step", "datatrove_tokenizer", "before_datatrove",
             "part_hash_split", "part_encode_to_array"]
    seconds: dict[str, list[float]] = {n: [] for n in names + ["part_write_shards"]}
    tokens: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as work:
        variants = Variants(texts, tokenizer, Path(work))
        encoded = [variants.encoder(b) for b in batches(texts)]
        for _ in range(args.repeats):
            for name in names:
                start = time.perf_counter()
                tokens[name] = getattr(variants, name)()
                seconds[name].append(time.perf_counter() - start)
            tokens["part_write_shards"] = variants.part_write_shards(encoded)
            seconds["part_write_shards"].append(variants.write_seconds)
    total = tokens["bare_encode_batch"]
    base = min(seconds["bare_encode_batch"])
    print(f"{len(texts):,} documents (one per {args.documents}), {mb:.1f} MB, {total:,} tokens (EOS included), BPE {args.vocab}, "
          f"1 thread, best (median) of {args.repeats}")
    print(f"# load after: {loadavg()}")
    rows = []
    for name in seconds:
        best, median = min(seconds[name]), statistics.median(seconds[name])
        rate = f"{total / best:,.0f}" if not name.startswith("part_hash") else "-"
        rows.append([name, f"{best:.3f}", f"{median:.3f}", rate, ratio(best, base)])
    print(markdown_table(["variant", "best s", "median s", "tokens/s", "time vs bare encode_batch"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
