"""The train and validation loaders: determinism, DP slicing, resume, skips, mixing, boundaries."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trinity_train.config import load_config
from trinity_train.data import DataError, SkipLedger, build_loaders
from trinity_train.data.shards import (ShardWriter, new_manifest, split_summary, token_dtype_for,
                                       write_manifest)

SEQ = 16


def make_dataset(path: Path, train_docs: list[np.ndarray], val_docs: list[np.ndarray],
                 shard_documents: int = 7, vocab_size: int = 65536) -> Path:
    """A prepared dataset written straight through the shard format (no tokenizer needed)."""
    dtype = token_dtype_for(vocab_size)
    splits = {}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        records = []
        for index, start in enumerate(range(0, len(docs), shard_documents)):
            chunk = docs[start:start + shard_documents]
            with ShardWriter(path / split, index, dtype, "test") as writer:
                writer.add(np.concatenate(chunk), np.array([len(d) for d in chunk]))
                records.append(writer.finish())
        splits[split] = split_summary(records)
    write_manifest(path, new_manifest("test", {"vocab_size": vocab_size, "eos_id": 0}, dtype, splits))
    return path


def counting_docs(start: int, lengths: list[int]) -> list[np.ndarray]:
    """Documents whose tokens are consecutive integers, so a token names its global position."""
    docs, pos = [], start
    for n in lengths:
        docs.append(np.arange(pos, pos + n))
        pos += n
    return docs


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 40, size=120).tolist()  # ~2.5k tokens, ~150 sequences of 16
    return make_dataset(tmp_path_factory.mktemp("ds"), counting_docs(1, lengths),
                        counting_docs(50_000, [SEQ * 3 + 1] * 6))


def config(path, tmp_path, mbs=8, accum=1, **data):
    if path is not None:
        data["path"] = str(path)
    overrides = {"data": {"seq_len": SEQ, **data},
                 "model": {"vocab_size": 65536},
                 "train": {"micro_batch_size": mbs, "grad_accum": accum},
                 "run": {"dir": str(tmp_path / "run")}}
    return load_config(None, overrides)


def take(loader, n):
    return [loader.next_batch() for _ in range(n)]


def global_rows(batches_per_rank):
    """Concatenate the ranks' slices of each global batch."""
    return [torch.cat([b.input_ids for b in per_rank]) for per_rank in zip(*batches_per_rank)]


def test_same_seed_same_batches_other_seed_other_order(dataset, tmp_path):
    a, _ = build_loaders(config(dataset, tmp_path))
    b, _ = build_loaders(config(dataset, tmp_path))
    c, _ = build_loaders(config(dataset, tmp_path, seed=99))
    for x, y, z in zip(take(a, 5), take(b, 5), take(c, 5)):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.position_ids, y.position_ids)
    assert not torch.equal(torch.stack([x.input_ids for x in take(a, 3)]),
                           torch.stack([z.input_ids for z in take(c, 3)]))


