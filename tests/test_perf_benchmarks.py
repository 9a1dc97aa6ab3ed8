"""The performance benchmarks run end to end on tiny models and report what they promise: the
comparison with transformers (same first loss), the bf16 and MoE ratios, memory that activation
checkpointing lowers, and the GPU MFU script's own code path on the CPU. Nothing here asserts a
speed: the figures come from benchmarks/README.md runs."""

from __future__ import annotations

import json
import re

import pytest

from conftest import ONE_THREAD_ENV, ROOT, last_table, run_python

pytestmark = pytest.mark.slow  # each runs a benchmark script in a subprocess
TINY = ["--model.vocab_size=256", "--model.hidden_size=32", "--model.num_layers=3",
        "--model.num_heads=4", "--model.num_kv_heads=2", "--model.head_dim=8",
        "--model.intermediate_size=64", "--model.num_experts=4", "--model.num_experts_per_tok=2",
        "--model.moe_intermediate_size=16", "--model.sliding_window=8", "--data.seq_len=32",
        "--train.micro_batch_size=2", "--model.loss_chunk_tokens=16", "--train.compile=false"]
# One thread and passive waits (ONE_THREAD_ENV): a shared CPU would otherwise stall tiny ops at
# OpenMP barriers.


def run(script: str, *args: str) -> str:
    return run_python(ROOT / "benchmarks" / script, *args, env=ONE_THREAD_ENV, ok=True).stdout


def test_train_step_benchmark_compares_with_transformers_on_the_same_weights_and_batches():
    out = run("train_step_vs_hf.py", "--data", "random", "--steps", "1", "--probe-repeats", "2",
              "--probe-seconds", "0.02", "--variants", "fp32,bf16", *TINY)
    assert re.search(r"matmul probe float32: peak [\d.]+ GFLOP/s", out)
    assert re.search(r"first-step loss, ours [\d.]+ vs transformers [\d.]+: relative difference "
                     r"\S+ \(agree\)", out), out
    table = last_table(out)
    assert table[0] == ("| model | tokens/s best | tokens/s median | GFLOP/s | MFU | first loss | throughput ratio "
                        "| to |"), out
    row = r"\| {} \| [\d,]+ \| [\d,]+ \| [\d.]+ \| [\d.]+% \| [\d.]+ \| {} \|"
    assert re.fullmatch(row.format(re.escape("transformers (eager experts)"), r" \| "), table[2]), out
    assert re.fullmatch(row.format("ours fp32", r"[\d.]+x \| transformers \(eager experts\)"), table[3]), out
    assert re.fullmatch(row.format("ours bf16", r"[\d.]+x \| ours fp32"), table[4]), out
    assert re.search(r"throughput ours fp32 / transformers \(eager experts\): [\d.]+x", out)
    assert re.search(r"throughput ours bf16 / ours fp32: [\d.]+x", out)
    # Every model ran in a process of its own, labelled by what its config resolved to: TINY turns
    # compilation off, so bf16 is plain bf16 and no variant needed a note.
    assert len(set(re.findall(r"^  .+ \(process (\d+)\): warm-up", out, re.M))) == 3, out
    assert "+compile" not in out and "note:" not in out, out
    assert re.search(r"^# load: [\d.]+ [\d.]+ [\d.]+", out, re.M) and "# load after:" in out, out


def test_train_step_benchmark_labels_a_variant_by_what_its_config_ran():
    out = run("train_step_vs_hf.py", "--data", "random", "--steps", "1", "--warmup", "0", "--no-hf",
              "--probe-repeats", "1", "--probe-seconds", "0.01", "--variants", "bf16", *TINY,
              "--train.activation_checkpointing=true")
    assert "note: variant bf16 runs as bf16+ac" in out, out
    assert re.match(r"\| ours bf16\+ac \| [\d,]+ \| ", last_table(out)[2]), out


def test_train_step_benchmark_compares_losses_of_variants_over_steps():
    out = run("train_step_vs_hf.py", "--data", "random", "--loss-steps", "3",
              "--variants", "fp32,bf16", *TINY)
    table = last_table(out)
    assert table[0].startswith("| variant | first loss | last loss | max relative loss difference to ours fp32 |"), out
    match = re.fullmatch(r"\| ours bf16 \| [\d.]+ \| [\d.]+ \| ([\d.]+)% \| \d \| [\d.]+% \| \d \|", table[3])
    assert match and float(match.group(1)) < 5.0, out


