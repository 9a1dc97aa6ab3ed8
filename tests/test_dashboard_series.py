"""Columns from JSON lines and downsampling that never hides a spike."""

import json

import numpy as np
import pytest

from trinity_train.dashboard.columns import GrowingArray, MetricsColumns
from trinity_train.dashboard.downsample import bucket_max, minmax_indices, window
from trinity_train.records import RecordKind


def lines(*records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.mark.parametrize("width", [1, 2, 3, 7, 10, 99, 100, 640, 1000, 1999, 4096, 33333, 49999, 50000, 100000])
def test_a_single_point_spike_survives_every_bucket_size(width):
    rng = np.random.default_rng(0)
    y = (3 + 0.01 * rng.standard_normal(100_000)).astype(np.float32)
    for at in (0, 4321, 99_999):
        spiked = y.copy()
        spiked[at] = 50.0
        keep = minmax_indices(spiked, width)
        assert at in keep
        assert len(keep) <= max(2 * width, 2)
        assert np.all(np.diff(keep) > 0)  # in x order


def test_short_series_are_not_downsampled_and_nan_buckets_stay_gaps():
    assert minmax_indices(np.arange(10.0), 5).tolist() == list(range(10))
    y = np.concatenate([np.ones(50), np.full(50, np.nan), np.ones(50)])
    keep = minmax_indices(y, 15)  # buckets of 10: five of them hold only NaN
    assert np.isnan(y[keep]).sum() == 5


def test_a_single_nan_break_survives_downsampling():
    y = np.ones(100_000)
    y[54_321] = np.nan  # where a line breaks (at a rollback)
    keep = minmax_indices(y, 100)
    assert 54_321 in keep and len(keep) <= 3 * 100


def test_window_selects_the_range_with_one_neighbour_each_side():
    x = np.arange(1, 101)
    assert (x[window(x, 10, 20)][[0, -1]] == [9, 21]).all()
    assert len(x[window(x, None, None)]) == 100
    assert len(x[window(x, 500, 600)]) == 1  # beyond the end: the last point only


def test_bucket_max_keeps_a_load_spike_in_a_heatmap():
    x = np.arange(10_000)
    z = np.ones((10_000, 3), np.float32)
    z[7777, 1] = 9.0
    bx, bz = bucket_max(x, z, 100)
    assert bz.shape == (100, 3) and bz[:, 1].max() == 9.0 and bz[:, 0].max() == 1.0
    assert bx[0] == 0 and np.all(np.diff(bx) > 0)


def test_mixed_kinds_become_columns_with_nan_for_null_and_absent():
    cols = MetricsColumns()
    counts = cols.append_lines(lines(
        {"kind": RecordKind.TRAIN, "iter": 1, "step": 1, "loss": 2, "grad_norm": None, "skipped": False,
         "moe_max_load_per_layer": [1.5, 1.25], "other": {"ignored": [1, 2]}},
        {"kind": RecordKind.VAL, "iter": 1, "step": 1, "val_loss": 2.5},
        {"kind": RecordKind.TRAIN, "iter": 2, "step": 1, "loss": 9.5, "skipped": True, "skip_reason": "loss_spike"},
        {"kind": RecordKind.LAYERS, "iter": 2, "step": 1, "grad_norm_attn": [0.1, 0.2], "grad_norm_ffn": [0.3, None],
         "residual_rms": [1, 2], "moe_layers": [1], "tokens_per_expert": [[3, 5, 4]]},
        {"kind": RecordKind.RANKS, "iter": 2, "step": 1, "iterations": 2, "iter_s": [0.5, 0.5], "compute_s": [0.25, None],
         "wait_s": [0.25, 0.5], "data_s": [0.0, 0.0]}))
    assert counts == {"train": 2, "val": 1, "layers": 1, "ranks": 1, "passkey": 0}
    assert cols.ranks["compute_s"].tolist()[0][0] == 0.25 and np.isnan(cols.ranks["compute_s"][0, 1])
    assert cols.train["iter"].tolist() == [1, 2] and cols.train["loss"].tolist() == [2.0, 9.5]
    assert np.isnan(cols.train["grad_norm"]).all() and cols.train["skipped"].tolist() == [0.0, 1.0]
    assert cols.train["moe_max_load_per_layer"].shape == (2, 2)  # the second row: NaN padding
    assert np.isnan(cols.train["moe_max_load_per_layer"][1]).all()
    assert cols.val["val_loss"].tolist() == [2.5]
    assert cols.layers["tokens_per_expert"].tolist() == [[[3.0, 5.0, 4.0]]] and cols.moe_layers == [1]
    assert np.isnan(cols.layers["grad_norm_ffn"][0, 1])


def test_a_garbled_line_is_skipped_and_the_rest_kept():
    data = lines({"kind": RecordKind.TRAIN, "iter": 1, "loss": 1.0}) + b'{"kind": RecordKind.TRAIN, "iter": 2, "lo\n' + \
        lines({"kind": RecordKind.TRAIN, "iter": 3, "loss": "not a number"}, {"kind": RecordKind.TRAIN, "iter": 4, "loss": 4.0})
    cols = MetricsColumns()
    cols.append_lines(data)
    assert cols.train["iter"].tolist() == [1, 4]


def test_parsing_in_chunks_equals_parsing_at_once():
    records = [{"kind": RecordKind.TRAIN, "iter": i, "step": i, "loss": 1 / i, "moe_max_load_per_layer": [i, 2 * i]}
               for i in range(1, 3001)]
    whole, parts = MetricsColumns(), MetricsColumns()
    whole.append_lines(lines(*records))
    for start in range(0, 3000, 700):
        parts.append_lines(lines(*records[start:start + 700]))
    for name in ("iter", "loss", "moe_max_load_per_layer"):
        assert np.array_equal(whole.train[name], parts.train[name])


def test_growing_array_views_survive_appends():
    grown = GrowingArray(np.float32)
    grown.append(np.ones((3, 2), np.float32))
    before = grown.values
    grown.append(np.zeros((5000, 2), np.float32))
    assert before.tolist() == [[1, 1]] * 3 and len(grown) == 5003
    grown.append(np.full((1, 3), 7, np.float32))  # a longer row is cut to the first width
    assert grown.values[-1].tolist() == [7, 7]
