"""Write docs/guides/released-sizes.md (and its summary into README.md) from `trinity-train plan`.

The page holds, for the released configs (Nano and Mini trained on 512 H200 with HSDP, Large on
2,048 B300 with an FSDP group of 128 and EP 8; Trinity Large report, sections 3.3-3.5):

- each shipped config traced at the mesh it was trained on, in full;
- for each size and each GPU of the plan's table, the closed form's best candidate at the
  trained mesh and at any mesh of the same world (`plan --search --json --top 1`), searched at
  MFU 0.2, 0.3 and 0.4;
- Large at Arcee's mesh on B300: the search's best candidate of each new class (grad
  accumulation, experts gathered once a step, bf16 reduce, the old micro-batch-6 job) traced,
  trace against formula;
- Large before and after: the previous shipping against the shipped config, by the closed form.

Every number on the page is printed by the commands it lists; this script only runs them and
lays their JSON out. It takes about 30 minutes on a 2-core machine (seven full-size traces).

    .venv/bin/python scripts/released_sizes.py            # rewrites the page

RELEASED_SIZES_CACHE=DIR keeps each command's JSON in DIR and reuses it (to re-lay the page out
without tracing again; delete DIR after a code change).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from trinity_train.cli import main as cli_main
from trinity_train.config import load_config
from trinity_train.plan.report import render
from trinity_train.plan.search_space import LAYOUT_KEYS

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guides" / "released-sizes.md"
README = ROOT / "README.md"
README_START = "<!-- released-sizes: written by scripts/released_sizes.py from `trinity-train plan` -->"
README_END = "<!-- /released-sizes -->"
GPUS = ("h100", "h200", "b200", "b300")
MFUS = (0.2, 0.3, 0.4)
GIB, GB = 2 ** 30, 1e9
CACHE = os.environ.get("RELEASED_SIZES_CACHE")

# The mesh each size was trained on (the sizes given to the search: it keeps them).
NANO_MESH = ["--parallel.dp_replicate=64", "--parallel.dp_shard=8"]
LARGE_MESH = ["--parallel.dp_replicate=16", "--parallel.dp_shard=128", "--parallel.ep=8"]

# (name, what it is, the plan's arguments after `trinity-train plan`)
JOBS = [
    ("nano", "Trinity Nano on 512 GPUs, HSDP: 64 replica groups of one 8-GPU node (as trained)",
     ["--config", "configs/nano.toml", "--world", "512", *NANO_MESH]),
    ("mini", "Trinity Mini on 512 GPUs, HSDP: 64 replica groups of one node, EP 8 inside it (as trained)",
     ["--config", "configs/mini.toml", "--world", "512", *NANO_MESH]),
    ("large-2048", "Trinity Large on 2,048 GPUs: HSDP with an FSDP group of 128, EP 8 inside a node (as trained)",
     ["--config", "configs/large.toml", "--world", "2048", "--parallel.dp_replicate=16", "--parallel.dp_shard=128"]),
]

# (size, config, world, the trained mesh's sizes; ep: the config's)
SIZES = [
    ("nano", "configs/nano.toml", "512", NANO_MESH),
    ("mini", "configs/mini.toml", "512", NANO_MESH),
    ("large", "configs/large.toml", "2048", LARGE_MESH),
]
LARGE_B300 = ["--config", "configs/large.toml", "--world", "2048", *LARGE_MESH, "--gpu", "b300"]
# The search's whole list at Arcee's Large mesh on B300: every class's best is in it.
CLASS_SEARCH = [*LARGE_B300, "--search", "--top", "500"]
BATCH_KEYS = ("micro_batch_size", "grad_accum", "global_batch_size")
TIMES: list[tuple[str, float]] = []


def cli(args: list[str]) -> tuple[dict, float]:
    """`trinity-train plan ARGS --json`: its JSON and the seconds it took."""
    key = CACHE and Path(CACHE) / (hashlib.sha1(shlex.join(args).encode()).hexdigest() + ".json")
    if key and key.exists():
        saved = json.loads(key.read_text())
        return saved["data"], saved["seconds"]
    started = time.monotonic()
    if "--search" in args:  # the closed form: seconds, in this process (no interpreter to start)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["plan", *args, "--json"]) in (0, None)
        text = out.getvalue()
    else:  # a trace: a process of its own
        text = subprocess.run([sys.executable, "-m", "trinity_train.cli", "plan", *args, "--json"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    data, seconds = json.loads(text), time.monotonic() - started
    if key:
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_text(json.dumps({"data": data, "seconds": seconds}))
    return data, seconds


def plan(args: list[str]) -> tuple[dict, float]:
    print(f"  {command(args)}", file=sys.stderr, flush=True)
    return cli(args)


def command(args: list[str], json_flag: bool = False) -> str:
    return "trinity-train plan " + shlex.join(args) + (" --json" if json_flag else "")


def summary_table(results: list[tuple[str, str, list[str], dict, float]]) -> list[str]:
    lines = ["| job | peak per GPU, traced (GiB) | + reserve | inside a node / across nodes per step (GB) "
             "| checkpoint (GB) | " + " | ".join(f"{g.upper()}: fits, tokens/s per GPU" for g in GPUS) + " |",
             "|---|---|---|---|---|" + "---|" * len(GPUS)]
    for name, _, _, data, _ in results:
        peak = max(c["peak"] for c in data["rank_classes"])
        traced = data["traffic_totals"]["traced"]
        every = {g["gpu"]: g for g in data["on_every_gpu"]}
        cells = [f"{'yes' if every[g]['fits'] else 'no'}, {every[g]['tokens_per_s_per_gpu']['overlap']:,.0f} "
                 f"({every[g]['tokens_per_s_per_gpu']['no_overlap']:,.0f})" for g in GPUS]
        lines.append(f"| {name} | {peak / GIB:.1f} | {every['h200']['needed_bytes'] / GIB:.1f} | "
                     f"{traced['inside_bytes'] / GB:,.0f} / {traced['across_bytes'] / GB:,.0f} | "
                     f"{data['checkpoint']['total_bytes'] / GB:,.0f} | " + " | ".join(cells) + " |")
    return lines


def write_readme_summary(results: list[tuple[str, str, list[str], dict, float]]) -> None:
    """The summary table, with the jobs' commands, between README.md's markers."""
    text = README.read_text()
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    mfu = results[0][3]["on_every_gpu"][0]["mfu"]
    body = ["", "Each released config as one rank of the job it was trained as, traced by `trinity-train plan`",
            f"(per GPU; tokens/s at MFU {mfu:.2f}, an assumption: no GPU has run this code, every GPU figure",
            "is a prediction; compute and communication overlapped, in brackets not);",
            "[the page](docs/guides/released-sizes.md) has every table, the best layout on each GPU at",
            "MFU 0.2, 0.3 and 0.4, and how to regenerate it (`python scripts/released_sizes.py`).", "",
            *summary_table(results), "",
            *[f"- {name}: `{command(args)}`" for name, _, args, _, _ in results], ""]
    README.write_text(text[:start] + "\n".join(body) + text[end:])


def findings(results: list[tuple[str, str, list[str], dict, float]]) -> list[str]:
    """One line per job: compute against communication, and the collective that sends the most."""
    out = []
    for name, _, _, data, _ in results:
        st, rows = data["step_time"], data["traffic"]
        top = max(rows, key=lambda r: r["inside_bytes"] + r["across_bytes"])
        where = "across nodes" if top["across_bytes"] > top["inside_bytes"] else "inside a node"
        bound = "communication" if st["comm_s"] > st["compute_s"] else "compute"
        out.append(f"- {name}: compute {st['compute_s']:.1f} s and communication {st['comm_s']:.1f} s a step "
                   f"({bound}-bound without overlap); the most bytes: {top['collective']} over {top['dim']} "
                   f"({(top['inside_bytes'] + top['across_bytes']) / GB:,.0f} GB {where}, {top['calls']} calls)")
    return out


_BASES: dict[str, object] = {}


def policies(config: str, overrides: list[str]) -> list[str]:
    """The overrides, besides the layout's sizes and the batch split, that change the config."""
    base = _BASES.setdefault(config, load_config(config))
    out = []
    for o in overrides:
        key = o[2:].split("=", 1)[0]
        section, name = key.split(".")
        if name in LAYOUT_KEYS or name in BATCH_KEYS:
            continue
        if getattr(getattr(load_config(config, [o]), section), name) != getattr(getattr(base, section), name):
            out.append(o[2:].split(".", 1)[1])
    return out


