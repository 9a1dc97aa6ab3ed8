"""`import-data`: corpora tokenized by datatrove (its real DocumentTokenizer), Megatron and dolma
(writers that follow their published formats, below) become prepared datasets whose token files
are the tools' own (linked, never copied), whose batches are the tools' tokens, and which train;
every bad input is one line."""

from __future__ import annotations

import csv
import errno
import gzip
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from conftest import assert_one_line_error, cli_in_process, run_config
from trinity_train.data import build_loaders
from trinity_train.data.import_data import ImportOptions, import_corpus
from trinity_train.data.shards import PreparedDataset, manifest_problem
from trinity_train.data.tokenizer import EOS_TOKEN, train_byte_level_bpe

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
NUM_DOCS = 120


def texts(n: int = NUM_DOCS) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=rng.integers(10, 40))) + f" doc{i}" for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A 300-token byte-level BPE, built here (nothing downloaded), as prepare-data trains one."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_byte_level_bpe([texts()], 300).save(str(path))
    return path


def encoded(tokenizer_file: Path, eos: bool = True) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos_id = [tokenizer.token_to_id(EOS_TOKEN)] if eos else []
    return [e.ids + eos_id for e in tokenizer.encode_batch(texts())]


# ---------------------------------------------------------------------------- the three tools' files


def write_datatrove(folder: Path, tokenizer_file: Path) -> Path:
    """datatrove's own tokenizer step (DocumentTokenizer, EOS appended, documents shuffled) on one task."""
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.tokens import DocumentTokenizer

    docs = [Document(text=t, id=str(i)) for i, t in enumerate(texts())]
    step = DocumentTokenizer(output_folder=str(folder), tokenizer_name_or_path=str(tokenizer_file),
                             eos_token=EOS_TOKEN, seed=0)
    LocalPipelineExecutor(pipeline=[docs, step], tasks=1, logging_dir=str(folder.parent / "datatrove-logs")).run()
    (ds,) = folder.glob("*.ds")
    return ds


def write_megatron(prefix: Path, docs: list[list[int]], dtype_code: int = 8) -> Path:
    """PREFIX.bin + PREFIX.idx as Megatron-LM's MMapIndexedDataset writes them
    (megatron/core/datasets/indexed_dataset.py, _IndexWriter and IndexedDatasetBuilder): b"MMIDIDX\\x00\\x00",
    <Q version 1, <B dtype code (8 uint16, 4 int32), <Q sequence count, <Q document count, int32
    sequence lengths, int64 sequence byte offsets, int64 document indices [0, ..., sequences]
    (preprocess_data.py without --split-sentences: one sequence per document)."""
    dtype = {8: np.uint16, 4: np.int32, 7: np.float32}[dtype_code]
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]) * np.dtype(dtype).itemsize
    prefix.with_suffix(".bin").write_bytes(np.concatenate(docs).astype(dtype).tobytes())
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(docs) + 1))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes() + np.arange(len(docs) + 1).tobytes())
    return prefix.with_suffix(".bin")


def write_dolma(path: Path, docs: list[list[int]], dtype=np.uint16) -> Path:
    """NAME.npy + NAME.csv.gz as `dolma tokens` writes them (python/dolma/tokenizer/memmap_writer.py):
    the .npy is a raw np.memmap of the concatenated ids (no .npy header), and the gzipped csv holds
    one MemmapMetadata row per document, start,end,id,src,loc, with no header line."""
    ids = np.concatenate(docs).astype(dtype)
    memmap = np.memmap(path, dtype=dtype, mode="w+", shape=ids.shape)
    memmap[:] = ids
    memmap.flush()
    ends = np.cumsum([len(d) for d in docs])
    with gzip.open(path.with_name(path.name.removesuffix(".npy") + ".csv.gz"), "wt", newline="") as f:
        writer = csv.writer(f)
        for i, (start, end) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
            writer.writerow([int(start), int(end), f"doc-{i}", "s3://bucket/input.json.gz", i])
    return path


