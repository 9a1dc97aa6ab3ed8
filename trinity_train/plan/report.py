"""`trinity-train plan`'s tables: memory per GPU by category, traffic per step by collective and
mesh dimension (inside a node and across nodes), and the checkpoint. One function builds the
JSON-able summary and one prints it, so the text and `--json` say the same."""

from __future__ import annotations

from trinity_train.model.counting import count_parameters
from trinity_train.plan.job import JobPlan
from trinity_train.plan.trace import CATEGORIES

GIB = 2 ** 30
GB = 1e9


def traffic_rows(plan: JobPlan, trace_index: int = 0) -> list[dict]:
    """Bytes one rank sends per step, by (collective, kind, mesh dimension), split into traffic
    whose group stays inside a node and traffic whose group spans nodes."""
    rows: dict[tuple, dict] = {}
    for call in plan.traces[trace_index].collectives:
        key = (call.category, call.kind, call.dim or "?", len(call.group_ranks))
        row = rows.setdefault(key, {"collective": call.category, "kind": call.kind, "dim": call.dim or "?",
                                    "group": len(call.group_ranks), "calls": 0, "inside_bytes": 0.0,
                                    "across_bytes": 0.0})
        row["calls"] += 1
        row["across_bytes" if plan.crosses_nodes(call.group_ranks) else "inside_bytes"] += call.sent
    return sorted(rows.values(), key=lambda r: -(r["inside_bytes"] + r["across_bytes"]))


def summary(plan: JobPlan) -> dict:
    """Everything the plan found, as plain data (what `--json` prints)."""
    cfg, dims = plan.cfg, plan.dims
    counts = count_parameters(cfg.model)
    return {
        "layout": {"world": dims.world_size, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
                   "tp": dims.tp, "ep": dims.ep, "efsdp": dims.efsdp, "gpus_per_node": plan.gpus_per_node,
                   "describe": dims.describe(cfg.model)},
        "model": {"parameters": counts.total, "active": counts.active},
        "batch": {"micro_batch_size": cfg.train.micro_batch_size, "grad_accum": plan.grad_accum,
                  "global_batch": plan.global_batch, "seq_len": cfg.data.seq_len,
                  "tokens_per_step": plan.global_batch * cfg.data.seq_len},
        "routing": plan.routing.describe(),
        "numerics": "bf16 compute, fp32 master weights (GPU)" if plan.gpu and cfg.train.dtype == "bf16" else "fp32",
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "rank_classes": [
            {"rank": c.rank, "coords": t.coords, "ranks": c.ranks, "local_parameters": t.local_parameters,
             "memory": t.memory, "peak": t.peak, "checkpoint_bytes": t.checkpoint_bytes,
             "trace_seconds": round(t.seconds, 1)}
            for c, t in zip(plan.classes, plan.traces)],
        "traffic": traffic_rows(plan),
        "checkpoint": {"files": dims.world_size + 1, "total_bytes": plan.checkpoint_bytes,
                       "bytes_per_rank_max": max(t.checkpoint_bytes for t in plan.traces)},
    }


def render(data: dict) -> str:
    """The text tables of a `summary`."""
    lay, batch = data["layout"], data["batch"]
    lines = [f"layout: {lay['describe']}; {lay['gpus_per_node']} GPUs per node",
             f"model: {data['model']['parameters'] / 1e9:.1f}B parameters ({data['model']['active'] / 1e9:.2f}B "
             f"active); {data['numerics']}; activation checkpointing "
             f"{'on' if data['activation_checkpointing'] else 'off'}; routing {data['routing']}",
             f"batch: {batch['global_batch']} sequences x {batch['seq_len']} tokens = "
             f"{batch['tokens_per_step'] / 1e6:.2f}M tokens per step (micro-batch {batch['micro_batch_size']} x "
             f"{batch['grad_accum']} per rank)", ""]
    classes = data["rank_classes"]
    head = "".join(f"{'rank ' + str(c['rank']):>12}" for c in classes)
    lines.append(f"memory per GPU at the step's peak (GiB){'':<4}{head}")
    for cat in CATEGORIES:
        lines.append(f"  {cat:<42}" + "".join(f"{c['memory'][cat] / GIB:>12.2f}" for c in classes))
    lines.append(f"  {'total (traced peak)':<42}" + "".join(f"{c['peak'] / GIB:>12.2f}" for c in classes))
    lines.append("  ranks in each class: " + ", ".join(f"rank {c['rank']}: {c['ranks']}" for c in classes))
    lines.append("")
    lines.append(f"traffic per step, sent by rank {classes[0]['rank']} (GB = 1e9 B)")
    lines.append(f"  {'collective':<28}{'mesh dim':<18}{'group':>6}{'calls':>7}{'inside node':>13}{'across nodes':>14}")
    inside = across = 0.0
    for r in data["traffic"]:
        inside += r["inside_bytes"]
        across += r["across_bytes"]
        lines.append(f"  {r['collective'][:27]:<28}{r['dim'][:17]:<18}{r['group']:>6}{r['calls']:>7}"
                     f"{r['inside_bytes'] / GB:>13.3f}{r['across_bytes'] / GB:>14.3f}")
    lines.append(f"  {'total':<59}{inside / GB:>13.3f}{across / GB:>14.3f}")
    ck = data["checkpoint"]
    lines += ["", f"checkpoint: {ck['total_bytes'] / GB:,.1f} GB in up to {ck['files']:,} files (one per rank "
                  f"+ .metadata); at most {ck['bytes_per_rank_max'] / GB:.2f} GB written by one rank"]
    return "\n".join(lines)

