"""The columnar mirror of metrics.jsonl: the same plotted values as parsing the JSON, rebuilt at
every start, appended to as records are written, and ignored when it is not a mirror of the file
that is there now; the dashboard reads it and parses only the lines after it."""

from __future__ import annotations

import json
import os

import numpy as np

from trinity_train.columnar import MirrorWriter, parse_lines, read_mirror
from trinity_train.config import Config
from trinity_train.dashboard.runs import RunView
from trinity_train.observe import MetricsRecorder
from trinity_train.rundir import RunDir
from trinity_train.records import RecordKind


def train_record(i, loss=None):
    return {"kind": RecordKind.TRAIN, "iter": i, "step": i, "loss": 3.0 - i / 100 if loss is None else loss, "grad_norm": 1.0,
            "lr": 1e-3, "tokens_per_s": 100.0, "mfu": 0.1, "skipped": False, "moe_max_load_per_layer": [1.1, 1.2]}


def recorder(run_dir, **metrics):
    cfg = Config()
    cfg.metrics.progress_bar = False
    for key, value in metrics.items():
        setattr(cfg.metrics, key, value)
    return MetricsRecorder(cfg, run_dir, start_step=0)


def recorded(run_dir, iterations: int) -> tuple[RunDir, MetricsRecorder]:
    """A recorder (still open) that has written the train records of iterations 1..`iterations`."""
    rec = recorder(run_dir)
    for i in range(1, iterations + 1):
        rec.train(train_record(i))
    return RunDir(run_dir), rec


def test_the_mirror_holds_what_parsing_the_json_gives(tmp_path):
    run = RunDir(tmp_path)
    rec = recorder(tmp_path)
    for i in range(1, 601):  # more than two batches of 256
        rec.train(train_record(i, loss=float("nan") if i == 77 else None))
    rec.validation({"iter": 600, "step": 600, "val_loss": 2.5, "val_ppl": 12.0, "val_tokens": 10})
    probe = {"iter": 600, "step": 600, "passkey_lengths": [128, 256], "passkey_accuracy": [1.0, 0.5],
             "passkey_logprob": [-0.5, -1.5], "passkey_prompts": [6, 6]}
    rec.passkey(probe)  # as runs before the control wrote it: no passkey_logprob_other_key
    rec.passkey({**probe, "passkey_logprob_other_key": [-4.0, -5.0]})
    rec.close()
    table, end, _ = read_mirror(run.metrics_mirror, run.metrics)
    assert end == os.path.getsize(run.metrics)
    parsed = parse_lines(run.metrics.read_bytes())
    assert table.num_rows == parsed.num_rows == 603
    assert table.column("passkey_logprob_other_key").to_pylist()[-2:] == [None, [-4.0, -5.0]]
    for name in ("iter", "loss", "val_loss", "moe_max_load_per_layer", "passkey_logprob_other_key", "kind"):
        a, b = table.column(name).to_pylist(), parsed.column(name).to_pylist()
        assert [None if x != x else x for x in a] == b, name  # the JSON has null where the mirror has NaN
    assert np.isnan(table.column("loss").to_numpy(zero_copy_only=False)[76])


def test_an_unflushed_tail_and_a_new_start(tmp_path):
    run, rec = recorded(tmp_path, 299)
    # 256 rows are in the mirror; the other 43 are only in metrics.jsonl so far
    table, end, _ = read_mirror(run.metrics_mirror, run.metrics)
    assert table.num_rows == 256 and end < os.path.getsize(run.metrics)
    assert parse_lines(run.metrics.read_bytes()[end:]).num_rows == 43
    rec.close()
    # A start rewrites metrics.jsonl (a new inode): the old mirror no longer describes it ...
    records = run.metrics.read_text().splitlines(keepends=True)
    tmp = tmp_path / "new.jsonl"
    tmp.write_text("".join(records[:100]))
    os.replace(tmp, run.metrics)
    assert read_mirror(run.metrics_mirror, run.metrics) is None
    # ... and the next writer rebuilds it from the file as it is.
    MirrorWriter(run.metrics_mirror, run.metrics).close()
    table, end, _ = read_mirror(run.metrics_mirror, run.metrics)
    assert table.num_rows == 100 and end == os.path.getsize(run.metrics)


def test_a_torn_last_batch_keeps_the_rows_before_it(tmp_path):
    run, rec = recorded(tmp_path, 599)
    rec.close()
    data = run.metrics_mirror.read_bytes()
    run.metrics_mirror.write_bytes(data[:-500])  # a crash in the middle of writing the last batch
    table, end, _ = read_mirror(run.metrics_mirror, run.metrics)
    assert table.num_rows == 512 and 0 < end < os.path.getsize(run.metrics)
    run.metrics_mirror.write_bytes(b"not arrow")
    assert read_mirror(run.metrics_mirror, run.metrics) is None


def test_the_dashboard_reads_the_mirror_and_parses_only_the_lines_after_it(tmp_path):
    run, rec = recorded(tmp_path, 299)
    table, end, _ = read_mirror(run.metrics_mirror, run.metrics)
    # Damage the mirrored lines in the JSON: if the dashboard parsed them, it would drop them.
    data = bytearray(run.metrics.read_bytes())
    data[10:20] = b"#" * 10
    with open(run.metrics, "r+b") as f:
        f.write(bytes(data[:end]))
    view = RunView(0, tmp_path)
    update = view.refresh()
    assert update.new["train"] == 299
    assert list(view.metrics.train["iter"]) == list(range(1, 300))
    rec.train(train_record(300))
    assert view.refresh().new["train"] == 1
    rec.close()
    assert json.loads(run.metrics.read_text().splitlines()[-1])["iter"] == 300
