"""`prepare-data`: formats, tokenization, shard files, reuse after interruption, bad input."""

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from trinity_train.data.prepare import PrepareOptions, add_prepare_arguments, prepare, run_prepare
from trinity_train.data.prepare_steps import is_validation
from trinity_train.data.shards import PreparedDataset, ShardWriter, TokenSizedShards
from trinity_train.errors import ArgumentError, DataError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(5, 30))) + f" doc{i}" for i in range(n)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def options(inputs, out, **kw) -> PrepareOptions:
    kw.setdefault("train_tokenizer", 300)
    kw.setdefault("val_fraction", 0.2)  # held out by a hash per document: some of a dozen or two
    return PrepareOptions(inputs=[str(i) for i in inputs], out=str(out), progress=False, **kw)


def decoded_documents(out: Path, split: str) -> list[str]:
    """Every document of a split, read back from the shard files and decoded."""
    dataset = PreparedDataset.open(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokens = dataset.splits[split]
    starts = tokens.document_starts(0, tokens.num_tokens).tolist() + [tokens.num_tokens]
    docs = []
    for a, b in zip(starts, starts[1:]):
        ids = tokens.read(a, b - a)
        assert ids[-1] == dataset.eos_id  # every document ends with EOS
        docs.append(tokenizer.decode(ids[:-1].tolist()))
    return docs


def test_jsonl_to_shards_round_trips_every_document(tmp_path):
    texts = documents(60)
    out = prepare(options([write_jsonl(tmp_path / "a.jsonl", texts)], tmp_path / "out",
                          val_fraction=0.1, shard_tokens=300))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "<u2" and manifest["tokenizer"]["vocab_size"] <= 300
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    assert train["num_documents"] + val["num_documents"] == 60 and 2 <= val["num_documents"] <= 12
    assert len(train["shards"]) > 1 and all(s["num_tokens"] <= 300 for s in train["shards"])
    held_out = is_validation(texts, 0, 0.1)  # one seeded hash per document, nothing global
    assert val["num_documents"] == held_out.sum()
    for shard in train["shards"]:
        for name, info in shard["files"].items():
            assert (out / "train" / name).stat().st_size == info["bytes"] and len(info["sha256"]) == 64
    train_docs, val_docs = decoded_documents(out, "train"), decoded_documents(out, "val")
    assert sorted(train_docs + val_docs) == sorted(texts)
    assert train_docs == [t for t, out in zip(texts, held_out) if not out]  # input order kept
    assert val_docs == [t for t, out in zip(texts, held_out) if out]


def test_shards_are_cut_by_tokens_whatever_the_batching(tmp_path):
    lengths = np.array([3, 5, 2, 9, 4, 4, 1])
    tokens = np.arange(lengths.sum())
    cuts = []
    for batches in ([7], [1] * 7, [2, 5]):
        split_dir = tmp_path / f"b{len(batches)}"
        shards = TokenSizedShards(split_dir, 2, np.dtype("<u2"), "key", shard_tokens=8)
        start = 0
        for n in batches:
            shards.add(tokens[lengths[:start].sum():lengths[:start + n].sum()], lengths[start:start + n])
            start += n
        records = shards.finish()
        cuts.append([(r["index"], r["num_tokens"], r["num_documents"]) for r in records])
    # 3+5 | 2 | 9 (longer than a shard: alone) | 4+4 | 1; numbered from task 2's first shard
    assert cuts[0] == [(200000, 8, 2), (200001, 2, 1), (200002, 9, 1), (200003, 8, 2), (200004, 1, 1)]
    assert cuts[0] == cuts[1] == cuts[2]


@pytest.mark.parametrize("fmt", ["parquet", "csv", "txt", "json-array"])
def test_other_formats_give_the_same_documents(tmp_path, fmt):
    texts = documents(20)
    if fmt == "parquet":
        path = tmp_path / "a.parquet"
        pq.write_table(pa.table({"body": texts}), path)
    elif fmt == "csv":
        path = tmp_path / "a.csv"
        path.write_text("body,n\n" + "".join(f'"{t}",{i}\n' for i, t in enumerate(texts)))
    elif fmt == "txt":
        for i, t in enumerate(texts):
            (tmp_path / f"doc{i:02d}.txt").write_text(t)
        path = tmp_path / "doc*.txt"
    else:
        path = tmp_path / "a.json"
        path.write_text(json.dumps([{"body": t} for t in texts]))
    out = prepare(options([path], tmp_path / "out", text_field="body", val_fraction=0.1))
    assert sorted(decoded_documents(out, "train") + decoded_documents(out, "val")) == sorted(texts)


def test_directory_input_and_given_tokenizer(tmp_path):
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", documents(10, seed=1))
    write_jsonl(tmp_path / "in" / "b.jsonl", documents(10, seed=2))
    first = prepare(options([tmp_path / "in"], tmp_path / "one"))
    second = prepare(options([tmp_path / "in"], tmp_path / "two", train_tokenizer=0,
                             tokenizer=str(first / "tokenizer.json")))
    assert decoded_documents(first, "train") == decoded_documents(second, "train")
    assert len(decoded_documents(first, "train")) + len(decoded_documents(first, "val")) == 20


def test_rerun_reuses_finished_tasks_and_redoes_unfinished_ones(tmp_path):
    srcs = [write_jsonl(tmp_path / f"{i}.jsonl", documents(20, seed=i)) for i in range(3)]
    out = tmp_path / "out"
    prepare(options(srcs, out, tasks=3, workers=1))
    shards = sorted((out / "train").glob("*.bin"))
    before = {p: p.stat().st_mtime_ns for p in shards}
    manifest = (out / "manifest.json").read_text()
    again = options(srcs, out, tasks=3, workers=1)
    prepare(again)
    assert again.stats["reused"] and {p: p.stat().st_mtime_ns for p in shards} == before
    # An interruption: no manifest, task 2 never finished (no completion marker, a stray temp file),
    # and task 1's shard damaged after it finished.
    (out / "manifest.json").unlink()
    (completions,) = (out / ".prepare").glob("*/completions")
    (completions / "00002").unlink()
    (out / "train" / ".200000.bin.tmp-1").write_bytes(b"partial")
    (out / "train" / "100000.bin").write_bytes(b"torn")
    rerun = options(srcs, out, tasks=3, workers=1)
    prepare(rerun)
    assert rerun.stats["tasks_run"] == [1, 2]
    assert (out / "manifest.json").read_text() == manifest
    assert shards[0].stat().st_mtime_ns == before[shards[0]]
    assert shards[2].stat().st_mtime_ns != before[shards[2]]
    assert not list((out / "train").glob(".*tmp*"))


def test_a_failed_shard_leaves_nothing_that_looks_finished(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path, 0, np.dtype("<u2"), "key") as writer:
            writer.add(np.arange(10), np.array([4, 6]))
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_changed_input_into_the_same_out_needs_overwrite(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", documents(30))
    out = prepare(options([src], tmp_path / "out"))
    write_jsonl(src, documents(30, seed=5))
    with pytest.raises(ArgumentError, match="--overwrite"):  # an output that exists: a usage mistake
        prepare(options([src], out))
    prepare(options([src], out, overwrite=True))
    assert sorted(decoded_documents(out, "train") + decoded_documents(out, "val")) == sorted(documents(30, seed=5))


def test_uint32_tokens_when_the_vocabulary_needs_them(tmp_path):
    # A few tokens with ids far apart: the vocabulary size is the largest id + 1, not the count.
    vocab = {w: 1000 * i for i, w in enumerate(WORDS)} | {"<|endoftext|>": 70_000, "[UNK]": 70_001}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "big.json"))
    src = write_jsonl(tmp_path / "a.jsonl", documents(20))
    out = prepare(options([src], tmp_path / "out", train_tokenizer=0, tokenizer=str(tmp_path / "big.json")))
    dataset = PreparedDataset.open(out)
    assert dataset.dtype == np.dtype("<u4") and dataset.eos_id == 70_000
    stored = [i for split in dataset.splits.values() for i in split.read(0, split.num_tokens).tolist()]
    expected = [i for t in documents(20) for i in tokenizer.encode(t).ids + [70_000]]
    assert sorted(stored) == sorted(expected) and max(stored) > 65_535  # ids above uint16 intact
    with pytest.raises(DataError, match="does not fit in uint16"):
        prepare(options([src], tmp_path / "small", train_tokenizer=0, tokenizer=str(tmp_path / "big.json"),
                        dtype="uint16"))
    assert not (tmp_path / "small" / "manifest.json").exists()


