"""The passkey retrieval probe: does the model find a key hidden at several depths of prompts of
several lengths? (docs/guides/long-context-eval.md)

For each length, one forward over its prompts (`data.passkey`) with the key's answer tokens as the
only labels, grouped by prompt (`loss.cross_entropy_by_group`): a prompt counts as retrieved when
every answer token is the model's greedy next token, and `passkey_logprob` is the mean
log-likelihood of the answer tokens. A second forward scores the same keys in the control prompts,
which hide another key (`passkey_logprob_other_key`): a model that does not read the needle scores
the key alike in both, one that reads it higher in its own prompt (`data/passkey.py`). The
training loop runs it at validation every `eval.passkey_every` steps; `trinity-train
probe-context` runs it on a checkpoint. Every data-parallel rank runs the same prompts (the forward
is collective under FSDP, TP and EP) and gets the same result. Under context parallelism a prompt is split like a training row
(`parallel.context_parallel.shard_micro_batch`: zigzag chunks, positions computed on the whole prompt), so
each rank holds 1/cp of it; the key's tokens are scored where they live and the totals summed over
the cp group. A prompt is padded at its end to a length the layout can split (`padded_length`):
no earlier position attends to the padding (causal attention) and it has no labels, so the scores
are the unpadded prompt's, and the lengths asked for need not know the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trinity_train.config import Config, EvalConfig
from trinity_train.data.passkey import PasskeyPrompt, passkey_prompts
from trinity_train.data.shards import TOKENIZER_FILE
from trinity_train.data.tokenizer import load_tokenizer
from trinity_train.errors import DataError
from trinity_train.model.loss import GROUP_CE, GROUP_CORRECT, GROUP_TOKENS, IGNORE_INDEX
from trinity_train.parallel.context_parallel import shard_micro_batch, split_for_context
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.reductions import sum_over_context
from trinity_train.step import forward_micro_batch


@dataclass
class PasskeyResult:
    lengths: list[int]
    accuracy: list[float]  # share of the prompts whose whole key was the greedy continuation
    logprob: list[float]  # mean log-likelihood of an answer token (nats; 0 is certain)
    logprob_other_key: list[float]  # the same in the control prompts, which hide another key
    prompts: list[int]  # prompts per length

    def record_fields(self) -> dict:
        """The `passkey` record's fields (`records.passkey_record`) less iter and step."""
        return {"passkey_lengths": self.lengths, "passkey_accuracy": self.accuracy,
                "passkey_logprob": self.logprob, "passkey_logprob_other_key": self.logprob_other_key,
                "passkey_prompts": self.prompts}


def probe_inputs(prompts: list[PasskeyPrompt]) -> dict[str, torch.Tensor]:
    """Model inputs of prompts of one length: input ids, labels only on the answer's tokens, and
    each token's group (its prompt)."""
    tokens = torch.tensor([p.tokens for p in prompts], dtype=torch.long)
    rows, length = tokens.shape[0], tokens.shape[1] - 1
    labels = torch.full((rows, length), IGNORE_INDEX, dtype=torch.long)
    for row, p in enumerate(prompts):
        # label t is token t+1: the answer's tokens are predicted from the position before each
        labels[row, p.answer_start - 1:] = tokens[row, p.answer_start:]
    return {"input_ids": tokens[:, :-1], "labels": labels,
            "position_ids": torch.arange(length).expand(rows, length),
            "document_ids": torch.zeros(rows, length, dtype=torch.long),
            "token_groups": torch.arange(rows)[:, None].expand(rows, length)}


