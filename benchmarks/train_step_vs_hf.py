"""Training-step throughput of trinity-train against Hugging Face `transformers`' AfmoeForCausalLM.

Both models start from the same weights (ours exported through `trinity_train.interop.hf.save_hf`
and loaded with `AfmoeForCausalLM.from_pretrained`), take the same batches and the same optimizer
(`build_optimizer` from the config), and run forward + backward + clip + optimizer step. Each
model lives in a fresh process of its own (this script with `--one-variant`), so no compilation,
cache or allocator state of one variant reaches the next; the processes take their timed steps in
turn, the order rotating every step, so that a shared machine slows each of them alike. For each it
prints tokens/s (best of the timed steps, median alongside), model FLOP/s from the trainer's
accounting (`training_flops_per_token`) and MFU against a matmul probe measured in the same run
(best of many repetitions at the model's own GEMM shapes and at a large square, in the variant's
dtype), and `/proc/loadavg` before and after. Our variants are named like `fp32`, `bf16`,
`fp32+compile`, `bf16+ac` (activation checkpointing); a variant adds its flags to the config's, and
every row is labelled by what its config resolved to: `bf16` under a config with
train.compile=true (configs/bench_cpu.toml) runs and is labelled as bf16+compile, with a note
(pass --train.compile=false to let the variants decide). Ratios: each bf16 variant against the
fp32 one of the same flags where both ran, the others against the first fp32 variant.

    python benchmarks/train_step_vs_hf.py [--config configs/bench_cpu.toml] [--steps 3]
        [--variants fp32,bf16] [--hf-experts eager] [--no-hf] [--data corpus|random]
        [--loss-steps 100 | --memory | --profile 25] [--a.b=value ...]

--loss-steps N trains every variant for N steps on the same batches and reports how far the
losses of each are from the first variant's; --memory reports the peak memory of each variant
(every one measured alone in a fresh process); --profile prints the busiest operators of a step.
Threads: torch's default (all cores); set OMP_NUM_THREADS to change it.
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: on a shared CPU, threads that spin at every barrier while a core is
# taken stall each operator (steps measured 2-10x slower and erratic on the 2-core machine of
# benchmarks/README.md). Set OMP_WAIT_POLICY=ACTIVE to measure the spinning default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from measure import Timings, matmul_probe, model_gemm_shapes, step_flops, timed
from trinity_harness.jobs import loadavg
from trinity_harness.table import markdown_table, ratio
from trinity_train.config import Config, load_config
from trinity_train.data import build_loaders
from trinity_train.model import build_model
from trinity_train.interop.hf import save_hf
from trinity_train.optim.groups import build_optimizer
from trinity_train.train import build_model_for_training

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "bench_cpu.toml"
REQUIRED_FIRST_LOSS_AGREEMENT = 1e-3  # relative, fp32 against fp32
LOSS_AGREEMENT = 0.01  # relative, per step, of a variant's losses against the first variant's
VARIANT_FLAGS = {"compile": "train.compile", "ac": "train.activation_checkpointing"}
HF = "hf"  # --one-variant's name for the transformers model


# ---------------------------------------------------------------------------- variants and data


def variant_overrides(name: str) -> dict:
    """`bf16+compile+ac` -> {"train": {"dtype": "bf16", "compile": True, ...}}."""
    dtype, *flags = name.split("+")
    if dtype not in ("fp32", "bf16") or any(f not in VARIANT_FLAGS for f in flags):
        raise SystemExit(f"error: variant '{name}' must be fp32 or bf16, optionally followed by "
                         f"+{' +'.join(VARIANT_FLAGS)} (e.g. bf16+compile)")
    train = {"dtype": dtype, **{VARIANT_FLAGS[f].split(".")[1]: True for f in flags}}
    return {"train": train}


def variant_config(args: argparse.Namespace, overrides: list[str], variant: str) -> Config:
    cfg = load_config(args.config, overrides)
    extra = variant_overrides(variant)["train"]
    for key, value in extra.items():
        setattr(cfg.train, key, value)
    return cfg


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor


def batches(cfg: Config, source: str, count: int) -> list[Batch]:
    """`count` global batches of this process: real text from the configured dataset (the
    default corpus unless data.path is set) or uniform random tokens."""
    if source == "random":
        generator = torch.Generator().manual_seed(cfg.data.seed)
        rows = cfg.train.micro_batch_size * cfg.train.grad_accum
        out = []
        for _ in range(count):
            tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.data.seq_len + 1),
                                   generator=generator)
            out.append(Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        return out
    loader, _ = build_loaders(cfg)
    return [Batch(b.input_ids.contiguous(), b.labels.contiguous())
            for b in (loader.next_batch() for _ in range(count))]


def micro_batches(batch: Batch, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for start in range(0, batch.input_ids.shape[0], size):
        yield batch.input_ids[start:start + size], batch.labels[start:start + size]


# ---------------------------------------------------------------------------- training steps


class Trainee:
    """One model with its optimizer and a `step(batch) -> mean loss` like the trainer's.

    `loss_fn(model, input_ids, labels) -> (summed cross entropy, expert counts or None)`; the
    counts of a step feed `update_expert_biases` after the optimizer step, as in the trainer.
    """

    def __init__(self, name: str, model: torch.nn.Module, cfg: Config, loss_fn: Callable):
        self.name, self.model, self.cfg, self.loss_fn = name, model, cfg, loss_fn
        self.optimizer = build_optimizer(model, cfg.optim)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def autocast(self):
        if self.cfg.train.dtype == "bf16":
            return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self, batch: Batch) -> float:
        tokens = (batch.labels != -100).sum().clamp_min(1)
        total, counts = 0.0, None
        for input_ids, labels in micro_batches(batch, self.cfg.train.micro_batch_size):
            with self.autocast():
                ce_sum, step_counts = self.loss_fn(self.model, input_ids, labels)
            (ce_sum / tokens).backward()
            total += float(ce_sum.detach())
            if step_counts is not None:
                counts = step_counts if counts is None else counts + step_counts
        if self.cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip)
        self.optimizer.step()
        if counts is not None:
            self.model.update_expert_biases(counts)
        self.optimizer.zero_grad(set_to_none=True)
        return total / float(tokens)


def ours_loss(model, input_ids, labels):
    out = model(input_ids, labels=labels)
    return out.ce_sum, out.tokens_per_expert


def hf_loss(model, input_ids, labels):
    # `shift_labels`: our labels are already the next tokens. The loss is the mean over counted
    # labels; times their number it is the sum, like ours.
    out = model(input_ids=input_ids, labels=labels, shift_labels=labels, use_cache=False)
    return out.loss * (labels != -100).sum(), None


def build_ours(cfg: Config) -> Trainee:
    model = build_model_for_training(cfg, torch.device("cpu"))  # seeded by train.seed, wrapped
    return Trainee(f"ours {variant_name(cfg)}", model, cfg, ours_loss)


def variant_name(cfg: Config) -> str:
    flags = [f for f, key in VARIANT_FLAGS.items() if getattr(cfg.train, key.split(".")[1])]
    return "+".join([cfg.train.dtype, *flags])


def build_hf(cfg: Config, experts: str) -> Trainee:
    import transformers

    torch.manual_seed(cfg.train.seed)
    ours = build_model(cfg.model)  # the same draw as build_model_for_training
    with tempfile.TemporaryDirectory() as tmp:
        out = save_hf(ours, Path(tmp) / "hf")
        model = transformers.AfmoeForCausalLM.from_pretrained(
            out, dtype=torch.float32, attn_implementation="sdpa", experts_implementation=experts)
    model.train()
    return Trainee(f"transformers ({experts} experts)", model, cfg, hf_loss)


# ---------------------------------------------------------------------------- reports


def note_resolved_variants(variants: list[str], configs: list[Config]) -> None:
    """Say where the config turned on more than a variant names (its label says what ran)."""
    for variant, cfg in zip(variants, configs):
        if set(variant.split("+")) != set(variant_name(cfg).split("+")):
            print(f"note: variant {variant} runs as {variant_name(cfg)} (the config's train "
                  f"settings; --train.compile=false --train.activation_checkpointing=false "
                  f"leave them to the variants)")


class StepProcess:
    """One model in a fresh process of its own (`one_variant`): built and warmed up on start,
    then `step(i)` times a step on batch i there. `name` is the label the process reports."""

    def __init__(self, args: argparse.Namespace, overrides: list[str], variant: str, cfg: Config):
        self.cfg, self.timings = cfg, Timings()
        command = [sys.executable, __file__, "--config", str(args.config), "--data", args.data,
                   "--variants", args.variants, "--hf-experts", args.hf_experts,
                   "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--one-variant", variant, *overrides]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.name = variant
        ready = self._reply()
        self.name, self.losses, self.pid = ready["name"], ready["warmup_losses"], ready["pid"]

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"error: the process of {self.name} exited ({self.process.wait()})")
        return json.loads(line)

    def step(self, i: int) -> float:
        self.process.stdin.write(f"{i}\n")
        self.process.stdin.flush()
        reply = self._reply()
        self.timings.add(reply["seconds"])
        self.losses.append(reply["loss"])
        return reply["loss"]

    def close(self) -> None:
        self.process.stdin.close()  # the process ends at the end of its input
        self.process.wait()


def one_variant(args: argparse.Namespace, overrides: list[str]) -> int:
    """In a fresh process (`StepProcess`): build one model and take the warm-up steps, then time
    a step for each batch index read from stdin. Replies are JSON lines on stdout."""
    replies, sys.stdout = sys.stdout, sys.stderr  # what torch or we print must not mix with them
    base = variant_config(args, overrides, args.variants.split(",")[0])
    trainee = (build_hf(base, args.hf_experts) if args.one_variant == HF
               else build_ours(variant_config(args, overrides, args.one_variant)))
    data = batches(trainee.cfg, args.data, args.warmup + args.steps)

    def reply(**fields) -> None:
        print(json.dumps(fields), file=replies, flush=True)

    # compilation, allocation, first-call overheads
    reply(name=trainee.name, pid=os.getpid(), warmup_losses=[trainee.step(b) for b in data[:args.warmup]])
    for line in sys.stdin:
        seconds, loss = timed(lambda: trainee.step(data[int(line)]), torch.device("cpu"))
        reply(seconds=seconds, loss=loss)
    return 0


def report_throughput(args: argparse.Namespace, overrides: list[str]) -> int:
    variants = args.variants.split(",")
    configs = [variant_config(args, overrides, v) for v in variants]
    base = configs[0]
    flops = step_flops(base)
    tokens = base.train.micro_batch_size * base.train.grad_accum * base.data.seq_len
    print(f"# load: {loadavg()}")
    print(f"config {args.config}: {tokens} tokens/step, {flops / tokens / 1e6:.2f} MFLOP/token "
          f"(training_flops_per_token) = {flops / 1e9:.1f} GFLOP/step; {args.data} batches; "
          f"{torch.get_num_threads()} threads; each model in its own process")
    note_resolved_variants(variants, configs)

    shapes = model_gemm_shapes(base.model, base.train.micro_batch_size * base.data.seq_len,
                               base.model.loss_chunk_tokens)
    probes = {dtype: matmul_probe(shapes, dtype, torch.device("cpu"), args.probe_repeats,
                                  args.probe_seconds)
              for dtype in {torch.bfloat16 if c.train.dtype == "bf16" else torch.float32
                            for c in configs} | {torch.float32}}
    for probe in probes.values():
        print(probe.describe())

    # One at a time up to the end of the warm-up, so that compilations do not overlap.
    runs = [] if args.no_hf else [StepProcess(args, overrides, HF, base)]
    runs += [StepProcess(args, overrides, v, cfg) for v, cfg in zip(variants, configs)]
    for run in runs:
        print(f"  {run.name} (process {run.pid}): warm-up losses {' '.join(f'{x:.6f}' for x in run.losses) or 'none'}",
              flush=True)
    for i in range(args.warmup, args.warmup + args.steps):
        turn = i % len(runs)
        for run in runs[turn:] + runs[:turn]:
            loss = run.step(i)
            print(f"  step {i} {run.name}: loss {loss:.6f}, {run.timings.seconds[-1]:.2f} s", flush=True)
    for run in runs:
        run.close()

    ok = True
    ours = runs if args.no_hf else runs[1:]
    fp32 = next((run for run in ours if run.cfg.train.dtype == "fp32"), None)
    against: dict[str, tuple[str, str]] = {}  # a run's throughput ratio, and to which run
    if not args.no_hf and fp32 is not None:
        hf = runs[0]
        print(f"\nthroughput {fp32.name} / {hf.name}: {hf.timings.best / fp32.timings.best:.1f}x")
        against[fp32.name] = (ratio(hf.timings.best, fp32.timings.best, 1), hf.name)
        diff = abs(fp32.losses[0] - hf.losses[0]) / hf.losses[0]
        agree = diff <= REQUIRED_FIRST_LOSS_AGREEMENT
        ok &= agree
        print(f"first-step loss, ours {fp32.losses[0]:.6f} vs transformers {hf.losses[0]:.6f}: "
              f"relative difference {diff:.1e} {'(agree)' if agree else 'DISAGREE'}")
    if fp32 is not None:
        for run in ours:
            # bf16 against fp32 of the same flags where that ran too, else against the first fp32
            twin = next((r for r in ours if r.name == run.name.replace("bf16", "fp32", 1)), fp32)
            reference = fp32 if twin is run else twin
            if run is not reference:
                print(f"throughput {run.name} / {reference.name}: "
                      f"{reference.timings.best / run.timings.best:.2f}x")
                against[run.name] = (ratio(reference.timings.best, run.timings.best), reference.name)
    print(f"# load after: {loadavg()}")
    rows = []
    for run in runs:
        dtype = torch.bfloat16 if run.cfg.train.dtype == "bf16" else torch.float32
        achieved = flops / run.timings.best
        rows.append([run.name, f"{tokens / run.timings.best:,.0f}", f"{tokens / run.timings.median:,.0f}",
                     f"{achieved / 1e9:.1f}", f"{achieved / probes[dtype].peak:.1%}", f"{run.losses[0]:.6f}",
                     *against.get(run.name, ("", ""))])
    print()
    print(markdown_table(["model", "tokens/s best", "tokens/s median", "GFLOP/s", "MFU", "first loss",
                          "throughput ratio", "to"], rows))
    return 0 if ok else 1


def report_profile(args: argparse.Namespace, overrides: list[str]) -> int:
    """Where a step's time goes: torch.profiler's busiest operators of one step per variant."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for variant in args.variants.split(","):
        cfg = variant_config(args, overrides, variant)
        data = batches(cfg, args.data, 2)
        trainee = build_ours(cfg)
        trainee.step(data[0])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainee.step(data[1])
        print(f"{trainee.name}, one step:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile,
                                        max_name_column_width=60))
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:args.profile]
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
        rows += [[trainee.name, e.key, f"{e.self_cpu_time_total / 1e3:.2f}",
                  f"{100 * e.self_cpu_time_total / max(total, 1e-9):.1f}%", e.count] for e in events]
    print(markdown_table(["variant", "operator", "self CPU ms", "of the step's self CPU", "calls"], rows))
    return 0


