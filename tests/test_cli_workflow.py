"""The whole user workflow through the real console script, on a tiny model and corpus:
prepare-data -> train -> resume -> ckpt inspect/verify -> export-hf (loads in transformers) ->
import-hf -> a new run initialised from the import. Each step of the workflow is a fresh
console-script process; the variations of one command (its other options and outputs) call the
same `main` in this process."""

import json
import random

import pytest
import torch

from conftest import cli_in_process, run_cli

from trinity_train.checkpoint import load_model_checkpoint
from trinity_train.cli import main
from trinity_train.files import read_jsonl
from trinity_train.records import EventName, RecordKind

TINY_TOML = """
[model]
vocab_size = 320
hidden_size = 32
num_layers = 4
num_dense_layers = 1
num_heads = 2
num_kv_heads = 1
head_dim = 16
intermediate_size = 64
num_experts = 4
num_experts_per_tok = 2
moe_intermediate_size = 16
sliding_window = 8

[data]
path = "data"
seq_len = 16

[train]
steps = 4
micro_batch_size = 2
grad_accum = 2

[eval]
every = 2
batches = 1

[checkpoint]
every = 2

[metrics]
progress_bar = false
peak_flops = 1e11

[run]
dir = "run"
"""


pytestmark = pytest.mark.slow  # the whole workflow through fresh console-script processes