def test_rows_are_shifted_windows_of_the_token_stream(dataset, tmp_path):
    train, _ = build_loaders(config(dataset, tmp_path))
    batch = train.next_batch()
    assert batch.input_ids.shape == (8, SEQ) and batch.input_ids.dtype == torch.int64
    assert torch.equal(batch.labels[:, :-1], batch.input_ids[:, 1:])
    # Tokens count up from 1 across the whole split: a row is one contiguous window.
    assert torch.all(batch.input_ids[:, 1:] - batch.input_ids[:, :-1] == 1)
    assert torch.all((batch.input_ids[:, 0] - 1) % SEQ == 0)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_rank_slices_partition_the_global_batch(dataset, tmp_path, dp_size):
    reference, _ = build_loaders(config(dataset, tmp_path, mbs=8))
    loaders = [build_loaders(config(dataset, tmp_path, mbs=8 // dp_size), r, dp_size)[0]
               for r in range(dp_size)]
    expected = [b.input_ids for b in take(reference, 4)]
    got = global_rows([take(loader, 4) for loader in loaders])
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
        assert len(set(g[:, 0].tolist())) == len(g)  # no row twice


def test_each_sequence_once_per_epoch(dataset, tmp_path):
    train, _ = build_loaders(config(dataset, tmp_path, mbs=2))
    n = train._mixed.readers[0].num_sequences
    firsts = torch.cat([b.input_ids[:, 0] for b in take(train, (n + 1) // 2)]).tolist()[:n]
    assert sorted(firsts) == [1 + SEQ * j for j in range(n)]


def test_resume_at_k_equals_never_stopping(dataset, tmp_path):
    straight, _ = build_loaders(config(dataset, tmp_path))
    expected = take(straight, 7)
    first, _ = build_loaders(config(dataset, tmp_path))
    take(first, 3)
    state = first.state_dict()
    resumed, _ = build_loaders(config(dataset, tmp_path))
    resumed.load_state_dict(state)
    assert resumed.position == 3
    for e, g in zip(expected[3:], take(resumed, 4)):
        assert torch.equal(e.input_ids, g.input_ids) and e.index == g.index


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_loader_state_round_trips_through_a_dcp_checkpoint(dataset, tmp_path):
    import torch.distributed.checkpoint as dcp

    first, _ = build_loaders(config(dataset, tmp_path))
    take(first, 3)
    dcp.save({"loader": first}, checkpoint_id=str(tmp_path / "ckpt"))
    expected = take(first, 2)
    resumed, _ = build_loaders(config(dataset, tmp_path))
    dcp.load({"loader": resumed}, checkpoint_id=str(tmp_path / "ckpt"))
    assert resumed.position == 3
    assert all(torch.equal(e.input_ids, g.input_ids) for e, g in zip(expected, take(resumed, 2)))


def test_resume_with_other_dp_size_keeps_global_order(dataset, tmp_path):
    reference, _ = build_loaders(config(dataset, tmp_path, mbs=8))
    expected = [b.input_ids for b in take(reference, 6)]
    two = [build_loaders(config(dataset, tmp_path, mbs=4), r, 2)[0] for r in range(2)]
    before = global_rows([take(loader, 2) for loader in two])
    four = [build_loaders(config(dataset, tmp_path, mbs=2), r, 4)[0] for r in range(4)]
    for loader in four:
        loader.load_state_dict(two[0].state_dict())
    after = global_rows([take(loader, 4) for loader in four])
    for e, g in zip(expected, before + after):
        assert torch.equal(e, g)


def test_resume_with_other_global_batch_size_continues_the_sample_stream(dataset, tmp_path):
    reference, _ = build_loaders(config(dataset, tmp_path, mbs=4))
    expected = torch.cat([b.input_ids for b in take(reference, 8)])
    small, _ = build_loaders(config(dataset, tmp_path, mbs=4))
    seen = [b.input_ids for b in take(small, 2)]
    large = [build_loaders(config(dataset, tmp_path, mbs=4), r, 2)[0] for r in range(2)]
    for loader in large:
        loader.load_state_dict(small.state_dict())
    seen += global_rows([take(loader, 3) for loader in large])
    assert torch.equal(torch.cat(seen), expected)
    assert large[0].position == 5


def test_skip_ranges_and_ledger_are_never_trained_on(dataset, tmp_path):
    ledger = SkipLedger.load(tmp_path / "ledger.json")
    ledger.add(6, 8, "loss spike")
    train, _ = build_loaders(config(dataset, tmp_path, skip_ranges=[[2, 4]]), ledger=ledger)
    plain, _ = build_loaders(config(dataset, tmp_path))
    batches = take(train, 6)
    assert [b.index for b in batches] == [0, 1, 4, 5, 8, 9]
    for b in batches:
        assert torch.equal(b.input_ids, plain.batch_at(b.index).input_ids)
    ledger.add(11, 13, "added while training")  # the stability code adds ranges live
    assert train.next_batch().index == 10 and train.next_batch().index == 13


def test_ledger_file_in_run_dir_is_honoured_by_default(dataset, tmp_path):
    ledger = SkipLedger.load(tmp_path / "run" / "skip_ledger.json")
    ledger.add(0, 2, "spike")
    ledger.save()
    train, _ = build_loaders(config(dataset, tmp_path))
    assert train.next_batch().index == 2


def test_skip_is_constant_time_and_moves_the_position(dataset, tmp_path):
    train, _ = build_loaders(config(dataset, tmp_path))
    train.skip(10**12)  # far beyond the data: later epochs, same cost
    batch = train.next_batch()
    assert batch.index == 10**12 and train.position == 10**12 + 1
    again, _ = build_loaders(config(dataset, tmp_path))
    assert torch.equal(again.batch_at(10**12).input_ids, batch.input_ids)


def test_position_ids_restart_at_documents_with_doc_masking(tmp_path):
    path = make_dataset(tmp_path / "ds", counting_docs(1, [5, 20, 3, 40, 8, 30, 60]),
                        counting_docs(1000, [SEQ * 3]), shard_documents=3)  # rows cross shard edges
    starts = np.cumsum([1, 5, 20, 3, 40, 8, 30, 60])[:-1]  # token value at each document start
    for masking in (True, False):
        cfg = config(path, tmp_path, mbs=2)
        cfg.eval.every = 0  # the validation split is a single sequence
        cfg.model.doc_masking = masking
        train, _ = build_loaders(cfg)
        for batch in take(train, 4):
            for tokens, pos, doc in zip(batch.input_ids.tolist(), batch.position_ids.tolist(),
                                        batch.document_ids.tolist()):
                begun = [int(np.searchsorted(starts, t, side="right")) - 1 for t in tokens]
                assert doc == [b - begun[0] for b in begun]
                row_starts = [max(starts[b], tokens[0]) for b in begun]  # the first document: from the row
                expected = [t - s for t, s in zip(tokens, row_starts)] if masking else list(range(SEQ))
                assert pos == expected


def test_mixing_follows_weights_and_phases(tmp_path):
    a = make_dataset(tmp_path / "a", counting_docs(1, [50] * 40), counting_docs(9000, [SEQ * 9]))
    b = make_dataset(tmp_path / "b", counting_docs(30_000, [50] * 40), counting_docs(40_000, [SEQ * 9]))
    mix = [{"path": str(a), "weight": 3.0}, {"path": str(b), "weight": 1.0}]
    switch_batch = 1024  # 1024 batches of 4 = one whole mixing block
    phases = [{"start_tokens": switch_batch * 4 * SEQ, "weights": [0.0, 1.0]}]
    train, val = build_loaders(config(None, tmp_path, mbs=4, mix=mix, phases=phases))
    firsts = torch.cat([train.next_batch().input_ids[:, 0] for _ in range(switch_batch + 10)])
    from_a = firsts < 30_000
    assert int(from_a[:switch_batch * 4].sum()) == 3 * 1024  # exactly 3:1 over a block
    assert not from_a[switch_batch * 4:].any()  # the second phase takes only b
    val_tokens = torch.cat([v.input_ids for v in val.batches(2)])
    assert torch.all(((val_tokens >= 9000) & (val_tokens < 30_000)) | (val_tokens >= 40_000))


def test_validation_batches_are_fixed_and_sliced_by_rank(dataset, tmp_path):
    _, val = build_loaders(config(dataset, tmp_path, mbs=4))
    first = [b.input_ids for b in val.batches(2)]
    again = [b.input_ids for b in val.batches(2)]
    assert len(first) == 2 and all(torch.equal(x, y) for x, y in zip(first, again))
    halves = [build_loaders(config(dataset, tmp_path, mbs=2), r, 2)[1] for r in range(2)]
    assert torch.equal(torch.cat([next(iter(h.batches(1))).input_ids for h in halves]), first[0])
    assert len(list(val.batches(100))) == 4  # 18 validation sequences fill 4 batches of 4


def test_state_from_other_data_or_seed_is_rejected(dataset, tmp_path):
    train, _ = build_loaders(config(dataset, tmp_path))
    state = train.state_dict()
    other, _ = build_loaders(config(dataset, tmp_path, seq_len=8))
    with pytest.raises(DataError, match="other data"):
        other.load_state_dict(state)
    reseeded, _ = build_loaders(config(dataset, tmp_path, seed=7))
    with pytest.raises(DataError, match="data.seed"):
        reseeded.load_state_dict(state)


def test_data_too_small_for_one_global_batch(dataset, tmp_path):
    with pytest.raises(DataError, match="fewer than one global batch"):
        build_loaders(config(dataset, tmp_path, mbs=128, accum=2))
    with pytest.raises(DataError, match="validation"):
        build_loaders(config(dataset, tmp_path, mbs=32))  # ~150 train sequences but 18 validation


def test_vocabulary_larger_than_the_model_is_rejected(tmp_path):
    path = make_dataset(tmp_path / "ds", counting_docs(1, [400]), counting_docs(1, [100]), vocab_size=70_000)
    with pytest.raises(DataError, match="model.vocab_size"):
        build_loaders(config(path, tmp_path, mbs=1))


def test_mixing_datasets_of_different_tokenizers_is_rejected(tmp_path):
    paths = []
    for name in ("a", "b"):
        path = make_dataset(tmp_path / name, counting_docs(1, [400]), counting_docs(1, [100]))
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["tokenizer"]["sha256"] = name * 64
        write_manifest(path, manifest)
        paths.append({"path": str(path), "weight": 1.0})
    with pytest.raises(DataError, match="different tokenizers"):
        build_loaders(config(None, tmp_path, mbs=1, mix=paths))


def test_damaged_or_incomplete_dataset_is_rejected(dataset, tmp_path):
    incomplete = make_dataset(tmp_path / "ds", counting_docs(1, [400]), counting_docs(1, [100]))
    (incomplete / "manifest.json").unlink()
    with pytest.raises(DataError, match="not a complete prepared dataset"):
        build_loaders(config(incomplete, tmp_path, mbs=1))
    with pytest.raises(DataError, match="does not exist"):
        build_loaders(config(tmp_path / "nowhere", tmp_path, mbs=1))
    damaged = make_dataset(tmp_path / "ds2", counting_docs(1, [400]), counting_docs(1, [100]))
    shard = damaged / "train" / "00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="checksum"):
        build_loaders(config(damaged, tmp_path, mbs=1))
    build_loaders(config(damaged, tmp_path, mbs=1, verify_checksums=False))  # sizes still match
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match="bytes but the manifest says"):
        build_loaders(config(damaged, tmp_path, mbs=1, verify_checksums=False))


def test_a_checkpoint_in_the_removed_materialised_order_is_refused_in_one_line(dataset, tmp_path):
    # Order 1 (a materialised permutation) was every run's before order 2 and is no longer read:
    # its state (version 1, or no version at all) is refused with what to do, not read in order 2.
    loader, _ = build_loaders(config(dataset, tmp_path))
    assert loader.state_dict()["version"] == 2
    for state in ({**loader.state_dict(), "version": 1},
                  {k: v for k, v in loader.state_dict().items() if k != "version"}):
        with pytest.raises(DataError, match=r"sample order 1, which this version no longer reads .*checkpoint.init_from"):
            build_loaders(config(dataset, tmp_path))[0].load_state_dict(state)


def test_stamped_verification_hashes_each_shard_once_shared_among_the_ranks(tmp_path, monkeypatch):
    from trinity_train.data import shards

    path = make_dataset(tmp_path / "ds", counting_docs(1, [30] * 40), counting_docs(1, [40] * 3), shard_documents=4)
    hashed = []
    real = shards.sha256_and_largest_id
    monkeypatch.setattr(shards, "sha256_and_largest_id", lambda p, dtype: hashed.append(p) or real(p, dtype))
    cache = tmp_path / "cache"
    for rank in range(3):
        build_loaders(config(path, tmp_path, mbs=1, cache_dir=str(cache)), dp_rank=rank, dp_size=3)
    assert len(hashed) == len(set(hashed)) == 10 + 1  # every shard once, by one of the three ranks
    hashed.clear()
    build_loaders(config(path, tmp_path, mbs=1, cache_dir=str(cache)), dp_rank=1, dp_size=3)
    assert hashed == []  # stamped: nothing hashed again
    shard = path / "train" / "00004.bin"  # rank 1 of 3's: shard number 4
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="00004.bin' does not match its manifest checksum"):
        build_loaders(config(path, tmp_path, mbs=1, cache_dir=str(cache)), dp_rank=1, dp_size=3)
    build_loaders(config(path, tmp_path, mbs=1, cache_dir=str(cache), verify_checksums="sizes"), dp_rank=1, dp_size=3)


def test_a_split_keeps_a_bounded_number_of_shard_files_open(dataset, tmp_path):
    train, _ = build_loaders(config(dataset, tmp_path))
    split = train.split(0)
    split._tokens.limit = split._offsets.limit = 2
    whole = np.concatenate([split.read(start, 50) for start in range(0, split.num_tokens - 50, 50)])
    assert np.array_equal(whole, np.arange(1, len(whole) + 1))  # the counting tokens, across every shard
    split.document_starts(0, split.num_tokens)
    assert len(split._tokens._maps) == 2 and len(split._offsets._maps) == 2
