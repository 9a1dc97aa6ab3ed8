"""A run directory as the dashboard sees it: abandoned iterations, markers, layer records."""

import numpy as np

from trinity_harness.synthetic_run import MOE_LAYERS, NUM_EXPERTS, NUM_LAYERS, write_rollback_run
from trinity_train.dashboard import views
from trinity_train.dashboard.runs import RunView
from trinity_train.records import EventName, IncidentAction


def loaded(path) -> RunView:
    run = RunView(0, path)
    run.refresh()
    return run


def test_rollback_iterations_are_abandoned_and_superseded_records_drawn_apart(tmp_path):
    fake = write_rollback_run(tmp_path / "run")
    run = loaded(fake.path)
    loss = views.series(run, ["loss"], None, None, 10_000)["series"]["loss"]
    lo, hi = fake.abandoned
    assert [x for x in loss["abandoned"]["x"] if x is not None] == list(range(lo, hi + 1))
    main = loss["main"]["x"]
    assert not set(main) & set(range(lo, hi + 1))
    gap = main.index(None)  # the main line breaks where it jumps over the undone iterations
    assert main.count(None) == 1 and (main[gap - 1], main[gap + 1]) == (lo - 1, hi + 1)
    drawn = [x for x in main if x is not None]
    assert drawn == sorted(drawn) and drawn[-1] == 300
    narrow = views.series(run, ["loss", "val_loss"], None, None, 20)["series"]  # downsampled: still broken
    assert None in narrow["loss"]["main"]["x"] and None in narrow["val_loss"]["main"]["x"]
    first, last = fake.superseded
    assert [x for x in loss["superseded"]["x"] if x is not None] == list(range(first, last + 1))
    mask = run.abandoned_mask(np.array([lo - 1, lo, hi, hi + 1]))
    assert mask.tolist() == [False, True, True, False]


def test_markers_list_every_skip_rollback_checkpoint_and_resume(tmp_path):
    fake = write_rollback_run(tmp_path / "run")
    m = views.markers(loaded(fake.path))
    assert [s["iter"] for s in m["skipped"]] == fake.skipped
    assert [s["abandoned"] for s in m["skipped"]] == [False, True, True, True]
    assert m["skipped"][0]["incident"] == "00000080.json" and m["skipped"][0]["reason"] == "loss_spike"
    assert [(r["to_iter"], r["iter"], r["incident"]) for r in m["rollbacks"]] == [(150, 173, "00000173.json")]
    assert [e["iter"] for e in m["events"] if e["event"] == EventName.CHECKPOINT] == fake.checkpoints
    assert [e["iter"] for e in m["events"] if e["event"] == EventName.RESUME] == [200]


def test_expert_load_and_layer_records(tmp_path):
    run = loaded(write_rollback_run(tmp_path / "run").path)
    heat = views.expert_load(run, None, None, 50)
    assert heat["layers"] == MOE_LAYERS and len(heat["z"]) == len(MOE_LAYERS) and len(heat["x"]) <= 50
    steps = views.layer_steps(run)
    assert steps["iters"][-1] == 300 and steps["abandoned"][steps["iters"].index(160)]
    latest = views.layer_record(run, None)
    assert latest["iter"] == 300 and len(latest["residual_rms"]) == NUM_LAYERS
    relative = np.array(latest["tokens_per_expert_relative"])
    assert relative.shape == (len(MOE_LAYERS), NUM_EXPERTS) and np.allclose(relative.mean(axis=1), 1)
    assert views.layer_record(run, 155)["iter"] == 150  # the latest at or before


def test_an_absent_or_empty_run_is_waiting_and_every_view_is_empty(tmp_path):
    for path in (tmp_path / "not-yet", tmp_path / "empty"):
        if path.name == "empty":
            path.mkdir()
        run = loaded(path)
        assert views.run_summary(run)["state"] == "waiting"
        assert views.series(run, ["loss"], None, None, 100)["series"]["loss"]["main"]["x"] == []
        assert views.expert_load(run, None, None, 100)["z"] == []
        assert views.layer_record(run, None)["iter"] is None and views.markers(run)["skipped"] == []


def test_incident_reports_are_read_only_from_inside_the_run(tmp_path):
    fake = write_rollback_run(tmp_path / "run")
    run = loaded(fake.path)
    assert run.incident_report("00000080.json")["action"] == IncidentAction.SKIP
    assert run.incident_report("173")["action"] == IncidentAction.ROLLBACK
    outside = tmp_path / "secret.json"
    outside.write_text('{"secret": 1}')
    (fake.path / "incidents" / "00000099.json").symlink_to(outside)
    for name in ("00000099.json", "../secret.json", "/etc/passwd", "00000080.json\n", "٣.json", "00000081.json"):
        assert run.incident_report(name) is None, name
