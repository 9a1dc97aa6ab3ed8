"""`trinity-train plan`'s tables: memory per GPU by category (traced, and the closed form beside
it), the reserve and whether it fits the GPU, traffic per step by collective and mesh dimension
(inside a node and across nodes), the checkpoint, and the predicted step time; and `--search`'s
ranked layouts. One function builds the JSON-able summary and one prints it, so the text and
`--json` say the same."""

from __future__ import annotations

from trinity_train.config import Config
from trinity_train.model.counting import count_parameters
from trinity_train.parallel.assumed_routing import AssumedRouting
from trinity_train.plan.formula import communicators, memory_per_rank, traffic_per_rank
from trinity_train.plan.hardware import CPU_RESERVE, DEFAULT_MFU, DEFAULT_RESERVE, GPUS, Hardware, Reserve
from trinity_train.plan.job import JobPlan
from trinity_train.plan.profile import LINK_NAMES, ProfiledHardware
from trinity_train.plan.search import Candidate, SearchResult
from trinity_train.plan.formula import Flow
from trinity_train.plan.timing import flops_per_gpu, split_by_link, step_time_of_flows
from trinity_train.plan.trace import CATEGORIES

GIB = 2 ** 30
GB = 1e9

# Trace and formula disagree on a line when they differ by more than TOLERANCE of the traced
# value, on lines of at least FLOOR of the scale (the traced peak; the traced traffic total):
# smaller lines are noise next to the total.
TOLERANCE, FLOOR = 0.10, 0.01
RULE = (f"a warning marks a line where trace and formula differ by more than {TOLERANCE:.0%} of the traced "
        f"value, on lines of at least {FLOOR:.0%} of the traced peak (traffic: of the traced total)")


def _count(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def seconds(s: float) -> str:
    """A duration as a person reads it: milliseconds below a second."""
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.3f} s"


def disagrees(traced: float, formula: float, scale: float) -> bool:
    """Whether a formula value is off its traced value by the rule `RULE` states."""
    if max(traced, formula) < FLOOR * scale:
        return False
    return abs(formula - traced) > TOLERANCE * traced


def _warning(what: str, traced: float, formula: float, unit: float, unit_name: str) -> str:
    off = f"{(formula - traced) / traced:+.0%}" if traced else "traced 0"
    return f"{what}: traced {traced / unit:.3f} {unit_name}, formula {formula / unit:.3f} {unit_name} ({off})"


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


def formula_memory(plan: JobPlan, reserve: Reserve = DEFAULT_RESERVE) -> dict:
    """The closed form's memory per rank (the hottest rank under the plan's routing), with its
    reserve lines (a CPU plan's reserve holds none)."""
    model = memory_per_rank(plan.cfg, plan.dims, gpu=plan.gpu, routing=plan.routing)
    n_comms = communicators(plan.dims)
    return {"memory": model.by_category, "peak": model.peak, "moment": model.moment,
            "reserve": reserve.lines(model.peak, n_comms),
            "total_with_reserve": model.peak + reserve.total(model.peak, n_comms)}


def traffic_totals(plan: JobPlan, rows: list[dict]) -> dict:
    """The traced rows' bytes per step inside and across nodes, and the closed form's."""
    flows = traffic_per_rank(plan.cfg, plan.dims, gpu=plan.gpu, routing=plan.routing)
    inside, across = split_by_link(flows, plan.dims, plan.gpus_per_node)
    traced = {"inside_bytes": sum(r["inside_bytes"] for r in rows),
              "across_bytes": sum(r["across_bytes"] for r in rows)}
    return {"traced": traced, "formula": {"inside_bytes": inside, "across_bytes": across}}


