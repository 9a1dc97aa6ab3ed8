"""Long-context evaluation (docs/guides/long-context-eval.md): the validation loss by position bucket
adds up to the validation loss, the passkey prompts are deterministic and put the key where they
say, and a run's probe (in training and on a checkpoint) writes its record."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import cli_in_process, run_config
from trinity_train import cli
from trinity_train.config import Config, EvalConfig, position_bucket_starts
from trinity_train.data import passkey
from trinity_train.errors import ConfigError
from trinity_train.evaluation.passkey import pad_inputs, padded_length, probe_inputs
from trinity_train.files import read_jsonl
from trinity_train.model.attention import positions_from_documents
from trinity_train.model.loss import (GROUP_CE, GROUP_CORRECT, GROUP_TOKENS, IGNORE_INDEX, chunked_cross_entropy,
                                      cross_entropy_by_group)
from trinity_train.records import RecordKind
from trinity_train.step import evaluate, position_buckets, token_positions
from trinity_train.train import Trainer


# ---------------------------------------------------------------------------- loss by group


def test_a_hand_checked_case_by_position_bucket():
    """Zero hidden states give equal logits: every counted token costs ln 2 out of 2 tokens, and
    the argmax (the first token) is right only where the label is 0."""
    head = torch.nn.Linear(4, 2, bias=False)
    hidden = torch.zeros(8, 4)
    labels = torch.tensor([0, 1, IGNORE_INDEX, 0, 1, 1, 0, 0])
    groups = position_buckets(torch.arange(8), torch.tensor([0, 2, 4]))  # [0, 2), [2, 4), [4, 8)
    assert groups.tolist() == [0, 0, 1, 1, 2, 2, 2, 2]
    ce_sum, tokens, totals = cross_entropy_by_group(hidden, labels, head, 3, groups, 3)
    ln2 = math.log(2)
    assert totals[GROUP_CE].tolist() == pytest.approx([2 * ln2, ln2, 4 * ln2])
    assert totals[GROUP_TOKENS].tolist() == [2, 1, 4]
    assert totals[GROUP_CORRECT].tolist() == [1, 1, 2]
    assert tokens.item() == 7 and ce_sum.item() == pytest.approx(7 * ln2)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_group_sums_add_up_to_the_loss_the_training_path_computes(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden, labels = torch.randn(23, 16), torch.randint(0, 50, (23,))
    labels[[0, 5, 22]] = IGNORE_INDEX
    groups = torch.randint(0, 4, (23,))
    with torch.no_grad():
        expected, expected_tokens = chunked_cross_entropy(hidden, labels, head, chunk)
        ce_sum, tokens, totals = cross_entropy_by_group(hidden, labels, head, chunk, groups, 4)
    assert torch.equal(ce_sum, expected) and torch.equal(tokens, expected_tokens)  # the same sum, bit for bit
    assert totals[GROUP_CE].sum().item() == pytest.approx(expected.item(), rel=1e-6)
    per_token = F.cross_entropy(head(hidden), labels, ignore_index=IGNORE_INDEX, reduction="none")
    for g in range(4):
        mine = groups == g
        assert totals[GROUP_CE, g].item() == pytest.approx(per_token[mine].sum().item(), rel=1e-5, abs=1e-6)
        assert totals[GROUP_TOKENS, g].item() == ((labels != IGNORE_INDEX) & mine).sum().item()


def test_the_model_refuses_groups_where_gradients_are_taken():
    from trinity_train.model.transformer import build_model
    from conftest import tiny_model

    model = build_model(tiny_model())
    ids = torch.randint(0, 64, (1, 16))
    with pytest.raises(ValueError, match="for evaluation"):
        model(ids, labels=ids, token_groups=torch.zeros_like(ids), num_groups=1)


def test_default_buckets_are_powers_of_two_below_the_sequence_length():
    assert position_bucket_starts(EvalConfig(), 256) == [0, 64, 128]
    assert position_bucket_starts(EvalConfig(), 4096) == [0, 64, 128, 256, 512, 1024, 2048]
    assert position_bucket_starts(EvalConfig(), 16) == [0]
    assert position_bucket_starts(EvalConfig(position_buckets=[0, 100, 1000]), 256) == [0, 100, 1000]


def test_positions_are_within_the_document_with_document_masking():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    mb = {"input_ids": torch.zeros_like(docs), "document_ids": docs}
    assert token_positions(mb, doc_masking=True).tolist() == positions_from_documents(docs).tolist()
    assert token_positions(mb, doc_masking=True).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert token_positions(mb, doc_masking=False).tolist() == [list(range(8))]
    given = torch.arange(8)[None] + 100  # a rank's global positions (context parallelism) are taken as given
    assert token_positions({**mb, "position_ids": given}, doc_masking=True) is given


@pytest.mark.parametrize("doc_masking", [False, True])
def test_validation_by_position_adds_up_to_the_validation_loss(corpus, tmp_path, doc_masking):
    cfg = run_config(corpus, tmp_path / "run", model={"doc_masking": doc_masking},
                     train={"micro_batch_size": 2}, eval={"batches": 3, "position_buckets": [0, 3, 8]})
    trainer = Trainer(cfg)
    val = evaluate(trainer.model, trainer.val_loader, cfg, trainer.device)
    assert val.position_starts == [0, 3, 8]
    assert sum(val.tokens_by_position) == val.tokens > 0
    total = sum(loss * n for loss, n in zip(val.loss_by_position, val.tokens_by_position))
    assert total / val.tokens == pytest.approx(val.loss, rel=1e-6)  # fp32 sums in another order
    # each bucket holds the tokens whose loader position (in the document with masking) falls in it
    positions = np.concatenate([b.position_ids.numpy().ravel() for b in trainer.val_loader.batches(3)])
    assert val.tokens_by_position == [int(((positions >= lo) & (positions < hi)).sum())
                                      for lo, hi in ((0, 3), (3, 8), (8, 10 ** 9))]


# ---------------------------------------------------------------------------- passkey prompts


def chars(text: str) -> list[int]:
    """A tokenizer with one token per character: positions are easy to read back."""
    return [ord(c) for c in text]


def text_of(tokens: list[int]) -> str:
    return "".join(map(chr, tokens))


@pytest.mark.parametrize("template", ["prose", "code"])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_a_passkey_prompt_holds_the_key_where_it_says(depth, template):
    words = passkey.TEMPLATES[template]
    prompt = passkey.passkey_prompt(chars, 1000, depth, "12345", template)
    assert len(prompt.tokens) == 1001  # the input and the key's last token
    needle = words.needle.format(key="12345")
    assert text_of(prompt.tokens[prompt.needle_start:prompt.needle_start + len(needle)]) == needle
    assert text_of(prompt.tokens).startswith(words.intro)
    assert text_of(prompt.tokens).endswith(words.question + " 12345")
    assert text_of(prompt.answer_tokens) == " 12345"
    filler = 1001 - len(words.intro) - len(needle) - len(words.question) - len(" 12345")
    assert prompt.needle_start == len(words.intro) + round(depth * filler)
    # the question ends with the words that come before the key in the needle: what a copy finds
    assert needle.split("12345")[0].rstrip().endswith(words.question.split("?")[-1].strip())


def test_every_configurable_template_has_its_words():
    from trinity_train.config import PASSKEY_TEMPLATES

    assert set(passkey.TEMPLATES) == set(PASSKEY_TEMPLATES)


def test_passkey_prompts_are_the_same_every_time_and_differ_by_key():
    first = passkey.passkey_prompts(chars, [300, 600], [0.1, 0.9], keys=2)
    again = passkey.passkey_prompts(chars, [300, 600], [0.1, 0.9], keys=2)
    assert first == again and list(first) == [300, 600] and all(len(p) == 4 for p in first.values())
    keys = [p.key for prompts in first.values() for p in prompts]
    assert len(set(keys)) == len(keys) and all(len(k) == 5 and k.isdigit() for k in keys)
    assert passkey.passkey_key(300, 0.1, 0) == "".join(first[300][0].key)  # the documented seed


@pytest.mark.parametrize("template", ["prose", "code"])
def test_a_control_prompt_hides_another_key_and_asks_for_the_same(template):
    prompts = passkey.passkey_prompts(chars, [300, 600], [0.1, 0.9], keys=2, template=template)
    controls = passkey.passkey_prompts(chars, [300, 600], [0.1, 0.9], keys=2, template=template, controls=True)
    used = {p.key for ps in prompts.values() for p in ps}
    for length in prompts:
        for prompt, control in zip(prompts[length], controls[length]):
            needle = passkey.TEMPLATES[template].needle
            hidden = text_of(control.tokens[control.needle_start:control.needle_start + len(needle.format(key="00000"))])
            assert len(control.tokens) == len(prompt.tokens) and control.key == prompt.key
            assert control.answer_tokens == prompt.answer_tokens  # the same key scored ...
            assert prompt.key in text_of(prompt.tokens[prompt.needle_start:prompt.answer_start])
            assert prompt.key not in hidden and hidden != needle.format(key=prompt.key)  # ... another hidden
            assert not any(k in hidden for k in used)  # a key no prompt of the probe asks for


def test_a_length_too_short_for_the_prompt_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"eval.passkey_lengths: 50 tokens cannot hold the passkey prompt"):
        passkey.passkey_prompt(chars, 50, 0.5, "12345")


def test_probe_inputs_label_only_the_answer():
    prompts = passkey.passkey_prompts(chars, [300], [0.5], keys=2)[300]
    inputs = probe_inputs(prompts)
    assert inputs["input_ids"].shape == (2, 300)
    for row, p in enumerate(prompts):
        counted = (inputs["labels"][row] != IGNORE_INDEX).nonzero().ravel().tolist()
        assert counted == list(range(p.answer_start - 1, 300))
        # position t is labelled with token t+1: the answer's digits
        assert text_of(inputs["labels"][row, counted].tolist()) == " " + p.key
        assert inputs["token_groups"][row].unique().tolist() == [row]


def test_prompts_are_padded_to_what_the_layout_splits_a_row_into():
    from trinity_train.parallel.mesh import ParallelDims

    assert padded_length(254, ParallelDims.one_process()) == 254
    assert padded_length(254, ParallelDims(1, 1, 1, 1, 2, cp=2)) == 256  # 2 x cp zigzag chunks
    assert padded_length(256, ParallelDims(1, 1, 1, 1, 2, cp=2)) == 256
    assert padded_length(250, ParallelDims(1, 1, 2, 1, 4, cp=2)) == 256  # each chunk split again by tp
    assert padded_length(251, ParallelDims(1, 1, 2, 1, 2)) == 252


def test_padding_at_the_end_leaves_the_scores_unchanged():
    """No earlier position attends to the trailing pad tokens and they have no labels."""
    from conftest import tiny_model
    from trinity_train.model.transformer import build_model

    torch.manual_seed(0)
    model = build_model(tiny_model(vocab_size=128)).eval()
    def words(text: str) -> list[int]:  # one token a word: the prompt fits 62 tokens, the key is one
        return [sum(map(ord, word)) % 128 for word in text.split()]

    prompts = passkey.passkey_prompts(words, [62], [0.2, 0.8], keys=1)[62]
    inputs = probe_inputs(prompts)
    padded = pad_inputs(inputs, 64)
    assert padded["input_ids"].shape == (2, 64) and (padded["labels"][:, 62:] == IGNORE_INDEX).all()
    assert padded["position_ids"][:, 62:].tolist() == [[62, 63]] * 2
    assert torch.equal(padded["token_groups"][:, 62:], inputs["token_groups"][:, -2:])
    with torch.no_grad():
        totals = [model(b["input_ids"], labels=b["labels"], position_ids=b["position_ids"],
                        document_ids=b["document_ids"], token_groups=b["token_groups"], num_groups=2).group_totals
                  for b in (inputs, padded)]
    assert totals[1][GROUP_TOKENS].tolist() == totals[0][GROUP_TOKENS].tolist() == [1, 1]
    assert torch.allclose(totals[1], totals[0], rtol=1e-6)


# ---------------------------------------------------------------------------- a run's probe


def probe_run_config(corpus, run_dir, parallel: dict | None = None, **probe):
    return run_config(corpus, run_dir, data={"seq_len": 256}, parallel=parallel or {},
                      train={"steps": 2, "micro_batch_size": 2}, checkpoint={"every": 2},
                      eval={"every": 1, "batches": 1, "passkey_every": 2, "passkey_lengths": [256, 512],
                            "passkey_depths": [0.25, 0.75], **probe})


def test_a_tiny_runs_probe_writes_its_record_and_the_command_probes_its_checkpoint(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(probe_run_config(corpus, run)).run()
    metrics = read_jsonl(run / "metrics.jsonl")
    probes = [r for r in metrics if r["kind"] == RecordKind.PASSKEY]
    assert [r["step"] for r in probes] == [0, 2]  # every 2 steps at validation (eval_every 1)
    for r in probes:
        assert r["passkey_lengths"] == [256] and r["passkey_prompts"] == [4]  # 512 is beyond data.seq_len
        assert 0 <= r["passkey_accuracy"][0] <= 1 and r["passkey_logprob"][0] < 0
        assert r["passkey_logprob_other_key"][0] < 0 and r["passkey_logprob_other_key"][0] != r["passkey_logprob"][0]
    vals = [r for r in metrics if r["kind"] == RecordKind.VAL]
    assert all(v["val_position_starts"] == [0, 64, 128] and len(v["val_loss_by_position"]) == 3 for v in vals)

    capsys.readouterr()  # the run's console lines
    code = cli.main(["probe-context", "--run", str(run), "--lengths", "256,300", "--device", "cpu", "--json",
                     "--out", str(tmp_path / "probe.json")])
    out = capsys.readouterr()
    assert code == 0, out.err
    printed = json.loads(out.out)
    assert printed == json.loads((tmp_path / "probe.json").read_text())
    assert printed["step"] == 2 and printed["passkey_lengths"] == [256, 300] and printed["passkey_prompts"] == [4, 4]
    assert printed["template"] == "prose"  # the run's eval.passkey_template
    # the checkpoint holds the weights the run's last probe scored
    assert printed["passkey_logprob"][0] == pytest.approx(probes[-1]["passkey_logprob"][0], rel=1e-5)

    code = cli.main(["probe-context", "--run", str(run), "--lengths", "256", "--device", "cpu", "--json",
                     "--template", "code"])
    code_prompts = json.loads(capsys.readouterr().out)
    assert code == 0 and code_prompts["template"] == "code"
    assert code_prompts["passkey_logprob"][0] != printed["passkey_logprob"][0]  # other prompts, other scores


def test_probe_context_errors_are_one_line(corpus, tmp_path, capsys):
    from conftest import run_config as base

    Trainer(base(corpus, tmp_path / "empty", train={"steps": 1}, checkpoint={"every": 0})).run()
    capsys.readouterr()  # the run's console lines
    code, err = cli_in_process(capsys, "probe-context", "--run", tmp_path / "empty")
    assert code == 1 and err.startswith("error: RUN_DIR") and "has no sound checkpoint" in err and err.count("\n") == 1
    code, err = cli_in_process(capsys, "probe-context", "--run", tmp_path / "empty", "--out", tmp_path)
    assert code == 2 and f"--out '{tmp_path}' is a directory" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error
        cli.main(["probe-context", "--run", str(tmp_path / "empty"), "--lengths", "12,x"])
    assert exit_.value.code == 2 and "expected comma-separated positive token counts" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    ({"position_buckets": [64, 128]}, "eval.position_buckets: must be the first position of each bucket"),
    ({"position_buckets": [0, 64, 64]}, "eval.position_buckets"),
    ({"passkey_every": -1}, "eval.passkey_every: must be >= 0"),
    ({"passkey_depths": [1.5]}, "eval.passkey_depths: must be fractions"),
    ({"passkey_template": "poetry"}, "eval.passkey_template: must be one of prose, code, got 'poetry'"),
    ({"passkey_every": 10, "passkey_lengths": [4096]}, "eval.passkey_lengths: none of [4096] is at most data.seq_len=256"),
])
def test_bad_long_context_settings_are_refused(overrides, message):
    from trinity_train.config import load_config

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, {"eval": overrides})
    assert Config().eval.passkey_every == 0  # off unless a config turns it on


def test_sinks_name_each_bucket_and_length_by_its_value():
    from trinity_train.observe.scalars import named_values
    from trinity_train.records import passkey_record, val_record

    val = val_record(iter=5, step=5, val_loss=3.0, val_ppl=20.0, val_tokens=30, val_position_starts=[0, 64],
                     val_loss_by_position=[3.5, 2.5], val_tokens_by_position=[10, 20])
    scalars, _ = named_values(val, "val")
    assert scalars == {"val/val_loss": 3.0, "val/val_ppl": 20.0, "val/val_tokens": 30.0,
                       "val/val_loss_by_position/0": 3.5, "val/val_loss_by_position/64": 2.5,
                       "val/val_tokens_by_position/0": 10.0, "val/val_tokens_by_position/64": 20.0}
    probe = passkey_record(iter=5, step=5, passkey_lengths=[128, 256], passkey_accuracy=[1.0, 0.5],
                           passkey_logprob=[-0.1, -0.7], passkey_logprob_other_key=[-5.0, -6.0], passkey_prompts=[6, 6])
    scalars, _ = named_values(probe, "passkey")
    assert scalars["passkey/passkey_accuracy/256"] == 0.5 and "passkey/passkey_lengths/0" not in scalars
    assert scalars["passkey/passkey_logprob_other_key/128"] == -5.0


# ---------------------------------------------------------------------------- on several ranks

# The long-context evaluation of the layout tests' model (conftest.layout_config) at 256 tokens.
# Under cp 2 each prompt is split zigzag (chunks of 64 at 256, the 7-token halo of the 8-token
# window crossing ranks) and the 254-token prompts are padded to 256.
LONG_CONTEXT = {"data": {"seq_len": 256},
                "eval": {"passkey_every": 1, "passkey_lengths": [256, 254], "passkey_keys": 1}}
RANK_LAYOUTS = {"fsdp2": {"parallel": {"dp_shard": 2}}, "tp2": {"parallel": {"tp": 2}}, "ep2": {"parallel": {"ep": 2}},
                "cp2": {"parallel": {"cp": 2}}}


def evaluate_long_context(corpus, root, layouts: dict) -> dict:
    """In each rank (or one process): {layout: (Validation, PasskeyResult, the tokens a row of each
    of the probe's forwards held on this rank: a length's prompts, then their controls)} of the
    untrained model."""
    import torch.distributed as dist

    from conftest import layout_config, merge_sections
    from trinity_harness.ranks import rank_trainer

    world = dist.get_world_size() if dist.is_initialized() else 1
    results = {}
    for name, changes in layouts.items():
        cfg = layout_config(corpus, root / name, merge_sections(LONG_CONTEXT, changes), world)
        trainer = rank_trainer(cfg) if world > 1 else Trainer(cfg)
        val = evaluate(trainer.model, trainer.val_loader, cfg, trainer.device, trainer.dims)
        widths = []
        hook = trainer.model.register_forward_pre_hook(lambda _, args: widths.append(args[0].shape[1]))
        probe = trainer.passkey.run(trainer.model, cfg, trainer.device, trainer.dims)
        hook.remove()
        results[name] = (val, probe, widths)
    return results


@pytest.mark.slow
def test_data_tensor_expert_and_context_parallel_ranks_evaluate_as_one_process(corpus, tmp_path, rank_pool):
    from helpers import assert_values_close

    (reference_val, reference_probe, widths), = evaluate_long_context(corpus, tmp_path / "one", {"one": {}}).values()
    assert sum(reference_val.tokens_by_position) == reference_val.tokens > 0
    assert widths == [256, 256, 254, 254] and reference_probe.lengths == [256, 254]  # prompts, then controls
    for rank, results in enumerate(rank_pool(2).run(evaluate_long_context, corpus, tmp_path / "two", RANK_LAYOUTS)):
        for layout, (val, probe, widths) in results.items():
            where = f"rank {rank} {layout}"
            # cp 2 holds half of each prompt, the 254-token ones padded to 256 first
            assert widths == ([128] * 4 if layout == "cp2" else [256, 256, 254, 254]), where
            assert val.tokens_by_position == reference_val.tokens_by_position, where  # the buckets summed over ranks
            assert_values_close(vars(val), vars(reference_val), rel=1e-5, path=where)
            assert_values_close(vars(probe), vars(reference_probe), rel=1e-5, path=where)


def cp2_probe_run(corpus, run_dir) -> int:
    import torch.distributed as dist

    from trinity_harness.ranks import rank_trainer

    rank_trainer(probe_run_config(corpus, run_dir, parallel={"cp": 2})).run()
    dist.barrier()
    return dist.get_rank()


@pytest.mark.slow
def test_a_cp_runs_probe_splits_its_prompts_and_the_command_probes_its_checkpoint_in_one_process(
        corpus, tmp_path, rank_pool, capsys):
    """The probe at validation of a cp = 2 run scores the split prompts as one process scores the
    step-2 checkpoint's weights whole (`probe-context` loads a checkpoint of any layout into one
    process)."""
    run = tmp_path / "cp2"
    rank_pool(2).run(cp2_probe_run, corpus, run)
    probes = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == RecordKind.PASSKEY]
    assert [r["step"] for r in probes] == [0, 2] and probes[-1]["passkey_lengths"] == [256]
    capsys.readouterr()
    assert cli.main(["probe-context", "--run", str(run), "--lengths", "256", "--device", "cpu", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["step"] == 2 and printed["passkey_prompts"] == probes[-1]["passkey_prompts"] == [4]
    assert printed["passkey_accuracy"] == probes[-1]["passkey_accuracy"]
    assert printed["passkey_logprob"][0] == pytest.approx(probes[-1]["passkey_logprob"][0], rel=1e-5)