def padded_length(length: int, dims: ParallelDims) -> int:
    """`length` rounded up to what the layout splits a row into: 2 x cp x tp chunks under context
    parallelism (the zigzag's, each split again by sequence parallelism), tp pieces without."""
    multiple = dims.tp * (2 * dims.cp if dims.cp > 1 else 1)
    return -(-length // multiple) * multiple


def pad_inputs(inputs: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """`probe_inputs` extended at the end to `length` tokens: token 0 with no label, positions
    continued, the last token's document and group."""
    rows, extra = inputs["input_ids"].shape[0], length - inputs["input_ids"].shape[1]
    if extra == 0:
        return inputs
    fill = {"input_ids": torch.zeros(rows, extra, dtype=torch.long),
            "labels": torch.full((rows, extra), IGNORE_INDEX, dtype=torch.long),
            "position_ids": inputs["position_ids"][:, -1:] + torch.arange(1, extra + 1)}
    return {name: torch.cat([t, fill.get(name, t[:, -1:].expand(rows, extra))], dim=1)
            for name, t in inputs.items()}


class PasskeyProbe:
    """The fixed prompts of a run and their controls (built once), scored on the model as it is
    at each call."""

    def __init__(self, prompts: dict[int, list[PasskeyPrompt]], controls: dict[int, list[PasskeyPrompt]]):
        self.prompts = prompts
        self.controls = controls

    @classmethod
    def from_tokenizer(cls, tokenizer_file: str | Path, settings: EvalConfig, lengths: list[int]) -> PasskeyProbe:
        tokenizer = load_tokenizer(tokenizer_file)

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids

        def prompts(controls: bool) -> dict[int, list[PasskeyPrompt]]:
            return passkey_prompts(encode, lengths, settings.passkey_depths, settings.passkey_keys,
                                   settings.passkey_template, controls)

        return cls(prompts(False), prompts(True))

    @torch.no_grad()
    def run(self, model: nn.Module, cfg: Config, device: torch.device,
            dims: ParallelDims | None = None) -> PasskeyResult:
        dims = dims or ParallelDims.one_process()
        was_training = model.training
        model.eval()
        result = PasskeyResult([], [], [], [], [])
        for length, prompts in self.prompts.items():
            totals = score_prompts(model, prompts, cfg, device, dims)
            control = score_prompts(model, self.controls[length], cfg, device, dims)
            retrieved = totals[GROUP_CORRECT] == totals[GROUP_TOKENS]
            result.lengths.append(length)
            result.accuracy.append(float(retrieved.double().mean()))
            result.logprob.append(mean_logprob(totals))
            result.logprob_other_key.append(mean_logprob(control))
            result.prompts.append(len(prompts))
        model.train(was_training)
        return result


def score_prompts(model: nn.Module, prompts: list[PasskeyPrompt], cfg: Config, device: torch.device,
                  dims: ParallelDims) -> torch.Tensor:
    """One forward over prompts of one length: the answer tokens' totals by prompt, [3, prompts]
    (`loss.cross_entropy_by_group`), summed over the cp group when the prompts are split over it."""
    inputs = pad_inputs(probe_inputs(prompts), padded_length(prompts[0].length, dims))
    groups = inputs.pop("token_groups")
    if dims.cp > 1:
        inputs = shard_micro_batch(inputs, dims.cp, dims.cp_rank, cfg.model.doc_masking)
        groups = split_for_context(groups, dims.cp, dims.cp_rank)
    out = forward_micro_batch(model, inputs, cfg, device, dims, token_groups=groups.to(device),
                              num_groups=len(prompts))
    return sum_over_context(out.group_totals, dims).cpu()


def mean_logprob(totals: torch.Tensor) -> float:
    """The mean log-likelihood of an answer token over all prompts."""
    return float(-totals[GROUP_CE].sum() / totals[GROUP_TOKENS].sum())


def probe_lengths(settings: EvalConfig, seq_len: int) -> list[int]:
    """The configured lengths the run can probe: those up to `data.seq_len`."""
    return [n for n in settings.passkey_lengths if n <= seq_len]


def probe_for_run(cfg: Config, dataset_dir: Path) -> PasskeyProbe:
    """The training run's probe (`eval.passkey_every`): its lengths up to `data.seq_len`,
    tokenized by the tokenizer of the run's (first) dataset."""
    tokenizer = Path(dataset_dir) / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise DataError(f"eval.passkey_every: the passkey probe needs the run's tokenizer, and '{tokenizer}' "
                        "is missing; prepare the dataset with its tokenizer.json or set eval.passkey_every=0")
    return PasskeyProbe.from_tokenizer(tokenizer, cfg.eval, probe_lengths(cfg.eval, cfg.data.seq_len))