def policy_text(config: str, cand: dict) -> str:
    return ", ".join(f"`{p}`" for p in policies(config, cand["overrides"])) or "the config's"


def layout_text(cand: dict) -> str:
    lay = cand["layout"]
    cp = f" x cp {lay['cp']}" if lay["cp"] > 1 else ""
    return f"{lay['dp_replicate']} x {lay['dp_shard']}{cp} x {lay['tp']} x {lay['ep']} ({lay['efsdp']})"


def bound_text(cand: dict) -> str:
    return cand["bound"].removeprefix("bound by ")


def search_args(config: str, world: str, mesh: list[str] | None, gpu: str, mfu: float) -> list[str]:
    return ["--config", config, "--world", world, *(mesh or []), "--gpu", gpu, "--mfu", str(mfu),
            "--search", "--top", "1"]


def best_table(size: str, config: str, world: str, mesh: list[str], searches: dict) -> list[str]:
    """One row per GPU and mesh choice: the MFU-0.4 pick, and each MFU's own pick's time."""
    head = ["| GPU | mesh | layout: dp_replicate x dp_shard x tp x ep (efsdp) | micro x accum | policies "
            "(differing from the config) | inside / across nodes per step (GB) | GiB with reserve | "
            + " | ".join(f"MFU {m}: step (overlap), tokens/s per GPU" for m in MFUS)
            + " | bound (MFU " + " / ".join(str(m) for m in MFUS) + ") | bf16 wires' best, MFU 0.4 |",
            "|---|---|---|---|---|---|---|" + "---|" * len(MFUS) + "---|---|"]
    notes: list[str] = []
    for gpu in GPUS:
        for which in ("trained", "any"):
            picks = {m: (searches[size, gpu, which, m]["candidates"] or [None])[0] for m in MFUS}
            main = picks[MFUS[-1]]
            label = "as trained" if which == "trained" else "any"
            if main is None:
                lines = [f"| {gpu.upper()} | {label} | nothing fits | | | | |" + " |" * len(MFUS) + " | |"]
                head += lines
                continue
            cells, bounds = [], []
            for m in MFUS:
                c = picks[m]
                cell = f"{c['overlap_s']:.2f} s, {c['tokens_per_s_per_gpu']['overlap']:,.0f}"
                if c["overrides"] != main["overrides"]:
                    notes.append(f"{gpu.upper()}, {label}, MFU {m}: another pick, {layout_text(c)}, micro "
                                 f"{c['micro_batch_size']} x {c['grad_accum']}, {policy_text(config, c)}, "
                                 f"{c['inside_bytes'] / GB:,.0f} / {c['across_bytes'] / GB:,.0f} GB, "
                                 f"{c['memory_with_reserve_bytes'] / GIB:.1f} GiB")
                    cell += f" [{len(notes)}]"
                cells.append(cell)
                bounds.append(bound_text(c))
            bound = bounds[0] if len(set(bounds)) == 1 else " / ".join(bounds)
            others = searches[size, gpu, which, MFUS[-1]]["other_numerics"]
            if others:
                o = others[0]
                other = (f"{o['tokens_per_s_per_gpu']['overlap']:,.0f} ({o['micro_batch_size']} x "
                         f"{o['grad_accum']}, {policy_text(config, o)})")
            else:
                other = "none fits"
            head.append(f"| {gpu.upper()} | {label} | {layout_text(main)} | {main['micro_batch_size']} x "
                        f"{main['grad_accum']} | {policy_text(config, main)} | {main['inside_bytes'] / GB:,.0f} / "
                        f"{main['across_bytes'] / GB:,.0f} | {main['memory_with_reserve_bytes'] / GIB:.1f} | "
                        + " | ".join(cells) + f" | {bound} | {other} |")
    out = [*head, ""]
    if notes:
        out += ["Where a lower MFU ranks another candidate first, its time is that candidate's:", "",
                *[f"[{i}] {n}  " for i, n in enumerate(notes, 1)], ""]
    return out