def test_memory_report_shows_activation_checkpointing_saving_activations():
    out = run("train_step_vs_hf.py", "--data", "random", "--memory", "--variants", "fp32,fp32+ac",
              *TINY)
    table = last_table(out)
    assert table[0] == ("| variant | peak RSS MiB | step peak above rest MiB | saved for backward MiB | "
                        "saved for backward, ratio to fp32 |"), out
    rows = {m.group(1): [float(x) for x in m.groups()[1:]]
            for m in map(re.compile(r"\| (\S+) \| ([\d.]+) \| (-?[\d.]+) \| ([\d.]+) \| [\d.]+x \|").fullmatch,
                         table[2:]) if m}
    assert set(rows) == {"fp32", "fp32+ac"}, out
    assert rows["fp32+ac"][2] < rows["fp32"][2]  # bytes saved for backward
    assert all(r[0] > 0 for r in rows.values())


def test_moe_layer_benchmark_reports_the_ratio_to_a_dense_ffn():
    out = run("moe_layer.py", "--repeats", "2", *TINY)
    assert re.search(r"MoE / dense time = [\d.]+", out)
    table = last_table(out)
    assert table[0] == "| layer | best ms of 2 (fwd + bwd) | GFLOP/s | time ratio to dense |", out
    assert re.search(r"^\| MoE \(4 experts, top-2, width 16, 1 shared\) \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", table[2])
    # 3*16 + round(4/3)
    assert re.search(r"^\| dense SwiGLU \(width 49, same active FLOPs\) \| [\d.]+ \| [\d.]+ \| 1\.00x \|$", table[3])


def test_gpu_mfu_benchmark_runs_its_trainer_step_on_the_cpu(tmp_path):
    result = tmp_path / "mfu.json"
    out = run("gpu_mfu.py", "--device", "cpu", "--layers", "2", "--steps", "2", "--warmup", "1",
              "--json", str(result), *(a for a in TINY if "num_layers" not in a),
              "--model.num_dense_layers=1",
              "--optim.name=adamw")
    table = last_table(out)
    assert table[0].startswith("| device | layers | tokens/s (median of 2) | tokens/s (best) | s/step (median) "
                               "| MFU of "), out
    assert re.fullmatch(r"\| cpu \| 2 \| [\d,]+ \| [\d,]+ \| [\d.]+ \| [\d.]+% \| [\d.]+% \| - \|", table[2]), out
    r = json.loads(result.read_text())
    assert r["layers"] == 2 and r["tokens_per_step"] == 64 and 0 < r["mfu"] < 1
    assert r["tokens_per_s"] > 0 and r["flops_per_token"] > 0


def test_components_benchmark_times_each_alternative():
    out = run("components.py", "--repeats", "1", *TINY)
    table = last_table(out)
    assert table[0] == "| comparison | case | best ms (fwd + bwd) | ratio to the comparison's first case |", out
    assert re.fullmatch(r"\| attention of one layer \| local, one dense TxT mask \| [\d.]+ \| 1\.00x \|", table[2]), out
    for case in ("local, one dense TxT mask", "local, window blocks of 4", "fused, chunks of 512",
                 "checkpointed chunks of 64", "per-expert loop", "autograd indexing"):
        assert any(re.fullmatch(rf"\| [^|]+ \| {re.escape(case)}[^|]* \| [\d.]+ \| [\d.]+x \|", row)
                   for row in table[2:]), (case, out)


def test_layer_stats_cost_benchmark_reports_each_interval(corpus):
    tiny = [a for a in TINY if "vocab_size" not in a] + ["--model.vocab_size=320", f"--data.path={corpus}",
                                                         "--data.seq_len=16", "--metrics.layer_stats_every=2"]
    out = run("layer_stats_cost.py", "--pairs", "2", "--rounds", "3", *tiny)
    assert re.search(r"^# load: [\d.]+ [\d.]+ [\d.]+", out, re.M), out
    table = last_table(out)
    assert table[0] == ("| layer_stats_every | clock | % of the step (median) | quartiles, % | "
                        "ms a statistics iteration adds | step ms without | samples |"), out
    figure = r" \| [-+][\d.]+ \| [-+][\d.]+ \.\. [-+][\d.]+ \| -?[\d.]+ \| [\d.]+ \| {} \|"
    assert len(table) == 2 + 4, out
    for interval, samples in ((1, 2), (2, 3)):
        for clock in ("wall clock", "CPU time"):
            assert any(re.fullmatch(rf"\| {interval} \| {clock}" + figure.format(samples), row) for row in table), out
