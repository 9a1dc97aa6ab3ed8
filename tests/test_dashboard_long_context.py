"""The dashboard's long-context panel (docs/guides/long-context-eval.md): the validation loss of each
position bucket over iterations, buckets added mid-run (a context extension) included, and the
passkey probes by length; in headless Chromium on a real tiny run with the probe on, live and in
the offline report."""

import shutil

import pytest
from selenium.webdriver.support.ui import WebDriverWait

from trinity_harness.synthetic_run import append_jsonl, write_rollback_run
from test_long_context_eval import probe_run_config
from trinity_train.dashboard import browser, views
from trinity_train.dashboard.columns import MAX_POSITION_BUCKETS
from trinity_train.dashboard.report import write_report
from trinity_train.dashboard.runs import RunView
from trinity_train.dashboard.server import DashboardServer
from trinity_train.files import read_jsonl
from trinity_train.records import RecordKind
from trinity_train.rundir import RunDir
from trinity_train.train import Trainer


def val(iteration, starts, losses):
    return {"kind": RecordKind.VAL, "iter": iteration, "step": iteration, "val_loss": 3.0, "val_ppl": 20.0,
            "val_tokens": 100, "val_position_starts": starts, "val_loss_by_position": losses,
            "val_tokens_by_position": [10] * len(starts)}


def probe(iteration, lengths, accuracy, logprob):
    return {"kind": RecordKind.PASSKEY, "iter": iteration, "step": iteration, "passkey_lengths": lengths,
            "passkey_accuracy": accuracy, "passkey_logprob": logprob,
            "passkey_logprob_other_key": [x - 1 for x in logprob], "passkey_prompts": [6] * len(lengths)}


def loaded(path) -> RunView:
    run = RunView(0, path)
    run.refresh()
    return run


def test_buckets_added_by_an_extension_get_their_own_lines_and_old_records_none(tmp_path):
    old = {"kind": RecordKind.VAL, "iter": 0, "step": 0, "val_loss": 5.0, "val_ppl": 148.0, "val_tokens": 100}
    append_jsonl(tmp_path / "metrics.jsonl", [
        old,  # written before the loss by position existed: no line point
        val(10, [0, 64, 128], [4.0, 3.5, 3.25]),  # values a float32 column holds exactly
        val(20, [0, 64, 128, 256, 512], [3.75, 3.375, 3.125, 3.625, None]),  # the context grew; a bucket without tokens
        probe(10, [128, 256], [0.5, 0.0], [-2.0, -4.0]),
        probe(20, [128, 256, 512], [1.0, 0.5, 0.0], [-0.5, -1.5, -3.0]),
    ])
    payload = views.long_context(loaded(tmp_path))
    positions, passkey = payload["positions"], payload["passkey"]
    assert positions["iters"] == [10, 20] and positions["starts"] == [0, 64, 128, 256, 512]
    assert positions["loss"] == [[4.0, 3.75], [3.5, 3.375], [3.25, 3.125], [None, 3.625], [None, None]]
    assert passkey["iters"] == [10, 20] and passkey["lengths"] == [128, 256, 512]
    assert passkey["accuracy"] == [[0.5, 1.0], [0.0, 0.5], [None, 0.0]]
    assert passkey["logprob"] == [[-2.0, -0.5], [-4.0, -1.5], [None, -3.0]]
    assert passkey["logprob_other_key"] == [[-3.0, -1.5], [-5.0, -2.5], [None, -4.0]]


def without_control(record):
    """A passkey record as runs before the control wrote it."""
    return {k: v for k, v in record.items() if k != "passkey_logprob_other_key"}


def test_probes_before_the_control_have_none_by_length(tmp_path):
    append_jsonl(tmp_path / "metrics.jsonl", [
        without_control(probe(10, [128, 256], [0.5, 0.0], [-2.0, -4.0])),  # an older run, resumed by this version
        probe(20, [128, 256], [1.0, 0.5], [-0.5, -1.5]),
    ])
    passkey = views.long_context(loaded(tmp_path))["passkey"]
    assert passkey["logprob"] == [[-2.0, -0.5], [-4.0, -1.5]]
    assert passkey["logprob_other_key"] == [[None, -1.5], [None, -2.5]]


def test_more_buckets_than_the_dashboard_holds_are_cut_to_the_first_ones(tmp_path):
    starts = list(range(0, 2 * MAX_POSITION_BUCKETS))
    append_jsonl(tmp_path / "metrics.jsonl", [val(1, starts, [1.0] * len(starts))])
    assert views.long_context(loaded(tmp_path))["positions"]["starts"] == starts[:MAX_POSITION_BUCKETS]