def comparison_warnings(data: dict) -> list[str]:
    """The lines of a summary where trace and formula disagree (`RULE`): each memory category
    and the total of every rank class, and the traffic inside and across nodes."""
    warnings = []
    predicted = data["formula"]
    for c in data["rank_classes"]:
        lines = [(cat, c["memory"][cat], predicted["memory"][cat]) for cat in CATEGORIES]
        for what, traced, formula in [*lines, ("total", c["peak"], predicted["peak"])]:
            if disagrees(traced, formula, c["peak"]):
                warnings.append(_warning(f"memory, rank {c['rank']}, {what}", traced, formula, GIB, "GiB"))
    traced, formula = data["traffic_totals"]["traced"], data["traffic_totals"]["formula"]
    scale = traced["inside_bytes"] + traced["across_bytes"]
    for key, where in (("inside_bytes", "inside nodes"), ("across_bytes", "across nodes")):
        if disagrees(traced[key], formula[key], scale):
            warnings.append(_warning(f"traffic {where}", traced[key], formula[key], GB, "GB"))
    return warnings


def fit_verdict(classes: list[dict], n_communicators: int, hardware: Hardware,
                reserve: Reserve = DEFAULT_RESERVE) -> dict:
    """Each rank class's traced peak (`classes`: a summary's "rank_classes") plus the reserve of
    a rank using `n_communicators` NCCL communicators, against the GPU's memory."""
    lines = [{"rank": c["rank"], "reserve": reserve.lines(c["peak"], n_communicators),
              "total_with_reserve": c["peak"] + reserve.total(c["peak"], n_communicators)} for c in classes]
    needed = max(c["total_with_reserve"] for c in lines)
    return {"gpu": hardware.name, "memory_bytes": hardware.memory_bytes, "communicators": n_communicators,
            "classes": lines, "needed_bytes": needed, "fits": needed <= hardware.memory_bytes}


def traced_flows(plan: JobPlan, trace_index: int = 0) -> list[tuple[Flow, bool]]:
    """The traced rank's collectives as flows of one call each (a profile prices each call by its
    size), with whether the call's group stays inside a node."""
    return [(Flow(c.category, c.kind, c.dim or "?", len(c.group_ranks), 1, c.sent), not plan.crosses_nodes(c.group_ranks))
            for c in plan.traces[trace_index].collectives]


def timing_summary(plan: JobPlan, hardware: Hardware, mfu: float) -> dict:
    """The predicted step of the traced rank: its traced collectives priced on `hardware` (by link,
    and on a profile by kind and size), its compute at `mfu`."""
    t = step_time_of_flows(plan.cfg, plan.dims, traced_flows(plan), hardware, mfu)
    return {"gpu": hardware.name, "mfu": mfu, "flops_per_gpu": flops_per_gpu(plan.cfg, plan.dims),
            "compute_s": t.compute_s, "comm_s": t.comm_s,
            "no_overlap_s": t.no_overlap_s, "overlap_s": t.overlap_s, "predicted_s": t.predicted_s,
            "overlaps": t.overlaps,
            "tokens_per_s_per_gpu": {"overlap": t.tokens_per_s_per_gpu(True),
                                     "no_overlap": t.tokens_per_s_per_gpu(False)},
            "intra_gbytes_s": hardware.intra_gbytes_s, "inter_gbits_s": hardware.inter_gbits_s,
            "peak_tflops": hardware.peak_tflops, "profile": profile_summary(hardware)}


def profile_summary(hardware: Hardware) -> dict | None:
    """What a calibrated profile says of the hardware it measured (None for a datasheet GPU)."""
    if not isinstance(hardware, ProfiledHardware):
        return None
    p = hardware.profile
    return {"path": p.path, "device": p.device, "backend": p.backend, "torch": p.torch, "dtype": p.dtype,
            "nodes": sorted(p.nodes), "ranks_per_node": p.ranks_per_node, "matmul_flops": p.matmul_flops,
            "step_flops": p.step_flops, "overlaps": p.overlaps_communication,
            "bandwidth": {link: p.link_bandwidth(link) for link in LINK_NAMES if p.link_bandwidth(link)}}


