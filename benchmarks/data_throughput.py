"""Is the data pipeline ever the bottleneck? Three rates, measured side by side in one run:

1. prepare: `prepare()` on a JSON-lines corpus (the standard library's source, one document per
   file, in as many JSON-lines files as workers) with a ready tokenizer, one pipeline task per
   file run by `--num-proc` local worker processes: input MB/s and tokens/s.
2. loader: tokens/s that `TrainLoader.next_batch()` delivers (configs/debug.toml batches).
3. training: tokens/s the debug model trains at (forward + backward + AdamW step) on those batches.

The loader must deliver at least 50x what training consumes.

    python benchmarks/data_throughput.py [--input-mb 8] [--num-proc 2] [--train-steps 4] [--a.b=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from trinity_harness.table import markdown_table, ratio
from trinity_train.config import load_config
from trinity_train.data import build_loaders
from trinity_train.data.default_corpus import corpus_files, stdlib_root
from trinity_train.data.prepare import PrepareOptions, prepare
from trinity_train.data.tokenizer import train_byte_level_bpe
from trinity_train.model import build_model

ROOT = Path(__file__).resolve().parent.parent
REQUIRED_RATIO = 50.0


def write_corpus(paths: list[Path], megabytes: float) -> list[str]:
    """The first `megabytes` of standard-library source, as JSON lines, dealt over `paths`."""
    texts, size = [], 0
    for file in corpus_files(stdlib_root()):
        text = file.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text.encode())
        if size >= megabytes * 1e6:
            break
    for i, path in enumerate(paths):
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[i::len(paths)]))
    return texts


def measure_prepare(work: Path, megabytes: float, num_proc: int, vocab_size: int) -> tuple[Path, dict]:
    corpus = [work / f"corpus{i}.jsonl" for i in range(num_proc)]
    texts = write_corpus(corpus, megabytes)
    tokenizer = train_byte_level_bpe([texts], vocab_size, len(texts))
    tokenizer.save(str(work / "tokenizer.json"))
    opts = PrepareOptions(inputs=[str(p) for p in corpus], out=str(work / "prepared"),
                          tokenizer=str(work / "tokenizer.json"), tasks=num_proc, workers=num_proc, progress=False)
    out = prepare(opts)
    return out, opts.stats


def measure_loader(cfg, min_seconds: float = 2.0) -> float:
    train, _ = build_loaders(cfg)
    train.next_batch()  # opens the memory maps
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        tokens += train.next_batch().input_ids.numel()
    return tokens / (time.perf_counter() - start)


def measure_training(cfg, steps: int) -> float:
    torch.manual_seed(0)
    model = build_model(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    train, _ = build_loaders(cfg)

    def step() -> int:
        batch = train.next_batch()
        out = model(batch.input_ids, labels=batch.labels, position_ids=batch.position_ids,
                    document_ids=batch.document_ids)
        loss = out.ce_sum / out.num_tokens + out.aux_loss + out.z_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return batch.input_ids.numel()

    step()  # warm-up: allocations, first-call overheads
    tokens, start = 0, time.perf_counter()
    for _ in range(steps):
        tokens += step()
    return tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-mb", type=float, default=8.0, help="size of the prepare input")
    parser.add_argument("--num-proc", type=int, default=2, help="prepare worker processes")
    parser.add_argument("--train-steps", type=int, default=4, help="timed training steps")
    args, overrides = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = load_config(ROOT / "configs" / "debug.toml", overrides)
        prepared, stats = measure_prepare(work, args.input_mb, args.num_proc, base.data.vocab_size)
        cfg = load_config(ROOT / "configs" / "debug.toml",
                          overrides + [f"--data.path={prepared}", f"--run.dir={work / 'run'}"])
        loader_rate = measure_loader(cfg)
        training_rate = measure_training(cfg, args.train_steps)

    tokens = stats["train_tokens"] + stats["val_tokens"]
    mb = stats["input_bytes"] / 1e6
    print(f"prepare  ({args.num_proc} processes): {mb / stats['seconds']:8.2f} MB/s of input   "
          f"{tokens / stats['seconds']:12,.0f} tokens/s   ({mb:.1f} MB, {tokens:,} tokens, {stats['seconds']:.1f} s)")
    print(f"loader   (next_batch):     {loader_rate:14,.0f} tokens/s delivered")
    print(f"training (debug model):    {training_rate:14,.0f} tokens/s consumed (fwd + bwd + AdamW)")
    loader_over_training = loader_rate / training_rate
    verdict = "ok" if loader_over_training >= REQUIRED_RATIO else f"TOO SLOW (needs >= {REQUIRED_RATIO:.0f}x)"
    print(f"loader / training = {loader_over_training:,.0f}x  {verdict}")
    prepare_rate = tokens / stats["seconds"]
    print(markdown_table(
        ["stage", "tokens/s", "ratio to training", "note"],
        [[f"prepare ({args.num_proc} processes)", f"{prepare_rate:,.0f}", ratio(prepare_rate, training_rate, 0),
          f"{mb / stats['seconds']:.2f} MB/s of input ({mb:.1f} MB, {tokens:,} tokens, {stats['seconds']:.1f} s)"],
         ["loader (next_batch)", f"{loader_rate:,.0f}", ratio(loader_rate, training_rate, 0), verdict],
         ["training (debug model)", f"{training_rate:,.0f}", "1x", "fwd + bwd + AdamW"]]))
    return 0 if loader_over_training >= REQUIRED_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
