"""Write docs/guides/released-sizes.md (and its summary into README.md) from `trinity-train plan`: each released size traced at the
layout it was trained with (Trinity Large report, sections 3.3-3.5) and at 512 GPUs, priced on
every GPU of the plan's table, with the closed form's best layouts per GPU (`--search`).

Every number on the page is printed by the commands it lists; this script only runs them and
lays their JSON out. It takes about 10 minutes on a 2-core machine (four full-size traces).

    .venv/bin/python scripts/released_sizes.py            # rewrites the page
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from trinity_train.plan.report import render

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guides" / "released-sizes.md"
README = ROOT / "README.md"
README_START = "<!-- released-sizes: written by scripts/released_sizes.py from `trinity-train plan` -->"
README_END = "<!-- /released-sizes -->"
GPUS = ("h100", "h200", "b200", "b300")
GIB, GB = 2 ** 30, 1e9

# (name, what it is, the plan's arguments after `trinity-train plan`)
JOBS = [
    ("nano", "Trinity Nano on 512 GPUs, HSDP: 64 replica groups of one 8-GPU node (as trained)",
     ["--config", "configs/nano.toml", "--world", "512", "--parallel.dp_replicate=64", "--parallel.dp_shard=8"]),
    ("mini", "Trinity Mini on 512 GPUs, HSDP: 64 replica groups of one node, EP 8 inside it (as trained)",
     ["--config", "configs/mini.toml", "--world", "512", "--parallel.dp_replicate=64", "--parallel.dp_shard=8"]),
    ("large-2048", "Trinity Large on 2,048 GPUs: HSDP with an FSDP group of 128, EP 8 inside a node (as trained)",
     ["--config", "configs/large.toml", "--world", "2048", "--parallel.dp_replicate=16", "--parallel.dp_shard=128"]),
    ("large-512", "Trinity Large on 512 GPUs: the same FSDP group of 128, 4 replica groups",
     ["--config", "configs/large.toml", "--world", "512", "--parallel.dp_replicate=4", "--parallel.dp_shard=128"]),
]


def plan(args: list[str]) -> tuple[dict, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "trinity_train.cli", "plan", *args, "--json"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout), time.monotonic() - started


def command(args: list[str]) -> str:
    return "trinity-train plan " + shlex.join(args)


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
            f"(per GPU; tokens/s at MFU {mfu:.2f}, a stated assumption, compute and communication overlapped,",
            "in brackets not); [the page](docs/guides/released-sizes.md) has every table, the layouts that fit",
            "each GPU best, and how to regenerate it (`python scripts/released_sizes.py`).", "",
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


def search_lines(name: str, args: list[str]) -> list[str]:
    config, world = args[1], args[3]
    out = []
    for gpu in GPUS:
        search = [*args[:4], "--search", "--top", "3", "--gpu", gpu]
        done = subprocess.run([sys.executable, "-m", "trinity_train.cli", "plan", *search], cwd=ROOT,
                              capture_output=True, text=True, check=True)
        out += [f"`{command(search)}`", "", "```text", done.stdout.rstrip(), "```", ""]
    return [f"### {name}: the layouts that fit {world} GPUs ({config}), by the closed form", "", *out]


def main() -> int:
    load = Path("/proc/loadavg").read_text().split()[:3]
    results = []
    for name, what, args in JOBS:
        print(f"planning {name} ...", file=sys.stderr, flush=True)
        data, seconds = plan(args)
        results.append((name, what, args, data, seconds))
    page = [
        "# What each released size needs",
        "",
        "Each released config traced by `trinity-train plan` ([the guide](plan.md)) at the layout Trinity",
        "was trained with (Trinity Large report, sections 3.3-3.5: Nano and Mini on 512 H200 with HSDP;",
        "Large on 2,048 B300 with an FSDP group of 128 and EP 8 inside a node) and Large at 512 GPUs too:",
        "one rank of each job runs a whole training step of the real model, parallel and optimizer code on",
        "fake tensors. The memory and the bytes do not depend on the GPU; each job is then priced on every",
        f"GPU of the plan's table at the plan's default MFU ({results[0][3]['on_every_gpu'][0]['mfu']:.2f},",
        "a stated assumption). Written by `scripts/released_sizes.py`, which runs the commands below",
        f"(load at its start: {' '.join(load)}); rerun it after a change to the model, the parallel code",
        "or the plan.",
        "",
        "## Summary",
        "",
        "Peak: the traced rank's memory at the step's peak; + reserve: with the CUDA context, NCCL",
        "buffers and allocator headroom (`plan/hardware.py`). tokens/s per GPU: with compute and",
        "communication overlapped (in brackets: not overlapped, today's blocking collectives).",
        "",
        *summary_table(results),
        "",
        "What the traces show (from the same JSON, on the default GPU, "
        f"{results[0][3]['step_time']['gpu'].upper()}):",
        "",
        *findings(results),
        "",
    ]
    for name, what, args, data, seconds in results:
        page += [f"## {name}: {what}", "", f"`{command(args)}` (traced in {seconds:.0f} s)", "",
                 "```text", render(data), "```", ""]
    page += ["## The layouts the closed form ranks first", "",
             "`--search` prices every layout by the closed form alone (no trace): the first three on each",
             "GPU, at the job's world size and global batch. Trace the one you pick (`plan` with its",
             "overrides) before you launch it.", ""]
    for name, _, args in JOBS:
        page += search_lines(name, args)
    PAGE.write_text("\n".join(page).rstrip() + "\n")
    write_readme_summary(results)
    print(f"wrote {PAGE.relative_to(ROOT)} and README.md's summary", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    raise SystemExit(main())