def report_loss_agreement(args: argparse.Namespace, overrides: list[str]) -> int:
    """Train every variant for --loss-steps steps on the same batches; compare to the first."""
    variants = args.variants.split(",")
    configs = [variant_config(args, overrides, v) for v in variants]
    data = batches(configs[0], args.data, args.loss_steps)
    losses = []
    for cfg in configs:
        trainee = build_ours(cfg)
        losses.append((trainee.name, [trainee.step(b) for b in data]))
        print(f"{trainee.name}: losses {losses[-1][1][0]:.4f} -> {losses[-1][1][-1]:.4f}", flush=True)
    reference_name, reference = losses[0]
    rows = [[reference_name, f"{reference[0]:.4f}", f"{reference[-1]:.4f}", "(the reference)", "", "", ""]]
    for name, values in losses[1:]:
        rel = [abs(a - b) / abs(b) for a, b in zip(values, reference)]
        worst = max(range(len(rel)), key=rel.__getitem__)
        rows.append([name, f"{values[0]:.4f}", f"{values[-1]:.4f}", f"{rel[worst]:.2%}", worst,
                     f"{sum(rel) / len(rel):.2%}", sum(r > LOSS_AGREEMENT for r in rel)])
    print(f"{args.loss_steps} steps on the same batches, each variant against {reference_name}")
    print(markdown_table(["variant", "first loss", "last loss", f"max relative loss difference to {reference_name}",
                          "at step", "mean relative difference", f"steps above {LOSS_AGREEMENT:.0%}"], rows))
    return 0