def main() -> int:
    load = Path("/proc/loadavg").read_text().split()[:3]
    started = time.monotonic()
    # The closed form first (seconds each): the best candidate of every size, GPU, mesh and MFU.
    searches = {}
    for size, config, world, mesh in SIZES:
        ep = load_config(config).parallel.ep
        for gpu in GPUS:
            for which, sizes in (("trained", [*mesh[:2], f"--parallel.ep={ep}"]), ("any", None)):
                for mfu in MFUS:
                    searches[size, gpu, which, mfu] = cli(search_args(config, world, sizes, gpu, mfu))[0]
    print(f"searched in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    classes_search, _ = cli(CLASS_SEARCH)
    before_search, _ = cli(BEFORE_SEARCH)
    same, other = classes_search["candidates"], classes_search["other_numerics"]
    picks = [
        ("micro-batch with gradient accumulation (the best with accum > 1)",
         next(c for c in same if c["grad_accum"] > 1)),
        ("experts gathered once a step (the best with `expert_gather=step`)",
         next(c for c in same if "--parallel.expert_gather=step" in c["overrides"])),
        ("bf16 reduce (the best with `reduce_wire_dtype=bf16`, other numerics)",
         next(c for c in other if "--parallel.reduce_wire_dtype=bf16" in c["overrides"])),
    ]
    class_jobs = [(what, ["--config", "configs/large.toml", "--world", "2048", *c["overrides"], "--gpu", "b300"], c)
                  for what, c in picks]
    class_jobs.append(("the old micro-batch-6 job: micro-batch 6, `keep_gathered_gib=1`",
                       [*LARGE_B300, "--train.micro_batch_size=6", "--parallel.keep_gathered_gib=1"], None))
    # The traces (minutes each): the classes, then the shipped configs.
    traced_classes = []
    for what, args, cand in class_jobs:
        print(f"planning {what} ...", file=sys.stderr, flush=True)
        data, seconds = plan(args)
        traced_classes.append((what, args, cand, data, seconds))
    results = []
    for name, what, args in JOBS:
        print(f"planning {name} ...", file=sys.stderr, flush=True)
        data, seconds = plan(args)
        results.append((name, what, args, data, seconds))

    page = [
        "# What each released size needs",
        "",
        '!!! note "Predictions"',
        "    No GPU has run this code: every GPU figure on this page (fits, step time, tokens/s) is a",
        "    prediction, and the MFU each is priced at (0.2, 0.3, 0.4) is an assumption, not a",
        "    measurement. The memory and bytes are those of a trace on fake tensors and of the closed form.",
        "",
        "Each released config traced by `trinity-train plan` ([the guide](plan.md)) at the mesh Trinity",
        "was trained on (Trinity Large report, sections 3.3-3.5: Nano and Mini on 512 H200 with HSDP;",
        "Large on 2,048 B300 with an FSDP group of 128 and EP 8 inside a node):",
        "one rank of each job runs a whole training step of the real model, parallel and optimizer code on",
        "fake tensors. The memory and the bytes do not depend on the GPU; each job is then priced on every",
        f"GPU of the plan's table at the plan's default MFU ({results[0][3]['on_every_gpu'][0]['mfu']:.2f}).",
        "Then, by the closed form (`--search`), the best layout of each size on each GPU at MFU 0.2, 0.3",
        "and 0.4; and the new classes of candidate traced against the formula. Written by",
        "`scripts/released_sizes.py`, which runs the commands below (load at its start:",
        f"{' '.join(load)}; each trace's seconds beside its command); rerun it after a change to the model,",
        "the parallel code or the plan.",
        "",
        "## Summary",
        "",
        "Peak: the traced rank's memory at the step's peak; + reserve: with the CUDA context, NCCL",
        "buffers and allocator headroom (`plan/hardware.py`). tokens/s per GPU: with compute and",
        "communication overlapped (in brackets: not overlapped).",
        "",
        *summary_table(results),
        "",
        "What the traces show (from the same JSON, on the default GPU, "
        f"{results[0][3]['step_time']['gpu'].upper()}):",
        "",
        *findings(results),
        "",
    ]
    page += large_before_after(before_search)
    page += ["## The best layout on each GPU", "",
             "`plan --search --json --top 1` on each GPU of the plan's table at MFU 0.2, 0.3 and 0.4, at the",
             "mesh each size was trained on (the sizes given: the search keeps them; the config's EP) and",
             "at any mesh of the same world (no size given). The columns before the times are the MFU-0.4",
             "pick's; a lower MFU's time is its own pick's (marked where that is another candidate). The",
             "policies are the pick's overrides that change the config (its layout sizes and batch split",
             "aside); bound: `compute` where compute takes at least as long as the communication, else the",
             "link and its largest flow. The last column is the best candidate with bf16 on the wire",
             "(`other_numerics`: it changes what is rounded), at MFU 0.4. Nothing here is traced: trace a",
             "pick (`plan` with its overrides) before launching it.", ""]
    for size, config, world, mesh in SIZES:
        ep = load_config(config).parallel.ep
        trained = [*mesh[:2], f"--parallel.ep={ep}"]
        page += [f"### {size} ({config}, {world} GPUs)", "",
                 f"`{command(search_args(config, world, trained, 'GPU', 'MFU'), True)}` (as trained) and",
                 f"`{command(search_args(config, world, None, 'GPU', 'MFU'), True)}` (any mesh), for GPU in "
                 f"{', '.join(GPUS)} and MFU in {', '.join(map(str, MFUS))}.", "",
                 *best_table(size, config, world, mesh, searches)]
    page += class_section(classes_search, traced_classes)
    for name, what, args, data, seconds in results:
        page += [f"## {name}: {what}", "", f"`{command(args)}` (traced in {seconds:.0f} s)", "",
                 "```text", render(data), "```", ""]
    PAGE.write_text("\n".join(page).rstrip() + "\n")
    write_readme_summary(results)
    print(f"wrote {PAGE.relative_to(ROOT)} and README.md's summary", file=sys.stderr)
    return 0


BEFORE_SEARCH = [*LARGE_B300, "--parallel.keep_gathered_gib=1", "--search", "--top", "500"]


def large_before_after(search: dict) -> list[str]:
    """The previous Large shipping against the shipped config, by the closed form at Arcee's mesh."""
    config = "configs/large.toml"
    shipped = load_config(config)

    def old(c: dict) -> bool:
        return c["micro_batch_size"] == 1 and policies(config, c["overrides"]) == ["keep_gathered_gib=1"]

    def now(c: dict) -> bool:
        return c["micro_batch_size"] == shipped.train.micro_batch_size and not policies(config, c["overrides"])

    rows = []
    for what, test in (("before: micro-batch 1 x 6, `keep_gathered_gib=1`", old),
                       (f"now (configs/large.toml): micro-batch {shipped.train.micro_batch_size} x "
                        f"{12288 // 2048 // shipped.train.micro_batch_size}, `keep_gathered_gib="
                        f"{shipped.parallel.keep_gathered_gib}`", now)):
        c = next((c for c in search["candidates"] if test(c)), None)
        if c is None:
            rows.append(f"- {what}: not in the search's list")
            continue
        rows.append(f"- {what}: {c['across_bytes'] / GB:,.0f} GB a GPU a step across nodes "
                    f"({c['inside_bytes'] / GB:,.0f} GB inside a node), {c['memory_with_reserve_bytes'] / GIB:.1f} GiB "
                    f"with reserve, {c['overlap_s']:.2f} s a step, {c['tokens_per_s_per_gpu']['overlap']:,.0f} "
                    f"tokens/s per GPU ({c['tokens_per_s_per_gpu']['no_overlap']:,.0f} without overlap); "
                    f"{c['bound']}")
    return ["## Large before and after", "",
            f"By the closed form on B300 at MFU {search['mfu']}, at Arcee's mesh (2,048 GPUs, 16 x 128, EP 8):",
            "the previous shipping and the shipped config, each the row of the search's list with its",
            f"micro-batch and policies (`{command(BEFORE_SEARCH, True)}`; `keep_gathered_gib=1` given so",
            "that the search tries the old value beside 0 and inf).", "", *rows, ""]


def class_section(search: dict, traced: list) -> list[str]:
    """The new classes of candidate at Arcee's Large mesh on B300, traced against the formula."""
    rows = ["| class | overrides (differing from the config) | micro x accum | peak per GPU, traced / formula (GiB) "
            "| across nodes per step, traced / formula (GB) | inside a node, traced / formula (GB) | "
            "trace vs formula warnings | traced in |",
            "|---|---|---|---|---|---|---|---|"]
    warned, commands = [], []
    for what, args, cand, data, seconds in traced:
        peak = max(c["peak"] for c in data["rank_classes"])
        tt = data["traffic_totals"]
        batch = data["batch"]
        over = [a for a in args if a.startswith("--") and "=" in a]
        rows.append(f"| {what} | {', '.join(f'`{p}`' for p in policies('configs/large.toml', over)) or 'none'} | "
                    f"{batch['micro_batch_size']} x {batch['grad_accum']} | "
                    f"{peak / GIB:.1f} / {data['formula']['peak'] / GIB:.1f} | "
                    f"{tt['traced']['across_bytes'] / GB:,.1f} / {tt['formula']['across_bytes'] / GB:,.1f} | "
                    f"{tt['traced']['inside_bytes'] / GB:,.1f} / {tt['formula']['inside_bytes'] / GB:,.1f} | "
                    f"{len(data['warnings'])} | {seconds:.0f} s |")
        warned += [f"- {what}: {w}" for w in data["warnings"]]
        commands.append(f"- {what}: `{command(args, True)}`")
    return ["## The new classes, traced", "",
            "At Arcee's Large mesh on B300 (2,048 GPUs, 16 x 128, EP 8), the search's best candidate of each",
            "class the search now tries (the first of its list with grad accumulation, the first with the",
            "routed experts gathered once a step, the first of the other-numerics list with a bf16 reduce)",
            "and the old micro-batch-6 job, each traced (`plan` without `--search`): the trace runs the real",
            "code and is the reference; the formula is the closed form the search ranks by. A warning marks",
            "a line where they differ by more than 10 % of the traced value (lines of at least 1 % of the",
            "traced peak or traffic).", "",
            f"The list they are taken from: `{command(CLASS_SEARCH, True)}`.", "",
            *rows, "",
            *(["Warnings:", "", *warned] if warned else ["No trace shows a warning: trace and formula agree on every line."]),
            "", "The traces:", "", *commands, ""]


if __name__ == "__main__":
    os.chdir(ROOT)
    raise SystemExit(main())