def corpus(fmt: str, root: Path, tokenizer_file: Path) -> Path:
    """A corpus of the 120 documents written by (or as) `fmt`; returns its token file."""
    folder = root / fmt
    folder.mkdir()
    if fmt == "datatrove":
        return write_datatrove(folder, tokenizer_file)
    if fmt == "megatron":
        return write_megatron(folder / "corpus_text_document", encoded(tokenizer_file))
    return write_dolma(folder / "part-0-00000.npy", encoded(tokenizer_file))


def source_ids(token_file: Path) -> np.ndarray:
    return np.fromfile(token_file, dtype="<u2").astype(np.int64)


def imported(tokens: Path, out: Path, tokenizer_file: Path, **kw) -> PreparedDataset:
    result = import_corpus(ImportOptions(inputs=[str(tokens)], out=str(out), tokenizer=str(tokenizer_file),
                                         val_fraction=0.1, **kw))
    assert not result.reused
    return PreparedDataset.open(out)


# ---------------------------------------------------------------------------- importing


@pytest.mark.parametrize("fmt", ["datatrove", "megatron", "dolma"])
def test_an_imported_corpus_links_the_tools_tokens_and_its_batches_are_those_tokens(tmp_path, tokenizer_file, fmt):
    tokens = corpus(fmt, tmp_path, tokenizer_file)
    dataset = imported(tokens, tmp_path / "data", tokenizer_file)
    ids = source_ids(tokens)
    for split in ("train", "val"):  # both splits are the tool's file itself: nothing was copied
        linked = tmp_path / "data" / split / "00000.bin"
        assert linked.stat().st_ino == tokens.stat().st_ino and not linked.is_symlink()
    assert tokens.stat().st_nlink == 3
    train, val = dataset.splits["train"], dataset.splits["val"]
    assert train.num_documents + val.num_documents == NUM_DOCS and val.num_documents == 12
    assert train.num_tokens + val.num_tokens == len(ids)
    # The validation split is the file's trailing documents; each split's documents end with EOS.
    assert np.array_equal(val.read(0, val.num_tokens), ids[train.num_tokens:])
    for split in (train, val):
        starts = split.document_starts(0, split.num_tokens)
        ends = np.append(starts[1:], split.num_tokens)
        assert np.all(split.read(0, split.num_tokens)[ends - 1] == dataset.eos_id)

    cfg = run_config(tmp_path / "data", tmp_path / "run")
    loader, val_loader = build_loaders(cfg)
    seq_len = cfg.data.seq_len
    for index in range(3):
        batch = loader.batch_at(index)
        for row, (_, offset) in enumerate(loader.row_origins(index)):
            assert np.array_equal(batch.input_ids[row].numpy(), ids[offset:offset + seq_len])
            assert np.array_equal(batch.labels[row].numpy(), ids[offset + 1:offset + seq_len + 1])
    first_val = next(val_loader.batches(1))
    assert np.array_equal(first_val.input_ids[0].numpy(), ids[train.num_tokens:train.num_tokens + seq_len])


@pytest.mark.parametrize("fmt", ["datatrove", "megatron", "dolma"])
def test_an_imported_corpus_trains(tmp_path, tokenizer_file, fmt):
    from trinity_train.train import train

    imported(corpus(fmt, tmp_path, tokenizer_file), tmp_path / "data", tokenizer_file)
    summary = train(run_config(tmp_path / "data", tmp_path / "run", train={"steps": 2}, eval={"every": 2}))
    assert summary.step == 2 and np.isfinite(summary.last_loss) and np.isfinite(summary.last_val_loss)


def test_across_filesystems_the_token_file_is_a_symlink(tmp_path, tokenizer_file, monkeypatch):
    tokens = corpus("megatron", tmp_path, tokenizer_file)

    def no_hard_links(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_hard_links)
    dataset = imported(tokens, tmp_path / "data", tokenizer_file)
    linked = tmp_path / "data" / "train" / "00000.bin"
    assert linked.is_symlink() and linked.resolve() == tokens.resolve()
    train = dataset.splits["train"]
    assert np.array_equal(train.read(0, train.num_tokens), source_ids(tokens)[:train.num_tokens])


