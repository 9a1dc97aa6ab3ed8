"""The JSON the page draws, built from a `RunView`: the same payloads serve the live server's
routes and the offline report (docs/CONTRACT.md "Dashboard" lists them).

Numbers go out as lists with `None` for a missing value. Series are downsampled to the plot's
width (min and max per bucket); markers and events never are.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from trinity_train import signals
from trinity_train.dashboard.downsample import bucket_max, minmax_indices, window
from trinity_train.dashboard.runs import RunView
from trinity_train.records import EventName, RecordKind
from trinity_train.rundir import incident_name

# series name -> record kind it comes from
SERIES = {**dict.fromkeys(("loss", "grad_norm", "lr", "lr_muon", "tokens_per_s", "mfu"), RecordKind.TRAIN),
          "val_loss": RecordKind.VAL}
MARKER_EVENTS = (EventName.CHECKPOINT, EventName.RESUME, EventName.RUN_START, EventName.RUN_END, EventName.HALT,
                 EventName.LR_BACKOFF, EventName.FAULT_INJECTED, EventName.INCIDENT_OPEN, EventName.INCIDENT_CLOSE,
                 EventName.ROLLBACK_UNAVAILABLE, EventName.CHECKPOINT_PASSED_OVER, EventName.CONFIG_CHANGED,
                 EventName.SUPERSEDED)


def numbers(values) -> list:
    """float32/float64 values as JSON numbers, None for NaN/inf."""
    return [None if not math.isfinite(v) else round(v, 7) if abs(v) >= 1e-3 else v
            for v in np.asarray(values, np.float64).tolist()]


def run_summary(run: RunView) -> dict:
    with run.lock:
        train, layers = run.metrics.train, run.metrics.layers
        iters = train["iter"]
        moe = train["moe_max_load_per_layer"]
        summary = {
            "index": run.index, "name": run.name, "exists": run.exists(), "loaded": run.loaded,
            "state": run.state(), "generation": run.generation,
            "first_iter": int(iters[0]) if len(iters) else None,
            "last_iter": int(iters[-1]) if len(iters) else None,
            "records": {RecordKind.TRAIN: len(train), RecordKind.VAL: len(run.metrics.val),
                        RecordKind.LAYERS: len(layers), RecordKind.RANKS: len(run.metrics.ranks),
                        RecordKind.PASSKEY: len(run.metrics.passkey),
                        "superseded": len(run.superseded.train) + len(run.superseded.val), "events": len(run.events)},
            "moe_layers": run.metrics.moe_layers,
            "num_moe_layers": int(moe.shape[1]) if moe.ndim == 2 else 0,
            "num_layers": int(layers["residual_rms"].shape[1]) if len(layers) else 0,
        }
    return summary


def _split(run: RunView, iters: np.ndarray, values: np.ndarray, x0, x1, width: int) -> dict:
    """The main line and the rollback-abandoned points of one series in [x0, x1]."""
    span = window(iters, x0, x1)
    x, y = iters[span], values[span]
    abandoned = run.abandoned_mask(x)
    main = _downsampled(*_broken_at_rollbacks(run, x[~abandoned], y[~abandoned]), width)
    faded = _downsampled(*_with_gaps(x[abandoned], y[abandoned]), width)
    return {"main": main, "abandoned": faded, "points": int(len(x))}


def _with_gaps(x: np.ndarray, y: np.ndarray, breaks: np.ndarray | None = None):
    """A NaN between segments (where x does not continue by one, or `breaks` changes), so the
    chart does not join separate abandoned stretches with a line."""
    if len(x) < 2:
        return x, y
    cut = np.diff(x) != 1
    if breaks is not None:  # another resume's records, or the same iterations again
        cut = (np.diff(x) <= 0) | (np.diff(np.nan_to_num(breaks, nan=-1.0)) != 0)
    at = np.flatnonzero(cut) + 1
    return (np.insert(x.astype(np.float64), at, np.nan), np.insert(y.astype(np.float64), at, np.nan))


def _broken_at_rollbacks(run: RunView, x: np.ndarray, y: np.ndarray):
    """A NaN where the main line jumps over iterations a rollback undid: a line drawn through the
    band would look like training that happened."""
    starts = run.rollback_ranges()[:, 0]
    if len(x) < 2 or not len(starts):
        return x, y
    # between two points whose iterations have a rollback's first undone iteration between them
    at = np.flatnonzero(np.diff(np.searchsorted(starts, x, "right")) > 0) + 1
    return (np.insert(x.astype(np.float64), at, np.nan), np.insert(y.astype(np.float64), at, np.nan))


def _downsampled(x: np.ndarray, y: np.ndarray, width: int) -> dict:
    keep = minmax_indices(y, width)
    return {"x": numbers(x[keep]), "y": numbers(y[keep]), "downsampled": len(keep) < len(x)}


def series(run: RunView, names: list[str], x0: float | None, x1: float | None, width: int) -> dict:
    out = {}
    with run.lock:
        for name in names:
            columns = getattr(run.metrics, SERIES[name])
            part = _split(run, columns["iter"], columns[name], x0, x1, width)
            old = getattr(run.superseded, SERIES[name])
            span = window(old["iter"], x0, x1) if len(old) and _sorted(old["iter"]) else slice(None)
            sx, sy = _with_gaps(old["iter"][span], old[name][span], old["superseded_at"][span])
            part["superseded"] = _downsampled(sx, sy, width)
            out[name] = part
        generation = run.generation
    return {"run": run.index, "generation": generation, "x0": x0, "x1": x1, "width": width, "series": out}


def _sorted(x: np.ndarray) -> bool:
    return bool(np.all(np.diff(x) >= 0))


def markers(run: RunView) -> dict:
    """Skipped steps, rollbacks and the other events, none left out."""
    with run.lock:
        skip_events = {e.get("iter"): e for e in run.events_named(EventName.SKIP)}
        skipped = []
        for source, abandoned_all in ((run.metrics.train, False), (run.superseded.train, True)):
            flagged = np.flatnonzero(source["skipped"] == 1)
            abandoned = run.abandoned_mask(source["iter"][flagged]) | abandoned_all
            for i, gone in zip(flagged.tolist(), abandoned.tolist()):
                iteration = int(source["iter"][i])
                event = skip_events.get(iteration, {})
                skipped.append({"iter": iteration, **{sig.name: numbers([source[sig.name][i]])[0] for sig in signals.SIGNALS},
                                "reason": event.get("reason"), **{sig.z: event.get(sig.z) for sig in signals.SIGNALS},
                                "incident": _incident_name(event), "abandoned": gone})
        rollbacks = [{**{k: e.get(k) for k in ("iter", "to_iter", "from_step", "to_step", "checkpoint",
                                               "skipped_batches", "rollbacks", "lr_scale")},
                      "incident": _incident_name(e)} for e in run.events_named(EventName.ROLLBACK)]
        events = [e for e in run.events if e.get("event") in MARKER_EVENTS]
        # The page's own markers, by kind, so that it never spells an event name.
        checkpoints, resumes = run.events_named(EventName.CHECKPOINT), run.events_named(EventName.RESUME)
        generation = run.generation
    return {"run": run.index, "generation": generation, "skipped": skipped, "rollbacks": rollbacks,
            "checkpoints": checkpoints, "resumes": resumes, "events": events}


def _incident_name(event: dict) -> str | None:
    """The report file name (XXXXXXXX.json) an event refers to."""
    path = event.get("incident")
    return incident_name(path) if path else None


def expert_load(run: RunView, x0: float | None, x1: float | None, width: int) -> dict:
    """Max load per MoE layer over iterations: the heatmap's rows (bucket maxima)."""
    with run.lock:
        train = run.metrics.train
        load = train["moe_max_load_per_layer"]
        span = window(train["iter"], x0, x1)
        x, z = bucket_max(train["iter"][span], load[span] if load.ndim == 2 else np.empty((0, 0)), width)
        layers = run.metrics.moe_layers
    rows = z.shape[1] if z.ndim == 2 else 0
    return {"run": run.index, "x": numbers(x), "layers": layers[:rows] if len(layers) >= rows else list(range(rows)),
            "z": [numbers(z[:, j]) for j in range(rows)]}


