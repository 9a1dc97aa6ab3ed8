"""Run directories written by hand, per docs/CONTRACT.md "Run directory", for the dashboard's unit
and API tests and its million-line benchmark: a timeline known to the iteration, and any length
without training. (The browser tests draw real fault-drill runs: tests/drill_run.py.)

`write_rollback_run`'s timeline (300 iterations):

- validation every 50 iterations, checkpoints every 50 steps, layer statistics every 10;
- a loss spike at iteration 80 that is skipped (incident report 00000080.json);
- spikes at 171..173, skipped, then a rollback at 173 to the checkpoint of iteration 150:
  iterations 151..173 are abandoned (incident report 00000173.json);
- a crash after iteration 240 and a resume from the checkpoint of iteration 200: the records of
  201..240 move to metrics.superseded.jsonl and the run goes on from 201 to 300.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from trinity_train.rundir import RunDir
from trinity_train.records import EventName, IncidentAction, RecordKind

NUM_LAYERS = 4
MOE_LAYERS = [1, 2, 3]
NUM_EXPERTS = 8


def train_record(iteration: int, step: int, rng: random.Random, *, loss: float | None = None,
                 skipped: bool = False, reason: str | None = None, offset: float = 0.0) -> dict:
    """A train line with every field of the contract; loss falls from ~9 towards ~3."""
    if loss is None:
        loss = 3.0 + 6.0 * math.exp(-iteration / 60.0) + offset + rng.gauss(0, 0.03)
    max_load = [1.2 + 0.3 * rng.random() for _ in MOE_LAYERS]
    min_load = [0.4 + 0.3 * rng.random() for _ in MOE_LAYERS]
    record = {
        "kind": RecordKind.TRAIN, "iter": iteration, "step": step, "loss": loss, "aux_loss": 0.0, "z_loss": 0.0,
        "grad_norm": 0.5 + 0.1 * rng.random() if not skipped else 40.0, "lr": 3e-4 * min(1.0, iteration / 20),
        "lr_muon": 0.02 * min(1.0, iteration / 20), "tokens": 2048, "tokens_seen": 2048 * iteration,
        "tokens_per_s": 10000 + 500 * rng.random(), "step_time_s": 0.2, "mfu": 0.11 + 0.01 * rng.random(),
        "skipped": skipped, "loss_z": rng.gauss(0, 1), "grad_norm_z": rng.gauss(0, 1), "lr_scale": 1.0,
        "moe_max_load": max(max_load), "moe_min_load": min(min_load), "moe_cv": 0.2,
        "moe_max_load_per_layer": max_load, "moe_min_load_per_layer": min_load,
        "moe_cv_per_layer": [0.2 for _ in MOE_LAYERS],
    }
    if skipped:
        record["skip_reason"] = reason or "loss_spike"
    return record


def layers_record(iteration: int, step: int, rng: random.Random) -> dict:
    per_layer = lambda scale: [scale * (1 + 0.2 * i) * (0.9 + 0.2 * rng.random()) for i in range(NUM_LAYERS)]
    return {
        "kind": RecordKind.LAYERS, "iter": iteration, "step": step,
        "grad_norm_attn": per_layer(0.1), "grad_norm_ffn": per_layer(0.2), "residual_rms": per_layer(1.0),
        "attn_out_rms": per_layer(0.5), "attn_post_rms": per_layer(0.3), "ffn_out_rms": per_layer(0.5),
        "ffn_post_rms": per_layer(0.3), "act_max_over_median": per_layer(8.0), "act_kurtosis": per_layer(3.0),
        "norm_gain": {"attn_norm": per_layer(1.0), "attn_post_norm": per_layer(0.5), "mlp_norm": per_layer(1.0),
                      "mlp_post_norm": per_layer(0.5), "q_norm": per_layer(1.0), "k_norm": per_layer(1.0),
                      "final_norm": 1.0},
        "moe_layers": MOE_LAYERS,
        "tokens_per_expert": [[float(rng.randint(300, 700)) for _ in range(NUM_EXPERTS)] for _ in MOE_LAYERS],
        "expert_bias_spread": [0.01 for _ in MOE_LAYERS], "router_entropy": [1.9 for _ in MOE_LAYERS],
        "experts_without_tokens": [0 for _ in MOE_LAYERS],
    }


def incident_report(iteration: int, step: int, action: str, reason: str, signals: list[dict], **extra) -> dict:
    return {"iter": iteration, "step": step, "action": action, "reason": reason,
            "signals": [{k: s[k] for k in ("iter", "loss", "grad_norm", "loss_z", "grad_norm_z", "skipped")}
                        for s in signals],
            "layer_grad_norms": {"attn": [0.1] * NUM_LAYERS, "ffn": [0.2] * NUM_LAYERS},
            "batches": [{"index": iteration - 1, "documents": [
                {"dataset": "synthetic", "shard": 0, "document": 7, "first_tokens": "def spike():"}]}], **extra}


def append_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


@dataclass
class RollbackRun:
    """What `write_rollback_run` wrote, for the tests to check against."""

    path: Path
    skipped: list[int] = field(default_factory=list)
    abandoned: tuple[int, int] = (151, 173)            # iterations a rollback undid
    superseded: tuple[int, int] = (201, 240)           # records a resume moved aside
    checkpoints: list[int] = field(default_factory=list)
    incidents: list[int] = field(default_factory=list)


def write_rollback_run(path: str | Path, *, seed: int = 0, offset: float = 0.0) -> RollbackRun:
    """A 300-iteration run directory with a skip, a rollback and a resume (see the module doc);
    `offset` shifts the loss so that several runs can be told apart."""
    rd, rng = RunDir(path), random.Random(seed)
    rd.path.mkdir(parents=True, exist_ok=True)
    out = RollbackRun(rd.path)
    metrics, events = [], [{"event": EventName.RUN_START, "time": 0.0, "step": 0, "iter": 0, "device": "cpu",
                            "devices": 1, "resumed_from": None}]
    step, checkpoint_steps, recent = 0, {}, []

    def validate(iteration):
        metrics.append({"kind": RecordKind.VAL, "iter": iteration, "step": step, "val_loss": 3.1 + 6 * math.exp(-iteration / 60)
                        + offset, "val_ppl": 0.0, "val_tokens": 4096})

    validate(0)
    for iteration in range(1, 241):
        spike = iteration == 80 or 171 <= iteration <= 173
        record = train_record(iteration, step, rng, loss=12.0 if spike else None, skipped=spike, offset=offset)
        metrics.append(record)
        recent = (recent + [record])[-5:]
        if spike:
            out.skipped.append(iteration)
            events.append({"event": EventName.SKIP, "time": float(iteration), "iter": iteration, "step": step,
                           "batch": iteration - 1, "reason": "loss_spike", "loss": 12.0, "grad_norm": 40.0,
                           "loss_z": 9.5, "grad_norm_z": 7.0, "incident": f"incidents/{iteration:08d}.json"})
            if iteration != 173:
                rd.incident(iteration).parent.mkdir(exist_ok=True)
                rd.incident(iteration).write_text(json.dumps(incident_report(iteration, step, IncidentAction.SKIP, "loss_spike", recent)))
                out.incidents.append(iteration)
            else:
                rollback = {"event": EventName.ROLLBACK, "time": float(iteration), "iter": 173, "from_step": step,
                            "to_step": checkpoint_steps[150], "to_iter": 150,
                            "checkpoint": "checkpoints/step_%08d" % checkpoint_steps[150],
                            "skipped_batches": [150, 173], "rollbacks": 1, "lr_scale": 0.5,
                            "incident": "incidents/00000173.json"}
                events.append(rollback)
                rd.incident(173).write_text(json.dumps(incident_report(
                    173, step, IncidentAction.ROLLBACK, "loss_spike", recent, rollback={k: v for k, v in rollback.items()})))
                out.incidents.append(173)
                step = checkpoint_steps[150]
            continue
        step += 1
        if iteration % 10 == 0:
            metrics.append(layers_record(iteration, step, rng))
        if iteration % 50 == 0:
            validate(iteration)
            if not (150 < iteration <= 173):
                checkpoint_steps[iteration] = step
                out.checkpoints.append(iteration)
                events.append({"event": EventName.CHECKPOINT, "time": float(iteration), "step": step, "iter": iteration,
                               "path": f"checkpoints/step_{step:08d}", "async_save": False})
    # the process died after iteration 240; a resume goes back to the checkpoint of iteration 200
    kept = [r for r in metrics if r["iter"] <= 200]
    superseded = [{**r, "superseded_at": 200} for r in metrics if r["iter"] > 200]
    step = checkpoint_steps[200]
    events += [{"event": EventName.RUN_START, "time": 300.0, "step": step, "iter": 200, "device": "cpu", "devices": 1,
                "resumed_from": f"checkpoints/step_{step:08d}"},
               {"event": EventName.RESUME, "time": 300.0, "checkpoint": f"checkpoints/step_{step:08d}", "step": step, "iter": 200},
               {"event": EventName.SUPERSEDED, "time": 300.0, "from_iter": 200, "records": len(superseded)}]
    metrics = kept
    for iteration in range(201, 301):
        step += 1
        metrics.append(train_record(iteration, step, rng, offset=offset))
        if iteration % 10 == 0:
            metrics.append(layers_record(iteration, step, rng))
        if iteration % 50 == 0:
            validate(iteration)
            out.checkpoints.append(iteration)
            events.append({"event": EventName.CHECKPOINT, "time": 300.0 + iteration, "step": step, "iter": iteration,
                           "path": f"checkpoints/step_{step:08d}", "async_save": False})
    events.append({"event": EventName.RUN_END, "time": 700.0, "step": step, "iter": 300, "wall_s": 700.0})
    append_jsonl(rd.metrics, metrics)
    append_jsonl(rd.superseded, superseded)
    append_jsonl(rd.events, events)
    return out