def test_several_files_each_give_a_shard_and_hold_out_their_last_documents(tmp_path, tokenizer_file):
    docs = encoded(tokenizer_file)
    folder = tmp_path / "dolma"
    folder.mkdir()
    parts = [write_dolma(folder / f"part-{k}.npy", docs[k * 60:(k + 1) * 60]) for k in range(2)]
    dataset = imported(folder, tmp_path / "data", tokenizer_file)
    for split, docs_per_file in (("train", 54), ("val", 6)):
        shards = dataset.manifest["splits"][split]["shards"]
        assert [s["index"] for s in shards] == [0, 1] and all(s["num_documents"] == docs_per_file for s in shards)
    val = dataset.splits["val"]
    tails = [source_ids(p)[-sum(len(d) for d in docs[k * 60 + 54:(k + 1) * 60]):] for k, p in enumerate(parts)]
    assert np.array_equal(val.read(0, val.num_tokens), np.concatenate(tails))


def test_a_rerun_finds_the_import_done_and_another_corpus_needs_a_new_out(tmp_path, tokenizer_file, capsys):
    from trinity_train import cli

    tokens = corpus("megatron", tmp_path, tokenizer_file)
    args = [str(a) for a in ("import-data", tokens, "--tokenizer", tokenizer_file, "--out", tmp_path / "data")]
    assert cli.main(args) == 0
    assert "2 hard links), none copied" in capsys.readouterr().out
    assert cli.main(args) == 0
    assert "already imported" in capsys.readouterr().out
    assert_one_line_error(*cli_in_process(capsys, *args, "--val-fraction", "0.2"), 2,
                          f"--out '{tmp_path / 'data'}' is a directory that is not empty")


def test_a_token_range_outside_its_file_is_a_damaged_manifest(tmp_path, tokenizer_file):
    dataset = imported(corpus("megatron", tmp_path, tokenizer_file), tmp_path / "data", tokenizer_file)
    manifest = json.loads(json.dumps(dataset.manifest))
    shard = manifest["splits"]["val"]["shards"][0]
    shard["token_range"] = [shard["token_range"][0] + 1, shard["token_range"][1] + 1]
    assert "token_range" in manifest_problem(manifest)


# ---------------------------------------------------------------------------- bad input: one line each


def import_error(capsys, tokens: Path, tokenizer_file: Path, out: Path, *extra) -> tuple[int, str]:
    capsys.readouterr()  # what datatrove logged while it wrote the corpus
    return cli_in_process(capsys, "import-data", tokens, "--tokenizer", tokenizer_file, "--out", out, *extra)


def test_an_unknown_format_is_one_line(tmp_path, tokenizer_file, capsys):
    tokens = corpus("dolma", tmp_path, tokenizer_file)
    assert_one_line_error(*import_error(capsys, tokens, tokenizer_file, tmp_path / "a", "--format", "arrow"), 2,
                          "--format must be one of auto, datatrove, megatron, dolma, got 'arrow'")
    other = tmp_path / "corpus.parquet"
    other.write_bytes(b"PAR1")
    assert_one_line_error(*import_error(capsys, other, tokenizer_file, tmp_path / "b"), 1,
                          f"input '{other}' is not a token file of a known format", "--format")
    assert_one_line_error(*import_error(capsys, tokens, tmp_path / "none.json", tmp_path / "c"), 1,
                          f"--tokenizer '{tmp_path / 'none.json'}' is not a file")
    assert not any((tmp_path / name).exists() for name in "abc")


@pytest.mark.parametrize("fmt, index", [("datatrove", ".ds.index"), ("megatron", ".idx"), ("dolma", ".csv.gz")])
def test_a_missing_index_is_one_line(tmp_path, tokenizer_file, capsys, fmt, index):
    tokens = corpus(fmt, tmp_path, tokenizer_file)
    (missing,) = [p for p in tokens.parent.iterdir() if p.name.endswith(index)]
    missing.unlink()
    assert_one_line_error(*import_error(capsys, tokens, tokenizer_file, tmp_path / "data"), 1,
                          f"has no index '{missing}'")


