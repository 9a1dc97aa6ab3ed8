"""Bad inputs found by a fault-injection pass, each through the command line: one `error:` line
that says what, where and what to do, a non-zero exit, and nothing half-written (no run
directory when the data is bad, no `.tmp` after a full disk, no output directory after a failed
prepare-data)."""

import errno
import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from conftest import assert_one_line_error, cli_in_process, run_cli, run_config
from trinity_train.config import save_config
from trinity_train.rundir import RunDir


@pytest.fixture
def dataset(corpus, tmp_path):
    """A copy of the prepared corpus to damage."""
    copy = tmp_path / "data"
    shutil.copytree(corpus, copy)
    return copy


def config_file(corpus, tmp_path, run_dir, **sections):
    cfg = run_config(corpus, run_dir, train={"steps": 2, "micro_batch_size": 2}, eval={"every": 0},
                     checkpoint={"every": 2}, **sections)
    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}.toml"
    save_config(cfg, path)
    return path


def edit_manifest(dataset, change):
    path = dataset / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps(change(manifest)))


def train_on(dataset, capsys, tmp_path, **sections):
    run_dir = tmp_path / "run"
    code, err = cli_in_process(capsys, "train", "--config", config_file(dataset, tmp_path, run_dir, **sections))
    return code, err, run_dir


def without_tokenizer(manifest):
    del manifest["tokenizer"]
    return manifest


def claiming_more_tokens(manifest):
    for shard in manifest["splits"]["train"]["shards"]:
        shard["num_tokens"] *= 3
    manifest["splits"]["train"]["num_tokens"] *= 3
    return manifest


@pytest.mark.parametrize("change, fragments", [
    (lambda m: [1, 2], ["manifest.json' must hold a JSON object, not a list", "prepare the dataset again"]),
    (lambda m: {**m, "version": 99}, ["manifest.json' is not a trinity-train-tokens v1 manifest",
                                      "prepare the dataset again"]),
    (without_tokenizer, ["manifest.json' is damaged: it has no 'tokenizer' object", "prepare the dataset again"]),
    (claiming_more_tokens, ["damaged: shard 0 of split 'train' claims", "tokens but its 00000.bin holds"]),
])
def test_a_damaged_manifest_is_refused_before_the_run_directory_exists(dataset, capsys, tmp_path, change, fragments):
    edit_manifest(dataset, change)
    code, err, run_dir = train_on(dataset, capsys, tmp_path)
    assert_one_line_error(code, err, 1, *fragments)
    assert not run_dir.exists()


def put_token_id(dataset, token_id):
    """Write an out-of-range id into the training shard, with a manifest checksum to match."""
    tokens = dataset / "train" / "00000.bin"
    ids = np.fromfile(tokens, dtype="<u2")
    ids[::7] = token_id  # dense enough to be in the first batch, whatever the corpus's order
    ids.tofile(tokens)
    digest = hashlib.sha256(tokens.read_bytes()).hexdigest()

    def record(manifest):
        manifest["splits"]["train"]["shards"][0]["files"]["00000.bin"]["sha256"] = digest
        return manifest

    edit_manifest(dataset, record)


def test_token_ids_outside_the_vocabulary_are_refused_before_training(dataset, capsys, tmp_path):
    put_token_id(dataset, 400)  # the tokenizer has 300 ids, the model 320: the embedding would fail
    code, err, run_dir = train_on(dataset, capsys, tmp_path)
    assert_one_line_error(code, err, 1, "holds token id 400, outside its tokenizer's vocabulary of 300")
    assert not run_dir.exists()


def test_the_largest_id_is_recorded_by_prepare_data_or_read_once_and_cached(dataset, capsys, tmp_path):
    from trinity_train.data.shards import PreparedDataset

    assert all(s["max_token_id"] < 300 for s in json.loads((dataset / "manifest.json").read_text())
               ["splits"]["train"]["shards"])

    def forget_the_record(manifest):
        for split in manifest["splits"].values():
            for shard in split["shards"]:
                del shard["max_token_id"]
        return manifest

    edit_manifest(dataset, forget_the_record)
    put_token_id(dataset, 350)
    cache = tmp_path / "cache"
    ds = PreparedDataset.open(dataset, verify_checksums=False, cache_dir=cache)
    assert ds.max_token_id == 350 and len(list((cache / "token-ranges").glob("*.json"))) == 1
    code, err, _ = train_on(dataset, capsys, tmp_path, data={"verify_checksums": False, "cache_dir": str(cache)})
    assert_one_line_error(code, err, 1, "holds token id 350")


def test_a_manifest_that_under_reports_its_largest_id_fails_at_the_batch(dataset, capsys, tmp_path):
    put_token_id(dataset, 310)  # the manifest still records ids below 300; checksums are off
    code, err, run_dir = train_on(dataset, capsys, tmp_path, data={"verify_checksums": False},
                                  model={"vocab_size": 300})
    assert_one_line_error(code, err, 1, "training batch 0 holds token id 310", "vocabulary of 300",
                          "prepare the dataset again")
    # What the failure table (docs/reference/failures.md) says the run directory holds: a start that failed, no metrics.
    run = RunDir(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "config.toml", "events.jsonl",
                                                         "metrics.columns.arrow", "metrics.jsonl", "timeline.jsonl"]
    assert run.read_metrics() == [] and [e["event"] for e in run.read_events()] == ["run_start", "rank_hosts"]