def test_a_run_without_long_context_records_has_an_empty_panel(tmp_path):
    run = write_rollback_run(tmp_path / "run")
    payload = views.long_context(loaded(run.path))
    assert payload["positions"] == {"iters": [], "abandoned": [], "starts": [], "loss": []}
    assert payload["passkey"]["iters"] == [] and payload["passkey"]["lengths"] == []


def test_iterations_a_rollback_undid_are_flagged(tmp_path):
    run = write_rollback_run(tmp_path / "run")  # iterations 151..173 were undone
    append_jsonl(run.path / "metrics.jsonl", [val(160, [0, 64], [3.0, 2.9]), probe(160, [128], [1.0], [-0.1])])
    payload = views.long_context(loaded(run.path))
    assert payload["positions"]["abandoned"] == [True] and payload["passkey"]["abandoned"] == [True]


FIGURE = "const d = document.getElementById(arguments[0]); return d.data ? {data: d.data, layout: d.layout} : null;"


def check_long_context_plots(driver, records):
    """The charts of run 0, whose `records` are those of a run with the control, and of run 1, its
    copy as an older run wrote it (no control)."""
    vals = [r for r in records if r["kind"] == RecordKind.VAL]
    probes = [r for r in records if r["kind"] == RecordKind.PASSKEY]
    WebDriverWait(driver, 60).until(lambda d: d.execute_script(FIGURE, "plot-passkey"))
    lines = [t for t in driver.execute_script(FIGURE, "plot-position-loss")["data"] if t["meta"]["run"] == 0]
    assert [t["meta"]["start"] for t in lines] == vals[-1]["val_position_starts"]
    for j, line in enumerate(lines):
        assert line["x"] == [v["iter"] for v in vals]
        assert line["y"] == pytest.approx([v["val_loss_by_position"][j] for v in vals], rel=1e-5)  # float32 columns
    drawn = driver.execute_script(FIGURE, "plot-passkey")["data"]
    of_kind = lambda run, kind: [t for t in drawn if t["meta"]["run"] == run and t["meta"]["kind"] == kind]
    accuracy, logprob = of_kind(0, "passkey-accuracy"), of_kind(0, "passkey-logprob")
    control = of_kind(0, "passkey-logprob-other-key")
    # the first probe (faded) and the latest (solid), by length
    assert [t["meta"]["iter"] for t in accuracy] == [probes[0]["iter"], probes[-1]["iter"]]
    assert [t["opacity"] for t in accuracy] == [0.35, 1]
    assert accuracy[-1]["x"] == probes[-1]["passkey_lengths"]
    assert accuracy[-1]["y"] == pytest.approx(probes[-1]["passkey_accuracy"], rel=1e-5)
    assert logprob[-1]["y"] == pytest.approx(probes[-1]["passkey_logprob"], rel=1e-5) and logprob[-1]["yaxis"] == "y2"
    # the control, dotted on the same axis, for each probe drawn
    assert [t["meta"]["iter"] for t in control] == [probes[0]["iter"], probes[-1]["iter"]]
    assert [t["opacity"] for t in control] == [0.35, 1]
    assert control[-1]["y"] == pytest.approx(probes[-1]["passkey_logprob_other_key"], rel=1e-5)
    assert control[-1]["yaxis"] == "y2" and control[-1]["line"]["dash"] == "dot"
    # an older run draws as before: its probes' lines, no control
    assert len(of_kind(1, "passkey-logprob")) == 2 and of_kind(1, "passkey-logprob-other-key") == []


def copy_as_before_the_control(run, copy):
    """`run` copied to `copy` with its passkey records as runs before the control wrote them."""
    shutil.copytree(run, copy)
    RunDir(copy).metrics_mirror.unlink(missing_ok=True)
    records = read_jsonl(copy / "metrics.jsonl")
    (copy / "metrics.jsonl").unlink()
    append_jsonl(copy / "metrics.jsonl", [without_control(r) if r["kind"] == RecordKind.PASSKEY else r for r in records])


@pytest.mark.slow
@pytest.mark.skipif(not browser.available(), reason=f"needs {browser.CHROMIUM} and {browser.CHROMEDRIVER}")
def test_the_page_draws_a_real_runs_long_context_panel_live_and_in_the_report(corpus, tmp_path):
    run, old = tmp_path / "run", tmp_path / "old"
    Trainer(probe_run_config(corpus, run)).run()
    records = read_jsonl(run / "metrics.jsonl")
    copy_as_before_the_control(run, old)
    out = write_report([run, old], tmp_path / "report.html")
    with DashboardServer([run, old], poll_interval=0.1) as server, browser.headless_chromium() as driver:
        for url in (server.url, out.as_uri()):
            driver.get(url)
            browser.wait_until_rendered(driver)
            check_long_context_plots(driver, records)
        driver.save_screenshot(str(tmp_path / "long-context.png"))
    assert (tmp_path / "long-context.png").stat().st_size > 10_000