def on_every_gpu(plan: JobPlan, data: dict, mfu: float, reserve: Reserve = DEFAULT_RESERVE) -> list[dict]:
    """The same trace priced on each GPU of the table (`hardware.GPUS`): the fit and the step,
    so one trace answers "which GPU" (the memory and the bytes do not depend on it)."""
    out = []
    for hardware in GPUS.values():  # datasheet GPUs: a GPU plan's numerics and reserve
        fit = fit_verdict(data["rank_classes"], communicators(plan.dims), hardware, reserve)
        time = timing_summary(plan, hardware, mfu)
        out.append({"gpu": hardware.name, "mfu": mfu, "fits": fit["fits"], "needed_bytes": fit["needed_bytes"],
                    "memory_bytes": hardware.memory_bytes, "overlap_s": time["overlap_s"],
                    "no_overlap_s": time["no_overlap_s"], "tokens_per_s_per_gpu": time["tokens_per_s_per_gpu"]})
    return out


def summary(plan: JobPlan, hardware: Hardware | None = None, mfu: float = DEFAULT_MFU,
            reserve: Reserve = DEFAULT_RESERVE) -> dict:
    """Everything the plan found, as plain data (what `--json` prints). `hardware`: the GPU the
    fit and the step time are priced on (None for a CPU plan: neither is)."""
    cfg, dims = plan.cfg, plan.dims
    counts = count_parameters(cfg.model)
    rows = traffic_rows(plan)
    traffic = traffic_totals(plan, rows)
    # A GPU plan is priced on a datasheet GPU or a profile; a CPU plan only on a (gloo) profile.
    priced = hardware is not None and (plan.gpu or isinstance(hardware, ProfiledHardware))
    data = {
        "layout": {"world": dims.world_size, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
                   "cp": dims.cp, "tp": dims.tp, "ep": dims.ep, "efsdp": dims.efsdp, "gpus_per_node": plan.gpus_per_node,
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
        "formula": formula_memory(plan, reserve if plan.gpu else CPU_RESERVE),
        "fit": None,  # below: from the classes' peaks
        "traffic": rows,
        "traffic_totals": traffic,
        "checkpoint": {"files": dims.world_size + 1, "total_bytes": plan.checkpoint_bytes,
                       "bytes_per_rank_max": max(t.checkpoint_bytes for t in plan.traces)},
        "step_time": timing_summary(plan, hardware, mfu) if priced else None,
        "comparison_rule": RULE,
        "warnings": [],  # below: from the memory and traffic above
    }
    data["fit"] = fit_verdict(data["rank_classes"], communicators(dims), hardware, reserve) if priced else None
    # The datasheet table beside a datasheet price only (a profile is one cluster's measurement).
    datasheet = priced and plan.gpu and not isinstance(hardware, ProfiledHardware)
    data["on_every_gpu"] = on_every_gpu(plan, data, mfu) if datasheet else None
    data["warnings"] = comparison_warnings(data)
    return data


def render(data: dict) -> str:
    """The text tables of a `summary`."""
    lay, batch = data["layout"], data["batch"]
    lines = [f"layout: {lay['describe']}; {lay['gpus_per_node']} GPUs per node",
             f"model: {_count(data['model']['parameters'])} parameters ({_count(data['model']['active'])} "
             f"active); {data['numerics']}; activation checkpointing "
             f"{'on' if data['activation_checkpointing'] else 'off'}; routing {data['routing']}",
             f"batch: {batch['global_batch']} sequences x {batch['seq_len']} tokens = "
             f"{batch['tokens_per_step'] / 1e6:.2f}M tokens per step (micro-batch {batch['micro_batch_size']} x "
             f"{batch['grad_accum']} per rank)", ""]
    classes, formula, fit = data["rank_classes"], data["formula"], data["fit"]
    head = "".join(f"{'rank ' + str(c['rank']):>12}" for c in classes) + f"{'formula':>12}"
    lines.append(f"memory per GPU at the step's peak (GiB){'':<4}{head}")

    def row(label: str, traced: list[float], predicted: float | None) -> str:
        cells = "".join(f"{v / GIB:>12.2f}" for v in traced)
        return f"  {label:<42}{cells}" + (f"{predicted / GIB:>12.2f}" if predicted is not None else "")

    for cat in CATEGORIES:
        lines.append(row(cat, [c["memory"][cat] for c in classes], formula["memory"][cat]))
    lines.append(row("total (peak)", [c["peak"] for c in classes], formula["peak"]))
    if fit is not None:
        for name in fit["classes"][0]["reserve"]:
            label = f"reserve: {name}" + (f" ({fit['communicators']} communicators)" if name == "NCCL buffers" else "")
            lines.append(row(label, [c["reserve"][name] for c in fit["classes"]], formula["reserve"][name]))
        lines.append(row("total with reserve", [c["total_with_reserve"] for c in fit["classes"]],
                         formula["total_with_reserve"]))
    lines.append("  ranks in each class: " + ", ".join(f"rank {c['rank']}: {c['ranks']}" for c in classes)
                 + f"; the formula's peak: {formula['moment']}")
    if fit is not None:
        needed, have = fit["needed_bytes"] / GIB, fit["memory_bytes"] / GIB
        lines.append(f"fits on {fit['gpu']} ({needed:.1f} of {have:.1f} GiB with the reserve)" if fit["fits"] else
                     f"does NOT fit on {fit['gpu']}: needs {needed:.1f} GiB with the reserve, the GPU has {have:.1f}")
    else:
        lines.append("a CPU plan (--cpu): no fit or step time without a profile of its nodes (--hardware)")
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
    predicted = data["traffic_totals"]["formula"]
    lines.append(f"  {'total (formula)':<59}{predicted['inside_bytes'] / GB:>13.3f}"
                 f"{predicted['across_bytes'] / GB:>14.3f}")
    ck = data["checkpoint"]
    lines += ["", f"checkpoint: {ck['total_bytes'] / GB:,.1f} GB in up to {ck['files']:,} files (one per rank "
                  f"+ .metadata); at most {ck['bytes_per_rank_max'] / GB:.2f} GB written by one rank"]
    st = data["step_time"]
    if st is not None:
        lines += ["", *step_time_heading(st, classes[0]["rank"]),
                  f"  compute {seconds(st['compute_s'])} ({st['flops_per_gpu']:.3g} FLOPs per GPU), communication "
                  f"{seconds(st['comm_s'])}"]
        for label, key in (("no overlap", "no_overlap"), ("full overlap", "overlap")):
            lines.append(f"  {label:<14}{seconds(st[key + '_s']):>12}{st['tokens_per_s_per_gpu'][key]:>14,.0f} "
                         "tokens/s per GPU")
        lines.append(f"  predicted: {seconds(st['predicted_s'])} (the "
                     f"{'full-overlap bound: NCCL overlaps collectives with compute' if st['overlaps'] else 'no-overlap bound: a gloo job runs its collectives beside little compute'})")
    if data.get("on_every_gpu"):
        lines += ["", f"the same trace on every GPU of the table (MFU {data['on_every_gpu'][0]['mfu']:.2f}; GiB with the "
                  "reserve)",
                  f"  {'GPU':<6}{'fits':>6}{'GiB':>9}{'of':>7}{'step (overlap)':>16}{'(none)':>10}"
                  f"{'tokens/s/GPU':>14}{'(none)':>12}"]
        for g in data["on_every_gpu"]:
            rate = g["tokens_per_s_per_gpu"]
            lines.append(f"  {g['gpu']:<6}{'yes' if g['fits'] else 'NO':>6}{g['needed_bytes'] / GIB:>9.1f}"
                         f"{g['memory_bytes'] / GIB:>7.1f}{seconds(g['overlap_s']):>16}{seconds(g['no_overlap_s']):>10}"
                         f"{rate['overlap']:>14,.0f}{rate['no_overlap']:>12,.0f}")
    lines += ["", f"trace vs formula: {data['comparison_rule']}"]
    lines += [f"warning: {w}" for w in data["warnings"]] or ["  they agree on every line"]
    return "\n".join(lines)


def step_time_heading(st: dict, rank: int) -> list[str]:
    """What the step time is priced on: a datasheet GPU at an assumed MFU, or a profile's measurements."""
    p = st["profile"]
    if p is None:
        return [f"step time on {st['gpu']} at MFU {st['mfu']:.2f} ({st['peak_tflops']:,.0f} TFLOPS peak; rank "
                f"{rank}'s traced traffic at {st['intra_gbytes_s']:g} GB/s inside a node, {st['inter_gbits_s']:g} Gbit/s "
                "across)"]
    links = ", ".join(f"{LINK_NAMES[link]} {bw / 1e6:,.1f} MB/s" for link, bw in p["bandwidth"].items())
    return [f"step time on {st['gpu']}: calibrated on {', '.join(p['nodes'])} ({p['ranks_per_node']} ranks a node; "
            f"{p['device']}, {p['backend']}, torch {p['torch']}, {p['dtype']})",
            f"  compute at the measured training step's {p['step_flops'] / 1e9:,.1f} GFLOP/s (MFU {st['mfu']:.2f} of "
            f"the {p['matmul_flops'] / 1e9:,.1f} GFLOP/s matmul rate at the config's shapes); rank {rank}'s traced "
            f"collectives priced by kind, link and size as measured (one way: {links or 'no links'})"]


def _candidate(c: Candidate, prefix: str) -> dict:
    """One search candidate as plain data; `prefix`: the command its overrides complete."""
    t = c.time
    return {"overrides": list(c.overrides), "command": prefix + " ".join(c.overrides),
            "layout": {"dp_replicate": c.dims.dp_replicate, "dp_shard": c.dims.dp_shard, "cp": c.dims.cp,
                       "tp": c.dims.tp, "ep": c.dims.ep, "efsdp": c.dims.efsdp},
            "micro_batch_size": c.setting.micro_batch_size, "grad_accum": c.grad_accum,
            "memory_with_reserve_bytes": c.memory_bytes, "compute_s": t.compute_s, "comm_s": t.comm_s,
            "exposed_s": t.exposed_s, "overlap_s": t.overlap_s, "no_overlap_s": t.no_overlap_s,
            "predicted_s": t.predicted_s, "inside_bytes": t.intra_bytes, "across_bytes": t.inter_bytes, "bound": c.bound,
            "tokens_per_s_per_gpu": {"overlap": t.tokens_per_s_per_gpu(True),
                                     "no_overlap": t.tokens_per_s_per_gpu(False)}}


def search_summary(cfg: Config, world: int, hardware: Hardware, found: SearchResult, *,
                   gpus_per_node: int, mfu: float, routing: AssumedRouting, config: str) -> dict:
    """`--search`'s ranked candidates as plain data (what `--search --json` prints): `candidates`
    with the config's numerics, `other_numerics` with a wire dtype changed; `config`: the config
    file the overrides apply to, for the ready command."""
    prefix = f"trinity-train plan --config {config} --world {world} --gpus-per-node {gpus_per_node} "
    return {
        "world": world, "gpus_per_node": gpus_per_node, "gpu": hardware.name,
        "memory_bytes": hardware.memory_bytes, "mfu": mfu, "routing": routing.describe(),
        "profile": profile_summary(hardware), "overlaps": hardware.overlaps_communication,
        "model": {"parameters": count_parameters(cfg.model).total},
        "wires": {"reduce_wire_dtype": cfg.parallel.reduce_wire_dtype, "ep_wire_dtype": cfg.parallel.ep_wire_dtype},
        "layouts": found.layouts, "priced": found.priced,
        "candidates": [_candidate(c, prefix) for c in found.candidates],
        "other_numerics": [_candidate(c, prefix) for c in found.other_numerics],
    }


def _search_table(candidates: list[dict], overlaps: bool = True) -> list[str]:
    """The rows of one ranked list: the step (the predicted bound first: full overlap, or none for a
    gloo profile), memory, batch split, layout and what bounds it, then the overrides."""
    first, other = ("overlap", "no_overlap") if overlaps else ("no_overlap", "overlap")
    with_cp = any(c["layout"]["cp"] > 1 for c in candidates)  # a column only when some layout has it
    label = {"overlap": "overlap", "no_overlap": "none"}
    lines = [f"  {'#':>3}  {'step (' + label[first] + ')':>15}{'(' + label[other] + ')':>12}"
             f"{'tokens/s/GPU':>14}{'GiB':>8}{'micro x accum':>15}  "
             f"dp_replicate x dp_shard x {'cp x ' if with_cp else ''}tp x ep (efsdp); bound"]
    for i, c in enumerate(candidates, 1):
        lay = c["layout"]
        cp = f"{lay['cp']} x " if with_cp else ""
        exposed = f", {seconds(c['exposed_s'])} exposed" if c["exposed_s"] else ""
        lines.append(f"  {i:>3}  {seconds(c[first + '_s']):>15}{seconds(c[other + '_s']):>12}"
                     f"{c['tokens_per_s_per_gpu'][first]:>14,.0f}"
                     f"{c['memory_with_reserve_bytes'] / GIB:>8.1f}{c['micro_batch_size']:>9} x {c['grad_accum']:<3}  "
                     f"{lay['dp_replicate']} x {lay['dp_shard']} x {cp}{lay['tp']} x {lay['ep']} ({lay['efsdp']}); "
                     f"{c['bound']}{exposed}")
        lines.append(f"       {' '.join(c['overrides'])}")
    return lines


def render_search(data: dict) -> str:
    """The text tables of a `search_summary`: the config's numerics, then the other numerics."""
    have = data["memory_bytes"] / GIB
    wires = data["wires"]
    lines = [f"layouts of {data['world']} GPUs ({data['gpus_per_node']} per node) that fit on {data['gpu']} "
             f"({have:.1f} GiB), fastest first: closed form (no trace), MFU {data['mfu']:.2f}, routing "
             f"{data['routing']}, the config's global batch; {data['priced']:,} candidates priced of "
             f"{data['layouts']:,} layouts",
             "plan one without --search to trace it and check the formula"]
    if data.get("profile"):
        prof = data["profile"]
        lines.append(f"priced on {data['gpu']} (calibrated on {', '.join(prof['nodes'])}: MFU measured, collectives "
                     f"by kind, link and size){'' if data['overlaps'] else '; ranked by the no-overlap step, as a gloo job runs'}")
    lines.append("")
    if not data["candidates"] and not data["other_numerics"]:
        return "\n".join(lines + [f"no layout fits on {data['gpu']}: try more GPUs or a GPU with more memory"])
    lines.append(f"the config's numerics (reduce_wire_dtype={wires['reduce_wire_dtype']}, "
                 f"ep_wire_dtype={wires['ep_wire_dtype']})")
    overlaps = data.get("overlaps", True)
    lines += _search_table(data["candidates"], overlaps) if data["candidates"] else ["  none fits"]
    if data["other_numerics"]:
        lines += ["", "other numerics: bf16 on the wire (a wire dtype changed: gradients or routed tokens "
                      "rounded once more; ranked apart)"]
        lines += _search_table(data["other_numerics"], overlaps)
    held = ("the formula's peak (a CPU job holds no reserve)" if data.get("profile") and not data["overlaps"] else
            "the formula's peak plus the reserve (CUDA context, NCCL buffers, allocator headroom)")
    lines += ["", f"GiB: {held}; bound: compute-bound, or the link whose bytes take longest and its largest flow"]
    return "\n".join(lines)