def deny_writes_under(monkeypatch, root):
    """As a read-only mount would (root bypasses permission bits, not a read-only file system)."""
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
        False if mode & os.W_OK and str(path).startswith(str(root)) else access(path, mode, **kw)))


def test_a_read_only_run_directory_is_refused_fresh_and_on_resume(corpus, capsys, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    config = config_file(corpus, tmp_path, run_dir)
    assert cli_in_process(capsys, "train", "--config", config)[0] == 0
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    deny_writes_under(monkeypatch, run_dir)
    code, err = cli_in_process(capsys, "train", "--config", config, "--checkpoint.resume=auto", "--train.steps=4")
    assert_one_line_error(code, err, 2, f"run.dir: '{run_dir}' cannot be written", "choose another --run.dir")
    code, err = cli_in_process(capsys, "train", "--config", config, f"--run.dir={run_dir / 'fresh'}")
    assert_one_line_error(code, err, 2, f"run.dir: '{run_dir}' cannot be written")
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_a_run_dir_that_is_a_file_is_refused(corpus, capsys, tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    config = config_file(corpus, tmp_path, tmp_path / "afile")
    assert_one_line_error(*cli_in_process(capsys, "train", "--config", config), 2, "run.dir:", "afile' is a file, not a directory")
    code, err = cli_in_process(capsys, "train", "--config", config, f"--run.dir={tmp_path / 'afile' / 'run'}")
    assert_one_line_error(code, err, 2, "cannot be created:", "afile' is a file")


def test_a_full_disk_during_a_checkpoint_names_the_disk_and_leaves_no_tmp(corpus, capsys, tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystem

    def no_space(self, path, mode):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(FileSystem, "create_stream", no_space)
    run_dir = tmp_path / "run"
    # The run's only save is its final one: its failure fails the run (an earlier one would be a
    # warning and training would go on: tests/test_failed_save.py).
    code, err = cli_in_process(capsys, "train", "--config", config_file(corpus, tmp_path, run_dir))
    assert_one_line_error(code, err, 1, "step_00000002", "could not be written: no space left on the disk holding",
                          "the final checkpoint (step 2) was not written: this run has no checkpoint",
                          "--checkpoint.resume=auto")
    assert list(RunDir(run_dir).checkpoints.iterdir()) == []


def test_a_full_disk_under_the_metrics_is_one_line(corpus, capsys, tmp_path, monkeypatch):
    from trinity_train.observe import jsonl

    def no_space(self, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(jsonl.JsonlWriter, "write", no_space)
    code, err = cli_in_process(capsys, "train", "--config", config_file(corpus, tmp_path, tmp_path / "run"))
    assert_one_line_error(code, err, 1, "could not write", "events.jsonl': no space left on the disk holding")


@pytest.mark.slow  # a run, then two console-script resumes
def test_a_corrupt_dcp_metadata_is_one_line(corpus, capsys, tmp_path):
    run_dir = tmp_path / "run"
    config = config_file(corpus, tmp_path, run_dir)
    assert cli_in_process(capsys, "train", "--config", config)[0] == 0
    ckpt = RunDir(run_dir).checkpoints / "step_00000002"
    (ckpt / ".metadata").write_bytes(b"\x80\x04garbage")
    # Through the console script: DCP's own logging of the failure would show there too.
    done = run_cli("train", "--config", config, f"--checkpoint.resume={ckpt}", "--train.steps=4", timeout=300)
    assert_one_line_error(done.returncode, done.stderr, 1, f"checkpoint '{ckpt}'", ".metadata")
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "format_version": 3}))  # a pre-release checkpoint
    code, err = cli_in_process(capsys, "ckpt", "verify", ckpt)
    assert_one_line_error(code, err, 1, f"checkpoint '{ckpt}' has format version 3, this trinity-train reads versions 4")


def prepare(capsys, tmp_path, *args):
    return cli_in_process(capsys, "prepare-data", "--out", tmp_path / "out", "--no-progress", "--num-proc", 1, *args)


def test_prepare_data_on_a_numeric_text_and_a_torn_last_record(capsys, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "one two"}\n{"text": 42}\n{"text": "three four"}\n{"text": "torn')
    code, err = prepare(capsys, tmp_path, "--input", docs, "--train-tokenizer", 300)
    assert_one_line_error(code, err, 1, "docs.jsonl:2: field 'text' holds int 42, not a string", "--skip-bad-records")
    assert not (tmp_path / "out").exists()  # not even a directory holding .prepare.lock

    docs.write_text('{"text": "one two"}\n{"text": "three"\n')
    code, err = prepare(capsys, tmp_path, "--input", docs, "--train-tokenizer", 300)
    assert_one_line_error(code, err, 1, "docs.jsonl:2: malformed JSON")  # and no pyarrow line before it
    assert not (tmp_path / "out").exists()


def test_prepare_data_with_a_vocabulary_too_small_says_so(capsys, tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_text("some words")
    for vocab in (0, 100):
        code, err = prepare(capsys, tmp_path, "--input", docs, "--train-tokenizer", vocab)
        assert_one_line_error(code, err, 2, f"--train-tokenizer must be a vocabulary size of at least 258, got {vocab}")


@pytest.mark.slow  # console-script processes (~10 s); the messages themselves are checked in-process above
def test_the_console_script_prints_no_traceback(dataset, tmp_path):
    edit_manifest(dataset, without_tokenizer)
    run_dir = tmp_path / "run"
    done = run_cli("train", "--config", config_file(dataset, tmp_path, run_dir), timeout=300)
    assert_one_line_error(done.returncode, done.stderr, 1, "it has no 'tokenizer' object")
    assert not run_dir.exists()


@pytest.fixture
def run(tmp_path):
    from trinity_harness.synthetic_run import write_rollback_run

    write_rollback_run(tmp_path / "run")
    return tmp_path / "run"


def test_report_refuses_runs_that_are_not_there_and_outs_that_are_not_files(run, capsys, tmp_path):
    out = tmp_path / "r.html"
    (tmp_path / "plain").mkdir()
    (tmp_path / "afile").write_text("x")
    for runs, fragments in (([tmp_path / "nowhere"], ["nowhere' does not exist"]),
                            ([run, tmp_path / "plain"], ["plain' is not a run directory", "events.jsonl"])):
        assert_one_line_error(*cli_in_process(capsys, "report", *runs, "--out", out), 2, *fragments, "pass the run's directory")
    assert_one_line_error(*cli_in_process(capsys, "report", run, "--out", tmp_path), 2, "is a directory",
                          f"--out {tmp_path / 'report.html'}")
    assert_one_line_error(*cli_in_process(capsys, "report", run, "--out", tmp_path / "afile" / "r.html"), 2,
                          "afile' is a file", "choose another --out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "plain", "run"]


def test_report_to_a_read_only_place_advises_another_out(run, capsys, tmp_path, monkeypatch):
    from trinity_train.dashboard import report

    def read_only(path, text):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(report, "atomic_write_text", read_only)
    code, err = cli_in_process(capsys, "report", run, "--out", tmp_path / "r.html")
    assert_one_line_error(code, err, 1, "could not write the report", "cannot be written", "choose another --out")


def test_incidents_says_what_a_path_is_when_it_is_not_a_run(capsys, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "afile").write_text("x")
    for path, fragment in (("plain", "plain' is not a run directory"), ("afile", "afile' is a file, not a run"),
                           ("nowhere", "nowhere' does not exist")):
        assert_one_line_error(*cli_in_process(capsys, "incidents", tmp_path / path), 2, fragment,
                              "pass the run's directory")


def test_a_port_out_of_range_is_a_usage_mistake(capsys, tmp_path):
    assert_one_line_error(*cli_in_process(capsys, "dashboard", tmp_path, "--port", 99999), 2, "--port 99999", "0 to 65535")


def test_a_bad_muon_lr_is_named_as_itself(capsys, tmp_path):
    code, err = cli_in_process(capsys, "train", "--optim.muon_lr=nan", f"--run.dir={tmp_path / 'run'}")
    assert_one_line_error(code, err, 2, "optim.muon_lr: must be a finite number, got nan")


def test_paths_of_the_wrong_kind_say_what_they_are(corpus, capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    run_dir = tmp_path / "run"
    for data_path, fragments in (("nowhere", ["nowhere' does not exist", f"--out {tmp_path / 'nowhere'}`"]),
                                 ("afile", ["afile' is a file, not a prepared dataset directory"])):
        code, err = cli_in_process(capsys, "train", "--config", config_file(corpus, tmp_path, run_dir),
                         f"--data.path={tmp_path / data_path}")
        assert_one_line_error(code, err, 1, *fragments)
        assert "{path}" not in err and not run_dir.exists()
    code, err = cli_in_process(capsys, "train", "--config", tmp_path)
    assert_one_line_error(code, err, 2, f"config file '{tmp_path}' is a directory, not a TOML file")


def test_a_directory_that_is_no_checkpoint_is_not_called_an_interrupted_save(capsys, tmp_path):
    plain, torn = tmp_path / "plain", tmp_path / "torn"
    plain.mkdir()
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"tensors")  # a save that stopped before its meta.json
    for command in (["ckpt", "verify"], ["ckpt", "inspect"], ["export-hf"]):
        out = [tmp_path / "hf"] if command == ["export-hf"] else []
        assert_one_line_error(*cli_in_process(capsys, *command, plain, *out), 1, "plain' is not a checkpoint directory",
                              "pass a checkpoint")
        assert_one_line_error(*cli_in_process(capsys, *command, torn, *out), 1, "is incomplete", "the save was interrupted")
    assert not (tmp_path / "hf").exists()
