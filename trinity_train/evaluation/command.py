"""`trinity-train probe-context`: the passkey retrieval probe on a checkpoint (a run's newest
sound one, or a named one), at the lengths of its config up to its `data.seq_len`, or at the
lengths asked for (beyond the trained length too: how far does it carry?)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from trinity_train import exit_codes
from trinity_train.checkpoint import load_model_checkpoint
from trinity_train.checkpoint.integrity import newest_sound_checkpoint
from trinity_train.checkpoint.layout import read_meta
from trinity_train.config import PASSKEY_TEMPLATES
from trinity_train.errors import ArgumentError, CheckpointError, DataError
from trinity_train.evaluation.passkey import PasskeyProbe, PasskeyResult, probe_lengths
from trinity_train.files import atomic_write_json, output_file, user_path
from trinity_train.interop.tokenizer import training_tokenizer_file
from trinity_train.rundir import RunDir


def token_lengths(text: str) -> list[int]:
    """--lengths: comma-separated positive token counts."""
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive token counts (e.g. 256,1024), got '{text}'")
    return lengths


def add_probe_parser(subparsers) -> None:
    """The `probe-context` command's parser (built only when it runs: it loads torch)."""
    parser = subparsers.add_parser(
        "probe-context", allow_abbrev=False,
        help="the passkey retrieval probe on a checkpoint: is a key hidden in long prompts found?",
        description="Hide a 5-digit pass key at several depths of filler text, ask for it at the end, and "
                    "report at each prompt length the share of prompts whose key the model continues with "
                    "(greedy), the mean log-likelihood of the key's tokens, the same in control prompts that "
                    "hide another key, and the gain between them: near 0 when the key is not read "
                    "(docs/guides/long-context-eval.md).")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", type=user_path, metavar="RUN_DIR", help="probe the newest sound checkpoint of this run")
    which.add_argument("--checkpoint", type=user_path, metavar="PATH", help="probe this checkpoint")
    parser.add_argument("--lengths", type=token_lengths,
                        help="prompt lengths in tokens, comma-separated (default: the checkpoint config's "
                             "eval.passkey_lengths up to its data.seq_len)")
    parser.add_argument("--template", choices=PASSKEY_TEMPLATES,
                        help="the prompts' words: prose (English) or code (a Python module) (default: the "
                             "checkpoint config's eval.passkey_template)")
    parser.add_argument("--tokenizer", type=user_path,
                        help="tokenizer.json (default: the one of the run's data, where its config says)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the model runs (auto: a GPU when one is visible)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--out", type=user_path, help="also write the JSON result to this file")


def checkpoint_to_probe(args: argparse.Namespace) -> Path:
    if args.checkpoint is not None:
        return args.checkpoint
    run = RunDir(args.run).required()
    found, passed_over = newest_sound_checkpoint(run.checkpoints)
    if found is None:
        damaged = f" ({len(passed_over)} damaged)" if passed_over else ""
        raise CheckpointError(f"RUN_DIR '{run.path}' has no sound checkpoint{damaged} to probe; "
                              "pass one with --checkpoint PATH")
    return found


def device_of(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ArgumentError("--device cuda: no GPU is visible; use --device auto or cpu")
    return torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")


def format_table(result: PasskeyResult) -> str:
    lines = [f"{'length':>8}  {'retrieved':>9}  {'key log-likelihood':>18}  {'another key hidden':>18}  "
             f"{'gain':>6}  prompts"]
    lines += [f"{n:>8}  {acc:>9.0%}  {lp:>18.3f}  {other:>18.3f}  {lp - other:>+6.3f}  {k}"
              for n, acc, lp, other, k in zip(result.lengths, result.accuracy, result.logprob,
                                              result.logprob_other_key, result.prompts)]
    return "\n".join(lines)


def run_probe_context(args: argparse.Namespace) -> int:
    out = output_file(args.out, "--out", "probe.json") if args.out else None  # before any weights are read
    path = checkpoint_to_probe(args)
    device = device_of(args.device)
    model, cfg = load_model_checkpoint(path, device)
    lengths = args.lengths or probe_lengths(cfg.eval, cfg.data.seq_len)
    if not lengths:
        raise ArgumentError(f"none of the checkpoint's eval.passkey_lengths {cfg.eval.passkey_lengths} is at "
                            f"most its data.seq_len={cfg.data.seq_len}; pass --lengths")
    tokenizer = args.tokenizer or training_tokenizer_file(cfg.data)
    if tokenizer is None or not Path(tokenizer).is_file():
        where = f"'{tokenizer}' is not a file" if tokenizer else "the run's dataset (and its tokenizer.json) is not where its config says"
        raise DataError(f"the probe needs the run's tokenizer: {where}; pass --tokenizer PATH")
    settings = replace(cfg.eval, passkey_template=args.template or cfg.eval.passkey_template)
    result = PasskeyProbe.from_tokenizer(tokenizer, settings, lengths).run(model, cfg, device)
    report = {"checkpoint": str(path), "step": read_meta(path)["step"], "template": settings.passkey_template,
              **result.record_fields()}
    if out is not None:
        atomic_write_json(out, report)
    print(json.dumps(report, indent=2) if args.json else
          f"{path} (step {report['step']}, {settings.passkey_template} prompts):\n{format_table(result)}")
    return exit_codes.DONE