# ---------------------------------------------------------------------------- bad input


def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare(options([tmp_path / "nope.jsonl"], tmp_path / "out"))
    with pytest.raises(DataError, match="matches no files"):
        prepare(options([tmp_path / "*.jsonl"], tmp_path / "out"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="is empty"):
        prepare(options([tmp_path / "empty.jsonl"], tmp_path / "out"))
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(DataError, match="no text"):
        prepare(options([tmp_path / "blank.txt"], tmp_path / "out", sample_by="line", val_fraction=0))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_malformed_json_line_names_file_and_line(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", documents(20))
    lines = src.read_text().splitlines(keepends=True)
    lines[6] = '{"text": "broken", \n'
    src.write_text("".join(lines))
    with pytest.raises(DataError, match=r"a\.jsonl:7: malformed JSON.*--skip-bad-records"):
        prepare(options([src], tmp_path / "out"))
    assert not (tmp_path / "out" / "manifest.json").exists()
    opts = options([src], tmp_path / "out", skip_bad_records=True)
    out = prepare(opts)
    assert opts.stats["bad_records"] == 1 and "a.jsonl:7" in opts.stats["bad_examples"][0]
    assert len(decoded_documents(out, "train")) + len(decoded_documents(out, "val")) == 19


def test_missing_text_field(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", documents(20), field="content")
    with pytest.raises(DataError, match="no string field 'text'.*content.*--text-field"):
        prepare(options([src], tmp_path / "out"))
    records = [{"text": t} for t in documents(20)]
    del records[3]["text"]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(DataError, match=r"b\.jsonl:4: no string field 'text'"):
        prepare(options([tmp_path / "b.jsonl"], tmp_path / "out"))
    opts = options([tmp_path / "b.jsonl"], tmp_path / "out", skip_bad_records=True)
    prepare(opts)
    assert opts.stats["bad_records"] == 1
    pq.write_table(pa.table({"body": documents(5)}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match="no field 'text'.*body"):
        prepare(options([tmp_path / "c.parquet"], tmp_path / "out2"))


def test_too_few_documents_for_a_validation_split(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", documents(1))
    with pytest.raises(DataError, match="too few to hold out"):
        prepare(options([src], tmp_path / "out"))


def test_command_line(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_prepare_arguments(parser)
    src = write_jsonl(tmp_path / "a.jsonl", documents(30))
    args = parser.parse_args(["--input", str(src), "--out", str(tmp_path / "out"), "--train-tokenizer", "300",
                              "--num-proc", "1", "--val-fraction", "0.2", "--no-progress"])
    assert run_prepare(args) == 0
    assert "tokens/s" in capsys.readouterr().out
    assert run_prepare(args) == 0 and "nothing to do" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a tokenizer choice is required
        parser.parse_args(["--input", str(src), "--out", str(tmp_path / "x")])


def test_worker_processes_write_the_same_shards(tmp_path):
    srcs = [write_jsonl(tmp_path / f"{i}.jsonl", documents(700, seed=i)) for i in range(3)]  # > an encode batch
    one = prepare(options(srcs, tmp_path / "one", tasks=2, workers=1))
    two = prepare(options(srcs, tmp_path / "two", tasks=2, workers=2))
    assert (one / "manifest.json").read_bytes() == (two / "manifest.json").read_bytes()
    for split in ("train", "val"):
        a, b = PreparedDataset.open(one).splits[split], PreparedDataset.open(two).splits[split]
        assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
    # Another task count is another token order (files go to tasks round-robin), so another build;
    # the same documents are held out.
    three = prepare(options(srcs, tmp_path / "three", tasks=3, workers=1))
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (one, three)]
    assert manifests[0]["build_key"] != manifests[1]["build_key"]
    assert sorted(decoded_documents(one, "val")) == sorted(decoded_documents(three, "val"))


def test_bad_input_through_the_cli_is_one_line_and_exit_1(tmp_path, capsys):
    from trinity_train.cli import main

    src = write_jsonl(tmp_path / "a.jsonl", documents(10))
    src.write_text(src.read_text() + "{oops\n")
    for bad_input, says in ((tmp_path / "missing.jsonl", "does not exist"), (src, "a.jsonl:11: malformed JSON")):
        rc = main(["prepare-data", "--input", str(bad_input), "--out", str(tmp_path / "out"),
                   "--train-tokenizer", "300", "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and len(err) == 1 and err[0].startswith("error: ") and says in err[0]
        assert not (tmp_path / "out").exists()  # refused: no directory, lock or pipeline state left


def tree(root: Path) -> dict | None:
    """Every path under `root` with a file's bytes (None for a directory); None when `root` is absent."""
    if not root.exists():
        return None
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in root.rglob("*")}


def test_a_refused_run_leaves_its_out_as_found(tmp_path):
    few = write_jsonl(tmp_path / "few.jsonl", documents(1))  # too few to hold any out
    good = write_jsonl(tmp_path / "a.jsonl", documents(20))
    bad = write_jsonl(tmp_path / "b.jsonl", documents(20, seed=1))
    bad.write_text(bad.read_text() + "{oops\n")
    no_eos = tmp_path / "no_eos.json"
    Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)} | {"[UNK]": 99}, unk_token="[UNK]")).save(
        str(no_eos))
    # Found at the end (after the tasks wrote their shards), by the second of two tasks (after the
    # first finished), before anything is written; the tokenizer trained on the good file alone.
    refusals = [(options([few], None), DataError, "too few to hold out"),
                (options([good, bad], None, tasks=2, workers=1, tokenizer_sample_bytes=1), DataError,
                 r"b\.jsonl:21: malformed JSON"),
                (options([good], None, train_tokenizer=0, tokenizer=str(no_eos)), DataError, "end-of-document")]
    existing = tmp_path / "existing"
    (existing / "notes").mkdir(parents=True)
    (existing / "notes" / "a.txt").write_text("mine")
    (existing / "b.txt").write_text("mine too")
    for opts, error, message in refusals:
        for out in (tmp_path / "absent" / "out", existing):
            found = tree(out)
            opts.out = str(out)
            with pytest.raises(error, match=message):
                prepare(opts)
            assert tree(out) == found and (out.exists() or not out.parent.exists())
    # A different dataset there, without --overwrite: refused before the lock is taken.
    prepared = prepare(options([good], tmp_path / "prepared"))
    found = tree(prepared)
    with pytest.raises(ArgumentError, match="--overwrite"):
        prepare(options([good], prepared, seed=1))
    assert tree(prepared) == found


def test_a_refusal_keeps_what_an_earlier_run_left(tmp_path, monkeypatch):
    from trinity_train.data.prepare_steps import TokenizeToShards

    srcs = [write_jsonl(tmp_path / f"{i}.jsonl", documents(1, seed=i)) for i in range(2)]  # none held out
    out = tmp_path / "out"
    run = TokenizeToShards.run

    def interrupted(self, data=None, rank=0, world_size=1):
        if rank == 1:
            raise KeyboardInterrupt  # not a refusal: what the run wrote stays for its rerun
        yield from run(self, data, rank, world_size)

    monkeypatch.setattr(TokenizeToShards, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(options(srcs, out, tasks=2, workers=1, val_fraction=0.01))
    monkeypatch.setattr(TokenizeToShards, "run", run)
    left = tree(out)
    assert any(name.endswith("completions/00000") for name in left)
    with pytest.raises(DataError, match="too few to hold out"):
        prepare(options(srcs, out, tasks=2, workers=1, val_fraction=0.01))
    after = tree(out)  # task 1's shards, record and marker gone; task 0's and the tokenizer as they were
    assert after.keys() == left.keys()
    assert {k: v for k, v in after.items() if "/logs/" not in k} == {k: v for k, v in left.items() if "/logs/" not in k}