def layer_steps(run: RunView) -> dict:
    """The iterations that have layer statistics (the step slider's positions)."""
    with run.lock:
        iters = run.metrics.layers["iter"]
        abandoned = run.abandoned_mask(iters)
        return {"run": run.index, "iters": iters.tolist(), "abandoned": abandoned.tolist()}


def layer_record(run: RunView, iteration: int | None) -> dict:
    """The layers record at `iteration` (the latest one at or before it; the latest of all when
    None), with tokens per expert divided by each layer's mean."""
    with run.lock:
        layers = run.metrics.layers
        iters = layers["iter"]
        if not len(iters):
            return {"run": run.index, "iter": None}
        at = len(iters) - 1 if iteration is None else max(int(np.searchsorted(iters, iteration, "right")) - 1, 0)
        tokens = layers["tokens_per_expert"][at]
        record = {name: numbers(layers[name][at]) for name in ("grad_norm_attn", "grad_norm_ffn", "residual_rms")}
        record.update(run=run.index, iter=int(iters[at]), step=int(layers["step"][at]),
                      moe_layers=run.metrics.moe_layers, abandoned=bool(run.abandoned_mask(iters[at:at + 1])[0]))
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a layer whose counts are all missing
        relative = tokens / np.nanmean(tokens, axis=1, keepdims=True) if tokens.size else tokens
    record["tokens_per_expert_relative"] = [numbers(row) for row in relative]
    return record