# ---------------------------------------------------------------------------- memory


def _rss_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field_name} missing from /proc/self/status")


def memory_child(args: argparse.Namespace, overrides: list[str]) -> int:
    """In a fresh process: peak resident memory of one training step, and the activations
    autograd holds for backward at the end of the forward."""
    cfg = variant_config(args, overrides, args.memory_child)
    data = batches(cfg, args.data, 2)
    trainee = build_ours(cfg)
    trainee.step(data[0])  # optimizer state exists from here on, as in a long run
    before_kib = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak, to the current RSS
    trainee.step(data[1])
    peak_kib = _rss_kib("VmHWM")

    saved: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in trainee.model.parameters()}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    input_ids, labels = next(micro_batches(data[1], cfg.train.micro_batch_size))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), trainee.autocast():
        ours_loss(trainee.model, input_ids, labels)
    print(json.dumps({"variant": variant_name(cfg), "peak_mib": peak_kib / 1024,
                      "step_mib": (peak_kib - before_kib) / 1024,
                      "saved_mib": sum(saved.values()) / 2**20}))
    return 0


def report_memory(args: argparse.Namespace, overrides: list[str]) -> int:
    # A fixed mmap threshold makes glibc hand large freed blocks back to the OS at once, so the
    # resident size follows the live tensors instead of the allocator's high-water mark.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    for variant in args.variants.split(","):
        done = subprocess.run([sys.executable, __file__, "--config", str(args.config), "--data", args.data,
                               "--memory-child", variant, *overrides],
                              capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  {r['variant']}: peak RSS {r['peak_mib']:.0f} MiB, step peak above rest {r['step_mib']:.0f} MiB, "
              f"saved for backward {r['saved_mib']:.0f} MiB", flush=True)
        rows.append(r)
    first = rows[0]
    print(markdown_table(["variant", "peak RSS MiB", "step peak above rest MiB", "saved for backward MiB",
                          f"saved for backward, ratio to {first['variant']}"],
                         [[r["variant"], f"{r['peak_mib']:.0f}", f"{r['step_mib']:.0f}", f"{r['saved_mib']:.0f}",
                           ratio(r["saved_mib"], first["saved_mib"])] for r in rows]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per model (best is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per model first")
    parser.add_argument("--variants", default="fp32,bf16", help="our variants, comma-separated")
    parser.add_argument("--hf-experts", default="eager",
                        help="transformers' experts_implementation: eager (its per-expert loop) or grouped_mm")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers model")
    parser.add_argument("--data", choices=("corpus", "random"), default="corpus",
                        help="batches of the configured dataset, or uniform random tokens")
    parser.add_argument("--probe-repeats", type=int, default=20, help="at least this many calls per shape")
    parser.add_argument("--probe-seconds", type=float, default=0.5, help="and at least this long")
    parser.add_argument("--loss-steps", type=int, default=0,
                        help="instead: train each variant this many steps and compare losses")
    parser.add_argument("--memory", action="store_true", help="instead: peak memory of each variant")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="instead: the ROWS busiest operators of one step of each variant")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--one-variant", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.one_variant:
        return one_variant(args, overrides)
    if args.memory_child:
        return memory_child(args, overrides)
    if args.memory:
        return report_memory(args, overrides)
    if args.loss_steps:
        return report_loss_agreement(args, overrides)
    if args.profile:
        return report_profile(args, overrides)
    return report_throughput(args, overrides)


if __name__ == "__main__":
    sys.exit(main())
