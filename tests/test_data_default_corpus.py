"""The embedded default corpus: which files, where it is cached, one build under concurrency."""

import multiprocessing as mp
import time
from pathlib import Path

from trinity_train.config import DataConfig, load_config
from trinity_train.data import build_loaders, default_corpus
from trinity_train.data.shards import PreparedDataset


def fake_stdlib(root: Path, num_modules: int = 40) -> Path:
    """A small stand-in for the standard library, with the directories that must be left out."""
    for i in range(num_modules):
        pkg = root / f"pkg{i % 4}"
        pkg.mkdir(parents=True, exist_ok=True)
        body = "\n".join(f"def function_{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(12))
        (pkg / f"module{i}.py").write_text(f'"""Module {i}."""\n\n{body}')
    (root / "pkg0" / "__init__.py").write_text("")  # empty: not a document
    for excluded in ("site-packages/thirdparty", "dist-packages/other"):
        (root / excluded).mkdir(parents=True)
        (root / excluded / "big.py").write_text("x = 1\n" * 100)
    (root / "notes.txt").write_text("not python")
    return root


def data_config(tmp_path: Path) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path / "cache"), vocab_size=400, val_fraction=0.1)


def test_corpus_is_the_sorted_nonempty_python_files_outside_site_packages(tmp_path):
    root = fake_stdlib(tmp_path / "lib")
    files = default_corpus.corpus_files(root)
    assert len(files) == 40 and files == sorted(files)
    assert all(f.suffix == ".py" and f.stat().st_size > 0 for f in files)
    assert not any("site-packages" in f.parts or "dist-packages" in f.parts for f in files)


def test_built_once_then_reused_and_keyed_by_its_inputs(tmp_path, monkeypatch):
    root = fake_stdlib(tmp_path / "lib")
    cfg = data_config(tmp_path)
    path = default_corpus.default_dataset(cfg, root=root, progress=False)
    dataset = PreparedDataset.open(path)
    train, val = dataset.splits["train"].num_documents, dataset.splits["val"].num_documents
    assert train + val == 40 and 1 <= val <= 10  # each file held out with probability 0.1
    assert dataset.vocab_size <= 400

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached corpus was rebuilt")

    monkeypatch.setattr(default_corpus, "prepare", no_rebuild)
    assert default_corpus.default_dataset(cfg, root=root) == path
    other_vocab = DataConfig(cache_dir=cfg.cache_dir, vocab_size=300, val_fraction=0.1)
    assert default_corpus.corpus_dir(other_vocab, root, default_corpus.corpus_files(root)) != path
    (root / "pkg1" / "new.py").write_text("y = 2\n")
    assert default_corpus.corpus_dir(cfg, root, default_corpus.corpus_files(root)) != path


def _build_in_child(cfg: DataConfig, root: Path, builds, results) -> None:
    real_prepare = default_corpus.prepare

    def counted_prepare(opts):
        time.sleep(0.5)  # let every process get past the "already built?" check first
        out = real_prepare(opts)
        if not opts.stats["reused"]:
            with builds.get_lock():
                builds.value += 1
        return out

    default_corpus.prepare = counted_prepare
    results.put(str(default_corpus.default_dataset(cfg, root=root, progress=False)))


def test_concurrent_first_runs_build_once(tmp_path):
    root = fake_stdlib(tmp_path / "lib")
    cfg = data_config(tmp_path)
    ctx = mp.get_context("fork")
    builds, results = ctx.Value("i", 0), ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(cfg, root, builds, results)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs)
    paths = {results.get(timeout=5) for _ in procs}
    assert builds.value == 1 and len(paths) == 1
    PreparedDataset.open(paths.pop())  # complete and matching its checksums


def test_build_loaders_uses_the_default_corpus_when_no_path_is_given(tmp_path, monkeypatch):
    root = fake_stdlib(tmp_path / "lib")
    monkeypatch.setattr(default_corpus, "stdlib_root", lambda: root)
    cfg = load_config(None, {"data": {"cache_dir": str(tmp_path / "cache"), "vocab_size": 400,
                                      "val_fraction": 0.1, "seq_len": 32},
                             "train": {"micro_batch_size": 2}, "run": {"dir": str(tmp_path / "run")}})
    train, val = build_loaders(cfg)
    assert train.next_batch().input_ids.shape == (2, 32)
    assert len(list(val.batches(1))) == 1
    assert any(p.name.startswith("stdlib-py") for p in (tmp_path / "cache").iterdir())


def test_an_interrupted_build_is_finished_by_the_next_run(tmp_path):
    root = fake_stdlib(tmp_path / "lib")
    cfg = data_config(tmp_path)
    path = default_corpus.default_dataset(cfg, root=root, progress=False)
    (path / "manifest.json").unlink()
    assert default_corpus.default_dataset(cfg, root=root, progress=False) == path
    PreparedDataset.open(path)