def _by_value(keys: np.ndarray, values: np.ndarray) -> tuple[list[int], list[list]]:
    """Rows of per-record lists keyed by `keys` (bucket starts, prompt lengths; NaN-padded) as one
    series per distinct key, in key order: the value of each record at that key, None where the
    record has none (a bucket or length added later in the run)."""
    distinct = np.unique(keys[np.isfinite(keys)])
    rows = np.arange(len(keys))
    series = []
    for key in distinct:
        at = keys == key
        series.append(numbers(np.where(at.any(axis=1), values[rows, at.argmax(axis=1)], np.nan)))
    return [int(k) for k in distinct], series


def long_context(run: RunView) -> dict:
    """The long-context evaluation (docs/guides/long-context-eval.md): the validation loss of each
    position bucket over the val records that have it, and each passkey probe's accuracy, key
    log-likelihood and its control's (the key scored in prompts hiding another key; None in older
    runs' records) by prompt length; iterations a rollback undid are flagged."""
    with run.lock:
        val, probes = run.metrics.val, run.metrics.passkey
        with_buckets = np.isfinite(val["val_position_starts"]).any(axis=1) if len(val) else np.zeros(0, bool)
        val_iters = val["iter"][with_buckets]
        starts, loss = val["val_position_starts"][with_buckets], val["val_loss_by_position"][with_buckets]
        probe_iters, lengths = probes["iter"], probes["passkey_lengths"]
        accuracy, logprob = probes["passkey_accuracy"], probes["passkey_logprob"]
        logprob_other_key = probes["passkey_logprob_other_key"]
        val_abandoned, probe_abandoned = run.abandoned_mask(val_iters), run.abandoned_mask(probe_iters)
        generation = run.generation
    bucket_starts, bucket_loss = _by_value(starts, loss)
    probe_lengths, probe_accuracy = _by_value(lengths, accuracy)
    _, probe_logprob = _by_value(lengths, logprob)
    _, probe_logprob_other_key = _by_value(lengths, logprob_other_key)
    return {"run": run.index, "generation": generation,
            "positions": {"iters": val_iters.tolist(), "abandoned": val_abandoned.tolist(), "starts": bucket_starts,
                          "loss": bucket_loss},
            "passkey": {"iters": probe_iters.tolist(), "abandoned": probe_abandoned.tolist(), "lengths": probe_lengths,
                        "accuracy": probe_accuracy, "logprob": probe_logprob,
                        "logprob_other_key": probe_logprob_other_key}}


RANK_TIMES = ("compute_s", "iter_s", "wait_s", "data_s", "comm_exposed_s")  # the heatmap's value first, the hover's after
STRAGGLER_FIELDS = ("iter", "step", "rank", "host", "compute_s", "median_s", "ratio", "reports")


def rank_health(run: RunView, x0: float | None, x1: float | None, width: int) -> dict:
    """The rank x iteration heatmap and the exposed-communication lines under it: each `ranks`
    record's seconds per rank (bucket maxima, so a
    slow report is not averaged away), the hosts of the latest start, the straggler events and
    the drills (consecutive `fault_injected` events of one fault and rank as one span)."""
    with run.lock:
        ranks = run.metrics.ranks
        span = window(ranks["iter"], x0, x1)
        iters = ranks["iter"][span]
        times = {}
        for name in RANK_TIMES:
            values = ranks[name][span]
            x, z = bucket_max(iters, values if values.ndim == 2 else np.empty((len(iters), 0)), width)
            times[name] = [numbers(z[:, r]) for r in range(z.shape[1])]
        hosts_events = run.events_named(EventName.RANK_HOSTS)
        stragglers = [{k: e.get(k) for k in STRAGGLER_FIELDS} for e in run.events_named(EventName.STRAGGLER)]
        drills = drill_spans(run.events_named(EventName.FAULT_INJECTED))
        generation = run.generation
    count = len(times["compute_s"])
    hosts = list(hosts_events[-1].get("hosts") or []) if hosts_events else []
    return {"run": run.index, "generation": generation, "x": numbers(x), "ranks": list(range(count)),
            "hosts": [hosts[r] if r < len(hosts) else None for r in range(count)], **times,
            "stragglers": stragglers, "drills": drills}


def drill_spans(events: list[dict]) -> list[dict]:
    """`fault_injected` events as spans: one per fault and rank over consecutive iterations
    (`rank` null: every rank), with the first event's `seconds` and `factor`."""
    spans: list[dict] = []
    open_spans: dict[tuple, dict] = {}
    for e in events:
        if not isinstance(e.get("iter"), int):
            continue
        key = (e.get("fault"), e.get("rank"))
        current = open_spans.get(key)
        if current is not None and current["last"] + 1 == e["iter"]:
            current["last"] = e["iter"]
            continue
        current = {"fault": e.get("fault"), "rank": e.get("rank"), "first": e["iter"], "last": e["iter"],
                   "seconds": e.get("seconds"), "factor": e.get("factor")}
        open_spans[key] = current
        spans.append(current)
    return spans
