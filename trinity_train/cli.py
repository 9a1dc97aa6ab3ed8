"""`trinity-train <command>`: train, plan, calibrate, prepare-data, import-data, export-hf, import-hf,
ckpt inspect|verify, probe-context, incidents, goodput, dashboard, report, ablate.

A user mistake (any `UserError`) ends with one line `error: <message>` on stderr and the error's
exit code (`exit_codes`: 2 for configuration, 3 diverged, 1 otherwise); a lost peer of a
distributed run (`health.lost_peer`) with one line and 75, restartable. Heavy imports (torch, the model, data libraries)
happen inside the commands, so a bad configuration is reported before any of them load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from trinity_train import exit_codes
from trinity_train.config import Config, default_config_path, validate
from trinity_train.errors import DataError, UserError
from trinity_train.files import output_directory, user_path
from trinity_train.health.lost_peer import describe, is_lost_peer
from trinity_train.launcher_verdict import hand_to_launcher, mark_restartable


def cmd_train(args: argparse.Namespace, overrides: list[str], callbacks: list | None = None,
              gloo_overlap=None) -> int:
    from trinity_train.run_config import load_run_config

    cfg = load_run_config(args.config or default_config_path(), overrides)
    from trinity_train.train import train

    summary = train(cfg, callbacks, gloo_overlap)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one summary for the whole job
        print(summary.describe())
    return exit_codes.DONE


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from trinity_train.plan.command import run_plan

    return run_plan(args, overrides)


def cmd_calibrate(args: argparse.Namespace, overrides: list[str]) -> int:
    from trinity_train.calibrate.command import run_calibrate

    return run_calibrate(args, overrides)


def cmd_prepare_data(args: argparse.Namespace) -> int:
    from trinity_train.data.prepare import run_prepare

    return run_prepare(args)


def cmd_import_data(args: argparse.Namespace) -> int:
    from trinity_train.data.import_data import run_import

    return run_import(args)


def cmd_export_hf(args: argparse.Namespace) -> int:
    from trinity_train.checkpoint import load_model_checkpoint
    from trinity_train.interop.hf import save_hf
    from trinity_train.interop.tokenizer import training_tokenizer_file

    out_dir = output_directory(args.out_dir, "OUT_DIR", new=True)  # before the weights are read
    model, cfg = load_model_checkpoint(args.checkpoint)
    tokenizer = None
    if args.tokenizer:
        tokenizer = args.tokenizer
        if not tokenizer.is_file():
            raise DataError(f"--tokenizer '{tokenizer}' is not a file: pass the tokenizer.json the run trained with")
    elif not args.no_tokenizer:
        tokenizer = training_tokenizer_file(cfg.data)
        if tokenizer is None:
            print("warning: the run's dataset (and its tokenizer.json) is not where its config says; exporting "
                  "without a tokenizer (pass --tokenizer PATH to include one)", file=sys.stderr)
    out = save_hf(model, out_dir, cfg.model, tokenizer_file=tokenizer)
    with_tokenizer = f" with the tokenizer of {tokenizer}" if tokenizer else ""
    print(f"exported {args.checkpoint} to {out}{with_tokenizer} (load it with "
          "transformers.AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained)")
    return exit_codes.DONE


def cmd_import_hf(args: argparse.Namespace) -> int:
    from trinity_train.checkpoint import save_model_checkpoint
    from trinity_train.checkpoint.model_only import model_to_load_into
    from trinity_train.interop.hf import load_hf

    hf_dir = args.hf_dir
    out = output_directory(args.out or Path("runs") / "imported" / hf_dir.resolve().name, "--out", new=True)
    model_cfg, state_dict = load_hf(hf_dir)
    cfg = Config(model=model_cfg)
    validate(cfg)
    model = model_to_load_into(model_cfg)
    model.load_state_dict(state_dict, strict=True)
    save_model_checkpoint(model, cfg, out)
    print(f"imported {hf_dir} to {out}; start a run from it with --checkpoint.init_from={out}")
    return exit_codes.DONE


def _print_summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    m = summary["model"]
    print(f"{summary['path']}: {summary['kind']} checkpoint at step {summary['step']} ({summary['created']})")
    print(f"  model: {m['block']}, {m['layers']} layers, hidden {m['hidden_size']}, "
          f"{m['experts']} experts top-{m['top_k']}, vocab {m['vocab_size']}")
    for name, c in summary["components"].items():
        print(f"  {name}: {c['tensors']} tensors ({c['bytes'] / 2**20:.2f} MiB), {c['objects']} other values")
    print(f"  files: {summary['files_bytes'] / 2**20:.2f} MiB")


def cmd_ckpt(args: argparse.Namespace) -> int:
    from trinity_train.checkpoint import inspect_checkpoint, verify_checkpoint

    if args.ckpt_command == "inspect":
        _print_summary(inspect_checkpoint(args.path), args.json)
    else:
        summary = verify_checkpoint(args.path, deep=args.deep)
        files = summary["checksummed_files"]
        checked = (f"{files} files match their checksums" if files else
                   "no checksums to compare (written before trinity-train recorded them)")
        finite = "every tensor is" if args.deep else "the model's tensors are"
        print(f"ok: {args.path} is complete and loadable, {checked}, {finite} finite "
              f"({summary['kind']} checkpoint, step {summary['step']})")
    return exit_codes.DONE


def cmd_probe_context(args: argparse.Namespace) -> int:
    from trinity_train.evaluation.command import run_probe_context

    return run_probe_context(args)


def cmd_incidents(args: argparse.Namespace) -> int:
    from trinity_train.rundir import RunDir
    from trinity_train.stability.incidents import format_table, incident_rows

    rows = incident_rows(RunDir(args.run_dir).required())
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return exit_codes.DONE


def cmd_goodput(args: argparse.Namespace) -> int:
    from trinity_train.goodput import account, format_table
    from trinity_train.rundir import RunDir

    run = RunDir(args.run_dir).required()
    result = account(run.path)
    if result is None:
        raise DataError(f"RUN_DIR '{run.path}' has no {run.timeline.name}: its run started before this version "
                        "accounted for time, or never reached its training loop")
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_table(result))
    return exit_codes.DONE


def cmd_dashboard(args: argparse.Namespace) -> int:
    from trinity_train.dashboard.commands import run_dashboard

    return run_dashboard(args.run_dirs, args.host, args.port)


def cmd_report(args: argparse.Namespace) -> int:
    from trinity_train.dashboard.commands import run_report

    return run_report(args.run_dirs, args.out, args.title)


def cmd_ablate(args: argparse.Namespace) -> int:
    from trinity_train.study.command import run_ablate

    command = f"trinity-train ablate --study {args.study}" + (f" --out {args.out}" if args.out else "") + (
        f" --nproc {args.nproc}" if args.nproc != 1 else "") + (" --allow-dirty" if args.allow_dirty else "")
    return run_ablate(args.study, args.out, args.nproc, command, allow_dirty=args.allow_dirty)


def _add_ablate(sub) -> None:
    ablate = sub.add_parser("ablate", help="run a study: a grid of training cells, then its report",
                            description="Run every cell of a study (variants x learning rates x seeds of a base "
                                        "config, on the same batches) one after another, each in its own process, "
                                        "and write the report (summary.json, report.md, plots/, report.html) into "
                                        "the output directory. Cells that are done are not run again.")
    ablate.add_argument("--study", required=True, type=user_path,
                        help="study file (e.g. configs/studies/norm_placement.toml)")
    ablate.add_argument("--out", type=user_path, help="output directory (default: runs/studies/<study name>)")
    ablate.add_argument("--nproc", type=int, default=1,
                        help="processes per cell: >1 runs each cell as its own torchrun job (launch/local.sh N)")
    ablate.add_argument("--allow-dirty", action="store_true",
                        help="run even though the code's working tree has uncommitted changes (or is no git "
                             "checkout); summary.json records it, and the commit it cannot vouch for")


def _add_dashboard(sub) -> None:
    dashboard = sub.add_parser("dashboard", help="live web dashboard of run directories (local, read-only)",
                               description="Serve a live dashboard of one or more run directories; it follows "
                                           "them while they are written. A directory that does not exist yet is "
                                           "shown as waiting for the run to start.")
    dashboard.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (run.dir) to show")
    dashboard.add_argument("--port", type=int, default=8050, help="TCP port (default 8050; 0 = any free port)")
    dashboard.add_argument("--host", default="127.0.0.1",
                           help="address to listen on (default 127.0.0.1: this machine only)")
    report = sub.add_parser("report", help="the dashboard's views as one offline HTML file",
                            description="Write the dashboard's views of run directories to one self-contained "
                                        "HTML file (plotly.js and the data inline; it opens offline).")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (run.dir) to show")
    report.add_argument("--out", required=True, help="HTML file to write")
    report.add_argument("--title", help="page title (default: the run names)")


def _add_plan(subparsers) -> None:
    from trinity_train.plan.options import add_plan_arguments

    plan = subparsers.add_parser(
        "plan", allow_abbrev=False,
        help="rehearse a job of N GPUs in this process: memory, traffic and step time per rank, and the layouts "
             "that fit",
        description="Trace one training iteration of each kind of rank of an N-rank job on fake tensors "
                    "(torch's fake process group: the real model, parallel and optimizer code, no data) "
                    "and report memory per GPU by category beside the closed-form model's (warning where "
                    "they differ by more than 10 %), the reserve and whether it fits the GPU, the bytes each "
                    "collective sends inside and across nodes, the checkpoint, and the predicted step time "
                    "and tokens/s per GPU at a stated MFU. --search ranks the layouts that fit by the closed "
                    "form alone (no trace). Config keys can be overridden: --section.key=value.")
    add_plan_arguments(plan)


def _add_calibrate(subparsers) -> None:
    from trinity_train.calibrate.command import add_calibrate_arguments

    calibrate = subparsers.add_parser(
        "calibrate", allow_abbrev=False,
        help="measure the job's nodes (links, matmul and training-step rate, memory) into a hardware profile "
             "for plan --hardware",
        description="Started like the training job it prepares (launch/local.sh N calibrate ..., launch/"
                    "multinode.sh ... -- calibrate ..., launch/slurm.sbatch calibrate ..., or torchrun -m "
                    "trinity_train.cli calibrate ...), with the job's config and overrides: measure each "
                    "collective kind the plan prices inside a node and across nodes at the plan's message sizes, "
                    "the matmul and grouped-matmul rate at the config's shapes, a training step's rate on the "
                    "job's own ranks and layout (the model cut to 4 blocks) and the usable memory, within a time "
                    "limit, one line per measurement; rank 0 writes one JSON hardware profile. `trinity-train plan "
                    "--hardware PROFILE` prices with it.")
    add_calibrate_arguments(calibrate)


def _add_prepare_data(subparsers) -> None:
    parser = subparsers.add_parser("prepare-data", help="tokenize a dataset into packed token shards")
    from trinity_train.data.prepare import add_prepare_arguments

    add_prepare_arguments(parser)


def _add_import_data(subparsers) -> None:
    parser = subparsers.add_parser(
        "import-data", allow_abbrev=False,
        help="make a prepared dataset of a datatrove, Megatron or dolma tokenized corpus (tokens linked, not copied)",
        description="Write a manifest, document offsets and shard records beside hard links (or, across "
                    "filesystems, symlinks) to the token files of a corpus tokenized by datatrove (.ds + "
                    ".ds.index), Megatron (.bin + .idx) or dolma (.npy + .csv.gz); no token is copied. Checks "
                    "every id against the tokenizer's vocabulary and that every document ends with its EOS, "
                    "and holds out the last --val-fraction of each file's documents for validation.")
    from trinity_train.data.import_data import add_import_arguments

    add_import_arguments(parser)


def _add_probe_context(subparsers) -> None:
    from trinity_train.evaluation.command import add_probe_parser

    add_probe_parser(subparsers)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trinity-train", allow_abbrev=False,
                                     description="Pretrain Trinity-style Mixture-of-Experts language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", allow_abbrev=False, help="train a model (default: configs/debug.toml)",
                           description="Train. Any config key can be overridden: --section.key=value "
                                       "(e.g. --train.steps=50 --run.dir=runs/x).")
    train.add_argument("--config", type=user_path, help="TOML config file (default: configs/debug.toml)")

    _add_plan(sub)
    _add_calibrate(sub)

    # Only the command being run imports its dependencies; prepare-data's and import-data's options
    # come from the data package, so it is loaded only for those commands (and the top-level --help).
    if not argv or argv[0] in ("prepare-data", "-h", "--help"):
        _add_prepare_data(sub)
    if not argv or argv[0] in ("import-data", "-h", "--help"):
        _add_import_data(sub)

    export = sub.add_parser("export-hf", help="write a checkpoint as a Hugging Face afmoe model")
    export.add_argument("checkpoint", type=user_path, help="a training or model checkpoint directory")
    export.add_argument("out_dir", type=user_path,
                        help="new (or empty) directory for config.json, safetensors and the tokenizer")
    which = export.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", type=user_path,
                       help="tokenizer.json to export (default: the one of the run's data)")
    which.add_argument("--no-tokenizer", action="store_true", help="export the weights and config only")

    imp = sub.add_parser("import-hf", help="turn a Hugging Face afmoe model into a checkpoint")
    imp.add_argument("hf_dir", type=user_path, help="directory with config.json and safetensors")
    imp.add_argument("--out", type=user_path, help="checkpoint directory to create (default: runs/imported/<name>)")

    ckpt = sub.add_parser("ckpt", help="inspect or verify a checkpoint")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    inspect = ckpt_sub.add_parser("inspect", help="describe a checkpoint")
    inspect.add_argument("path", type=user_path)
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    verify = ckpt_sub.add_parser("verify", help="check that a checkpoint is complete, unchanged and loadable")
    verify.add_argument("path", type=user_path)
    verify.add_argument("--deep", action="store_true",
                        help="also check that every tensor (optimizer state included) is finite")

    if not argv or argv[0] in ("probe-context", "-h", "--help"):
        _add_probe_context(sub)

    incidents = sub.add_parser("incidents", help="list a run's skipped steps, rollbacks and stragglers",
                               description="One line per incident report in RUN_DIR/incidents/: what the guard "
                                           "saw, what it did, and which data the step came from; "
                                           "one per straggler event: which rank, on which host, how slow.")
    incidents.add_argument("run_dir", metavar="RUN_DIR", type=user_path)
    incidents.add_argument("--json", action="store_true", help="print the full reports as a JSON list")
    goodput = sub.add_parser("goodput", help="where a run's time went, across its attempts",
                             description="The wall time of RUN_DIR from its first process start to its last "
                                         "record, by category (start-up, steps kept, undone and skipped, "
                                         "checkpoint saves, rollbacks, validation, data waits, time lost "
                                         "between attempts), per attempt and in total, and the goodput: "
                                         "the share of the wall time in steps whose work survives.")
    goodput.add_argument("run_dir", metavar="RUN_DIR", type=user_path)
    goodput.add_argument("--json", action="store_true", help="print the account as JSON")
    _add_dashboard(sub)
    _add_ablate(sub)
    return parser


def run(argv: list[str], callbacks: list | None = None, gloo_overlap=None) -> int:
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        return cmd_train(args, extra, callbacks, gloo_overlap)
    if args.command == "plan":
        return cmd_plan(args, extra)
    if args.command == "calibrate":
        return cmd_calibrate(args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handlers = {"prepare-data": cmd_prepare_data, "import-data": cmd_import_data, "export-hf": cmd_export_hf,
                "import-hf": cmd_import_hf, "ckpt": cmd_ckpt, "probe-context": cmd_probe_context,
                "incidents": cmd_incidents,
                "goodput": cmd_goodput, "dashboard": cmd_dashboard, "report": cmd_report, "ablate": cmd_ablate}
    return handlers[args.command](args)


def passive_openmp_waits() -> None:
    """OpenMP threads that spin while they wait steal the cores their partners need when the
    machine is shared (more busy threads than cores): a CPU training step then runs 10x slower.
    Waiting threads that sleep cost little when it is not. Must run before torch is imported;
    a value the user set wins."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None, callbacks: list | None = None, gloo_overlap=None) -> int:
    """The console script. `callbacks` (`callbacks.TrainerCallback`s) attach to the training loop
    of a `train` command: for programs that drive the CLI, such as the tests' fault scripts;
    `gloo_overlap` (`parallel.gloo.communication.GlooOverlap`): a benchmark's ablation of a CPU
    job's overlaps (trinity_harness/train_instrumented.py)."""
    passive_openmp_waits()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return run(argv, callbacks, gloo_overlap)
    except UserError as e:
        message = " ".join(str(e).split())  # one line, whatever the message holds
        if hand_to_launcher(e.exit_code, message):  # under launch/: the launcher prints it once
            return exit_codes.DONE
        print(f"error: {message}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a full or read-only disk under any write (metrics, events, configs)
        from trinity_train.files import os_error_message

        message = os_error_message(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return exit_codes.FAILURE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return exit_codes.INTERRUPTED
    except Exception as e:  # a peer of the job went away or stopped answering: restart it, not a bug
        if not is_lost_peer(e):
            raise
        message = (f"lost a peer of the job: {describe(e)}; exiting {exit_codes.RESTARTABLE} (restartable: "
                   "a restart resumes from the newest sound checkpoint)")
        print(f"error: {message}", file=sys.stderr)
        mark_restartable(message)
        return exit_codes.RESTARTABLE


if __name__ == "__main__":
    sys.exit(main())