def cli(*args, cwd, ok=True):
    """The console script, expected to succeed unless told otherwise."""
    return run_cli(*args, cwd=cwd, ok=ok)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A prepared corpus (through `prepare-data`) and a trained tiny run (through `train`)."""
    root = tmp_path_factory.mktemp("cli")
    rng = random.Random(1)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    (root / "docs").mkdir()
    for i in range(30):
        (root / "docs" / f"{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(250)))
    (root / "tiny.toml").write_text(TINY_TOML)
    cli("prepare-data", "--input", "docs", "--out", "data", "--train-tokenizer", "300", "--val-fraction", "0.1",
        "--num-proc", "1", "--no-progress", cwd=root)
    trained = cli("train", "--config", "tiny.toml", cwd=root)
    assert "trained steps 1-4" in trained.stdout
    return root


def test_training_writes_the_run_directory(workdir):
    run = workdir / "run"
    assert {p.name for p in run.iterdir()} >= {"config.toml", "metrics.jsonl", "events.jsonl", "checkpoints"}
    kinds = [(r["kind"], r["step"]) for r in read_jsonl(run / "metrics.jsonl")]
    assert kinds == [("val", 0), ("train", 1), ("train", 2), ("val", 2), ("train", 3), ("train", 4), ("val", 4)]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]


def test_resume_auto_continues_from_the_newest_checkpoint(workdir):
    result = cli("train", "--config", "tiny.toml", "--run.dir=resumed", "--train.steps=2", cwd=workdir)
    assert "trained steps 1-2" in result.stdout
    result = cli("train", "--config", "tiny.toml", "--run.dir=resumed", "--train.steps=3",
                 "--checkpoint.resume=auto", cwd=workdir)
    assert "trained steps 3-3" in result.stdout
    assert [r["step"] for r in read_jsonl(workdir / "resumed" / "metrics.jsonl") if r["kind"] == RecordKind.TRAIN] == [1, 2, 3]
    events = [json.loads(line) for line in (workdir / "resumed" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == EventName.CONFIG_CHANGED and ["train.steps", 2, 3] in e["changes"] for e in events)
    assert any(e["event"] == EventName.RESUME and e["checkpoint"].endswith("step_00000002") for e in events)


def test_ckpt_inspect_and_verify(workdir, monkeypatch, capsys):
    ckpt = "run/checkpoints/step_00000004"
    assert cli("ckpt", "verify", ckpt, cwd=workdir).stdout.startswith(f"ok: {ckpt} is complete and loadable")
    monkeypatch.chdir(workdir)
    assert main(["ckpt", "inspect", ckpt, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 4 and summary["kind"] == "training"
    assert set(summary["components"]) == {"model", "optim", "scheduler", "loader", "guard", "lr_backoff", "trainer",
                                          "rng"}
    assert main(["ckpt", "inspect", ckpt]) == 0
    assert "model: trinity, 4 layers, hidden 32" in capsys.readouterr().out

    data_file = next((workdir / ckpt).glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:-10])  # damage it: the last test of this module
    code, err = cli_in_process(capsys, "ckpt", "verify", ckpt)
    assert code == 1 and err.startswith("error: ") and "truncated" in err


@pytest.fixture(scope="module")
def exported(workdir):
    cli("export-hf", "run/checkpoints/step_00000002", "hf", cwd=workdir)
    return workdir / "hf"


def test_export_hf_loads_in_transformers_with_the_same_logits(workdir, exported):
    from transformers import AfmoeForCausalLM

    ours, _ = load_model_checkpoint(workdir / "run" / "checkpoints" / "step_00000002")
    theirs = AfmoeForCausalLM.from_pretrained(exported).eval()
    tokens = torch.randint(0, 320, (2, 24))  # longer than the sliding window of 8
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.eval()(tokens).logits, atol=1e-4, rtol=0)


def test_export_hf_carries_the_runs_tokenizer(workdir, exported):
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(exported)
    ours = Tokenizer.from_file(str(workdir / "data" / "tokenizer.json"))
    text = "alpha beta gamma delta"
    assert theirs(text)["input_ids"] == ours.encode(text).ids
    assert theirs.decode(theirs(text)["input_ids"]) == text
    config = AutoConfig.from_pretrained(exported)
    assert config.eos_token_id == ours.token_to_id("<|endoftext|>") == theirs.eos_token_id
    assert config.pad_token_id == ours.token_to_id("<|pad|>") == theirs.pad_token_id


def test_export_hf_tokenizer_choices(workdir, monkeypatch, capsys):
    ckpt = "run/checkpoints/step_00000002"
    monkeypatch.chdir(workdir)
    assert cli_in_process(capsys, "export-hf", ckpt, "bare", "--no-tokenizer")[0] == 0
    assert not (workdir / "bare" / "tokenizer.json").exists() and (workdir / "bare" / "config.json").exists()
    # Run from elsewhere, the run's relative data path does not resolve: a warning, no tokenizer.
    monkeypatch.chdir(workdir / "docs")
    code, err = cli_in_process(capsys, "export-hf", workdir / ckpt, workdir / "elsewhere")
    assert code == 0 and "exporting without a tokenizer" in err
    assert not (workdir / "elsewhere" / "tokenizer.json").exists()
    monkeypatch.chdir(workdir)
    assert cli_in_process(capsys, "export-hf", ckpt, "named", "--tokenizer", "data/tokenizer.json")[0] == 0
    assert (workdir / "named" / "tokenizer.json").exists()
    code, err = cli_in_process(capsys, "export-hf", ckpt, "missing", "--tokenizer", "nope.json")
    assert code == 1 and "--tokenizer 'nope.json' is not a file" in err
    assert not (workdir / "missing").exists()


def test_import_hf_gives_a_checkpoint_a_run_can_start_from(workdir, exported):
    result = cli("import-hf", "hf", "--out", "imported", cwd=workdir)
    assert "--checkpoint.init_from=imported" in result.stdout
    original, _ = load_model_checkpoint(workdir / "run" / "checkpoints" / "step_00000002")
    imported, _ = load_model_checkpoint(workdir / "imported")
    for (name, a), (_, b) in zip(original.state_dict().items(), imported.state_dict().items()):
        if name.endswith("bias_momentum"):
            continue  # SMEBU state is not part of the HF format
        assert torch.equal(a, b), name

    result = cli("train", "--config", "tiny.toml", "--run.dir=from_import", "--train.steps=1",
                 "--checkpoint.init_from=imported", cwd=workdir)
    assert "trained steps 1-1" in result.stdout
    events = [json.loads(line)["event"] for line in (workdir / "from_import" / "events.jsonl").read_text().splitlines()]
    assert EventName.INIT_FROM in events