@pytest.mark.parametrize("fmt", ["datatrove", "megatron", "dolma"])
def test_an_index_that_does_not_fit_its_token_file_is_one_line(tmp_path, tokenizer_file, capsys, fmt):
    tokens = corpus(fmt, tmp_path, tokenizer_file)
    with open(tokens, "ab") as f:
        f.write(b"\x01\x00")  # one token the index does not know
    assert_one_line_error(*import_error(capsys, tokens, tokenizer_file, tmp_path / "data"), 1,
                          f"'{tokens}' holds {tokens.stat().st_size:,} bytes", "does not belong to this token file")


def test_a_dolma_file_read_with_the_wrong_dtype_is_one_line(tmp_path, tokenizer_file, capsys):
    tokens = corpus("dolma", tmp_path, tokenizer_file)
    assert_one_line_error(*import_error(capsys, tokens, tokenizer_file, tmp_path / "data", "--dtype", "uint32"), 1,
                          "or the dtype is another (--dtype)")


def test_ids_outside_the_vocabulary_are_one_line(tmp_path, tokenizer_file, capsys):
    docs = encoded(tokenizer_file)
    docs[5] = [1000, *docs[5]]  # another tokenizer's id
    folder = tmp_path / "megatron"
    folder.mkdir()
    tokens = write_megatron(folder / "corpus", docs)
    assert_one_line_error(*import_error(capsys, tokens, tokenizer_file, tmp_path / "data"), 1,
                          "holds token id 1000, outside the vocabulary of")


def test_mismatched_dtypes_are_one_line(tmp_path, tokenizer_file, capsys):
    folder = tmp_path / "megatron"
    folder.mkdir()
    floats = write_megatron(folder / "floats", encoded(tokenizer_file), dtype_code=7)
    assert_one_line_error(*import_error(capsys, floats, tokenizer_file, tmp_path / "a"), 1,
                          "stores float32 tokens")
    ds = corpus("datatrove", tmp_path, tokenizer_file)  # its .ds.metadata records 2-byte tokens
    assert_one_line_error(*import_error(capsys, ds, tokenizer_file, tmp_path / "b", "--dtype", "uint32"), 1,
                          "mismatched token dtypes", "uint16 and --dtype uint32")
    wide = write_megatron(folder / "wide", encoded(tokenizer_file), dtype_code=4)  # int32: Megatron's large-vocab ids
    capsys.readouterr()
    code, err = cli_in_process(capsys, "import-data", ds, wide, "--tokenizer", tokenizer_file, "--out", tmp_path / "c")
    assert_one_line_error(code, err, 1, "mismatched token dtypes", "uint16", "uint32")


def test_uint16_ids_of_a_vocabulary_they_cannot_number_are_one_line(tmp_path, tokenizer_file, capsys):
    from tokenizers import models

    large = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    large.add_special_tokens([EOS_TOKEN])
    large.save(str(tmp_path / "large.json"))
    folder = tmp_path / "megatron"
    folder.mkdir()
    tokens = write_megatron(folder / "narrow", encoded(tokenizer_file))  # uint16, as its .idx records
    assert_one_line_error(*import_error(capsys, tokens, tmp_path / "large.json", tmp_path / "data"), 1,
                          "hold uint16 ids but the tokenizer has 70,001 tokens")


def test_documents_without_eos_are_refused_in_one_line(tmp_path, tokenizer_file, capsys):
    folder = tmp_path / "megatron"
    folder.mkdir()
    # preprocess_data.py without --append-eod
    tokens = write_megatron(folder / "no_eod", encoded(tokenizer_file, eos=False))
    assert_one_line_error(*import_error(capsys, tokens, tokenizer_file, tmp_path / "data"), 1,
                          f"120 of the 120 documents of '{tokens}' do not end with the EOS token '{EOS_TOKEN}'",
                          "--append-eod")
    assert not (tmp_path / "data" / "manifest.json").exists()
