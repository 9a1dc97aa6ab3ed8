"""The config tree: typed dataclasses, TOML loading, dotted overrides, validation.

Every user-facing setting lives here. `load_config` reads a TOML file, applies `--a.b=value`
overrides, checks types and each section's values (one `_validate_<section>` each), and raises
`ConfigError` (one line naming the key) on any mistake, before any work starts. The rules a
package holds about how it uses its settings (block variants, fault drills, the parallel layout)
live in that package; `run_config.load_run_config` adds them. The CLI turns a ConfigError into
exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from trinity_train.errors import ConfigError
from trinity_train.files import atomic_write_text

# configs/debug.toml of the source tree; an installed copy without it uses the dataclass defaults,
# which equal it (tests/test_config.py checks that).
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "debug.toml"


# A str setting that names a file or directory: `~` is expanded when the config is read (a shell
# leaves the `~` of `--run.dir=~/x` alone, and a directory literally named `~` is a trap).
# data.cache_dir, whose default lies under `~`, is expanded where it is read instead, so that a
# saved config reads back the same.
UserPath = typing.NewType("UserPath", str)


def default_config_path() -> Path | None:
    """The config `trinity-train train` uses without --config."""
    return DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None


@dataclass
class ModelConfig:
    vocab_size: int = 8192  # tokens of the tokenizer (the embedding and output rows)
    hidden_size: int = 256  # width of the residual stream
    num_layers: int = 4  # transformer blocks
    num_dense_layers: int = 1  # the first this many blocks have a dense FFN, the others are MoE
    num_heads: int = 4  # attention (query) heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention)
    head_dim: int = 64  # width of one attention head
    intermediate_size: int = 768  # dense FFN width
    num_experts: int = 8  # routed experts per MoE layer
    num_experts_per_tok: int = 2  # routed experts per token (top-k)
    num_shared_experts: int = 1  # experts every token goes through, besides its top-k routed ones
    moe_intermediate_size: int = 128  # width of one routed expert
    route_scale: float = 1.0  # the chosen experts' weights (normalised to sum 1) are multiplied by this
    sliding_window: int = 128  # keys a local layer sees, itself included
    global_every: int = 0  # layer i is global when (i+1) % global_every == 0; 0: the block's own
    #                        pattern (4, i.e. 3 local : 1 global; gemma3: 6, i.e. 5 : 1)
    rope_theta: float = 10000.0  # RoPE base (global layers with RoPE: global_rope_theta)
    global_rope_theta: float = 1000000.0  # only the gemma3 block puts RoPE on global layers
    norm_eps: float = 0.0  # epsilon of the norms; 0: the block's own (1e-5; gemma3: 1e-6)
    block: str = "trinity"  # where the norms sit around each sublayer: one of model.blocks.BLOCK_VARIANTS
    init_std: float = 0.0  # std of the initial weight matrices; 0 means 0.5 / sqrt(hidden_size)
    expert_impl: str = "grouped"  # "grouped" (torch._grouped_mm) or "loop"
    router_fp32: bool = True  # router logits in fp32 even under bf16 autocast / mixed precision
    load_balance: str = "sign"  # "sign", "smebu" or "none"
    bias_update_rate: float = 1e-2  # gamma of the sign rule: the bias moves at most this per step, so
    #                                 short runs need more than Trinity's 1e-3 (set in nano/mini.toml)
    smebu_lambda: float = 5e-4  # smebu: step size lambda of lambda * tanh(kappa * relative load gap)
    smebu_beta: float = 0.5  # smebu: momentum beta of the bias update
    smebu_kappa: float = 2.0  # smebu: slope kappa inside the tanh
    aux_loss_alpha: float = 0.0  # sequence-wise aux loss weight (DeepSeek-V3 uses 1e-4)
    z_loss_weight: float = 0.0  # weight of the router z-loss; 0: off
    doc_masking: bool = False  # intra-document attention and per-document positions
    loss_chunk_tokens: int = 4096  # cross entropy is computed this many tokens at a time


@dataclass
class DataSource:
    path: UserPath = ""  # a prepared dataset directory
    weight: float = 1.0  # its sampling weight, relative to the other sources'


@dataclass
class DataPhase:
    start_tokens: int = 0  # training tokens (all ranks) after which these weights apply
    weights: list[float] = field(default_factory=list)  # one per data.mix source; 0 leaves it out


@dataclass
class DataConfig:
    path: UserPath = ""  # a prepared dataset directory; empty means the embedded default corpus
    cache_dir: str = "~/.cache/trinity-train"  # where the embedded default corpus is built (`~` expanded where read)
    seq_len: int = 256  # tokens per training sequence
    seed: int = 1234  # the sample order (and mixing); the same seed gives the same batches
    vocab_size: int = 8192  # tokenizer size trained for the embedded default corpus
    val_fraction: float = 0.02  # documents of the embedded default corpus held out for validation
    mix: list[DataSource] = field(default_factory=list)  # weighted sources; overrides `path`
    phases: list[DataPhase] = field(default_factory=list)  # later mixes of data.mix, in token order
    skip_ranges: list[list[int]] = field(default_factory=list)  # [start, end) global batches
    verify_checksums: str = "stamp"  # "stamp": each dp rank sha256s its 1/dp share of the shards once,
    #   stamps them in cache_dir, and rehashes one only when its files changed (size, mtime, inode);
    #   "full": every rank hashes every shard at every start (true); "sizes": sizes only (false)


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps of the run
    micro_batch_size: int = 8  # sequences per forward/backward on each rank
    grad_accum: int = 1  # micro-batches per optimizer step on each rank (derived when global_batch_size > 0)
    global_batch_size: int = 0  # >0: sequences per optimizer step over all data-parallel ranks, fixed
    #                             whatever the layout: grad_accum = global / (micro_batch_size x dp), so
    #                             a resume on other ranks trains on the same batches. 0: micro x accum x dp
    grad_clip: float = 1.0  # the global gradient norm is clipped to this; 0: no clipping
    seed: int = 0  # seeds the model's initialisation (data.seed the data order)
    dtype: str = "fp32"  # "fp32" or "bf16" (autocast)
    compile: bool = False  # torch.compile each block
    activation_checkpointing: bool = False  # recompute each block's activations in the backward pass
    device: str = "auto"  # "auto", "cpu" or "cuda"
    log_every: int = 10  # progress-bar refresh and console lines


@dataclass
class OptimConfig:
    name: str = "muon"  # "muon" (hidden matrices; AdamW for the rest) or "adamw" (everything)
    lr: float = 3e-3  # AdamW peak learning rate
    muon_lr: float = 1.5e-2  # Muon peak learning rate (Trinity: 1e-3)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # decoupled weight decay
    muon_momentum: float = 0.95  # Muon momentum
    muon_nesterov: bool = True  # Nesterov momentum in Muon
    muon_ns_steps: int = 5  # Newton-Schulz iterations that orthogonalise Muon's update
    muon_scale: str = "spectral"  # "spectral" (lr*sqrt(max(1, out/in))) or "rms_match" (Moonlight)
    muon_ns_dtype: str = "auto"  # Newton-Schulz precision: "auto" (bf16 on GPU, fp32 on CPU), "bf16", "fp32"
    muon_router: bool = True  # router gate goes to Muon (else AdamW)
    schedule: str = "wsd"  # "wsd", "cosine", "linear" (warm-up, then linear decay to min_lr_ratio) or "constant"
    warmup_steps: int = 30  # steps of linear learning-rate warm-up
    decay_fraction: float = 0.2  # WSD: last fraction of steps decays linearly to min_lr_ratio
    min_lr_ratio: float = 0.0  # WSD, cosine and linear decay to this fraction of the peaks (Trinity Large: 0.1)
    peak_lr_ratio: float = 1.0  # the schedule's top, a fraction of lr and muon_lr: a phase that continues
    #                             a trained run at part of its peaks (context extension: 0.1)


@dataclass
class ParallelConfig:
    # world size = dp_replicate * dp_shard * cp * tp; ep takes its ranks from dp_shard * cp (DESIGN §4)
    dp_replicate: int = 1  # HSDP replicas (each holds a full FSDP-sharded copy)
    dp_shard: int = -1  # data-parallel ranks FSDP shards weights over (with the cp ranks); -1: what is left
    cp: int = 1  # context parallel: each sequence split over this many ranks (halo exchange for the
    #              sliding-window layers, keys and values all-gathered for the global ones)
    tp: int = 1  # tensor parallel (heads and FFN width split, sequence-parallel norms)
    ep: int = 1  # expert parallel: routed experts split whole over this many of the dp_shard x cp ranks
    init_timeout_s: float = 300.0  # joining the process group and building the mesh; a rank that
    #                                does not arrive fails the others after this (torch: 30 min)
    collective_timeout_s: float = 600.0  # any one collective while training (and a checkpoint's);
    #                                      raise it for very slow checkpoint storage (torch: 30 min)
    sync_every_micro_batch: bool = True  # false: FSDP reduces gradients after the step's last
    #   micro-batch only (one reduce-scatter a step, not one per micro-batch), keeping every
    #   unit's unsharded fp32 gradients between micro-batches: dp_shard x the gradient memory
    keep_gathered_gib: float = 1.0  # the reshard policy: from the last block down, blocks stay
    #   gathered from their forward into their backward (gathered once a step, not twice) while
    #   their unsharded weights on a rank add up to at most this; 0: only the last block; inf:
    #   every block (no all-gather in backward, ZeRO-2's traffic; parallel/reshard_policy.py;
    #   `trinity-train plan` prices the memory)
    expert_gather: str = "micro_batch"  # when the routed experts' FSDP units are all-gathered:
    #   "micro_batch": for each micro-batch (again in its backward unless keep_gathered_gib keeps
    #   them); "step": once a step, held gathered from the first micro-batch's forward to the last
    #   one's backward, their gradients summed unsharded and reduced once (every MoE layer's
    #   experts and their fp32 gradients alive through the step; `trinity-train plan` prices it)
    ep_wire_dtype: str = "full"  # the EP all-to-alls: "full" sends the routed tokens' activations
    #   (and, in backward, their gradients) as computed (bf16 already under train.dtype = "bf16"
    #   on a GPU); "bf16" casts them for the wire, half an fp32 job's dispatch and combine bytes
    reduce_wire_dtype: str = "full"  # FSDP's gradient reduce-scatter and HSDP's all-reduce across
    #   replicas: "full" sends fp32 gradients; "bf16" half the bytes for one rounding of each
    #   rank's gradient (docs/concepts/parallel.md, Low precision on the wire)
    ranks_per_node: int = 0  # ranks that share a node's fast link (ranks 0..n-1 are node 0, ...);
    #   tp, cp and ep groups must lie inside one, HSDP shard groups inside one or on whole nodes.
    #   0: the launcher's processes per node (torchrun's LOCAL_WORLD_SIZE); `plan`: --gpus-per-node
    allow_ep_tp_across_nodes: bool = False  # true: run a layout whose tp, cp or ep groups span nodes
    #   (their collectives on the slow link between nodes) instead of refusing it


@dataclass
class CheckpointConfig:
    every: int = 50  # a checkpoint every this many steps, and at the last; 0: none
    keep: int = 3  # the newest this many sound checkpoints are kept
    resume: UserPath = "none"  # "none", "auto" (newest in the run directory) or a checkpoint path
    init_from: UserPath = ""  # a checkpoint (e.g. from import-hf), or a run directory (its newest sound
    #                           checkpoint), whose model weights start the run: a later phase such as a
    #                           context extension (data.seq_len above the checkpoint's) starts this way
    init_optimizer: bool = False  # also continue init_from's optimizer state (a training checkpoint's), as
    #                               Trinity's context extension does; the schedule is this run's own
    async_save: bool = False  # write in the background (dcp.async_save); committed at the first step after
    max_failed_saves: int = 3  # a save that fails (a full or broken disk) is recorded and training goes
    #                            on, keeping the checkpoints it has; this many in a row stop the run


@dataclass
class FaultConfig:
    """One fault drill (`stability.inject`): rehearse a spike without writing code."""

    fault: str = ""  # one of stability.drills.FAULTS
    first: int = 0  # nan_loss, grad_scale, loss_spike: the first iteration (1-based, as in metrics);
    #                 poison_*: the first global batch index (0-based) whose data is replaced
    last: int = -1  # the last one, inclusive; -1: only `first`
    rank: int = -1  # only on this rank of a distributed run; -1: every rank
    factor: float = 0.0  # grad_scale: gradient multiplier (0: 1000); loss_spike: loss multiplier (0: 10)
    token: int = 0  # poison_repeat: the token id every position is replaced by
    seconds: float = 0.0  # slow_rank: extra seconds of work per iteration (0: 1); hang_rank: how
    #                       long the rank stands still (0: 3600)


@dataclass
class StabilityConfig:
    mode: str = "act"  # "act": the guard skips, rolls back and halts; "observe": it judges every step
    #                    the same way and records what it would have done (`guard_observed` events),
    #                    but every step is applied (training as with the guard off)
    skip_nonfinite: bool = True  # a step with a non-finite loss or gradient norm is not applied
    spike_zscore: float = 6.0  # >0: skip a step whose loss or gradient norm lies this many sigma
    #                            above its window (robust z on log values); 0 disables
    incident_zscore: float = 3.0  # a step this far above opens an incident (and stays out of the window)
    window: int = 128  # recent normal steps that judge the next (OLMo-core: 128)
    min_history: int = 20  # no z verdict before the windows hold this many steps (after LR warm-up)
    loss_sigma_floor: float = 0.02  # smallest sigma of log(loss): a 6-sigma spike is at least +13 %
    grad_norm_sigma_floor: float = 0.2  # smallest sigma of log(grad norm): 6 sigma is at least 3.3x
    loss_ceiling_margin: float = 0.5  # >0: skip a step whose loss exceeds ln(model.vocab_size) + this,
    #                                   the untrained model's (worse than guessing); every step,
    #                                   the warm-up included; 0 disables
    warmup_grad_ratio: float = 10.0  # >0: while the gradient norm has no z verdict (LR warm-up, then
    #                                  min_history steps), skip a step whose norm is this many times
    #                                  the median of the normal norms before it; 0 disables
    routing_max_load: float = 0.0  # >0: a MoE layer whose busiest expert gets this many times the
    #                                mean tokens per expert is collapsed; 0 disables (at most E/top-k)
    routing_dead_experts: int = 1  # >0: so is a MoE layer with at least this many experts given no
    #                                token of the global batch; 0 disables
    routing_steps: int = 5  # a layer collapsed this many steps in a row opens an incident (an event)
    calm_steps: int = 20  # this many normal steps in a row close an incident
    max_consecutive_skips: int = 10  # this many skipped steps in a row halt the run
    rollback_after: int = 3  # >0: this many skipped steps in a row roll back to a checkpoint
    #                          from before the incident's onset; 0: only skip
    rollback_lookback: int = 10  # the restored checkpoint is at least this many steps before the onset
    skip_extra_batches: int = 10  # batches skipped beyond the one that triggered the rollback
    repeat_window: int = 100  # an incident this many iterations or fewer after a rollback is a repeat:
    #                           it goes one checkpoint further back and doubles the extra skip
    lr_backoff: float = 0.5  # learning-rate factor after a rollback (a repeat: its square, ...); 1: off.
    #                          Below 1, so a learning-rate divergence is not replayed after it
    lr_backoff_steps: int = 100  # optimizer steps over which the factor ramps back to 1
    max_rollbacks: int = 3  # rollbacks in one run (resumes included) before it halts as diverged
    inject: list[FaultConfig] = field(default_factory=list)  # fault drills


@dataclass
class MetricsConfig:
    jsonl: bool = True  # write metrics.jsonl (and its columnar mirror)
    tensorboard: bool = False  # TensorBoard events in run.dir/tb
    wandb: bool = False  # log to Weights & Biases (files in run.dir/wandb)
    wandb_project: str = "trinity-train"  # the W&B project
    wandb_mode: str = "auto"  # "auto": online with an API key (WANDB_API_KEY or netrc), else offline
    progress_bar: bool = True  # a progress bar; false: a console line every train.log_every iterations
    peak_flops: float = 0.0  # one device's peak FLOP/s for MFU; 0: measured with a matmul at start
    layer_stats_every: int = 10  # per-layer statistics ("layers" records) every this many
    #                              iterations; 0: off (cost: benchmarks/layer_stats_cost.py)
    rank_stats_every: int = 10  # every this many iterations, each rank's step, compute, wait and
    #                             data seconds ("ranks" records, one small gather); 0: off
    straggler_ratio: float = 1.5  # a rank whose compute time is this many times the median of the
    #                               others' ...
    straggler_reports: int = 3  # ... in this many reports in a row is a straggler (an event)


@dataclass
class EvalConfig:
    every: int = 50  # validation every this many steps (also at step 0 and at the end); 0: none
    batches: int = 4  # held-out batches of each validation (the same ones each time)
    position_buckets: list[int] = field(default_factory=list)  # first positions of the buckets of
    #   the validation loss by position (position in the document with model.doc_masking, else in
    #   the row), increasing from 0; empty: 0 and the powers of two from 64 below data.seq_len
    passkey_every: int = 0  # the passkey retrieval probe at validation every this many steps
    #                         (and at the last); 0: off (configs/extend_context.toml turns it on)
    passkey_lengths: list[int] = field(default_factory=lambda: [128, 256, 512, 1024, 2048, 4096])  # probe
    #   prompt lengths in tokens; those above data.seq_len are left out
    passkey_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])  # where the key sits in
    #   the filler, as a fraction of it (0: at the start, 1: just before the question)
    passkey_keys: int = 2  # keys (5-digit, fixed by length, depth and number) probed per depth
    passkey_template: str = "prose"  # the prompts' words: "prose" (English filler and question) or
    #   "code" (a Python module: PASS_KEY assigned in code filler), for a model trained on code


@dataclass
class WatchdogConfig:
    enabled: bool = True  # each rank watches its own progress, phase by phase
    multiple: float = 5.0  # a phase may last this many times its longest duration seen so far ...
    floor_s: float = 120.0  # ... but at least this long
    first_s: float = 1800.0  # a phase not yet seen in this process (the first step compiles); 0: no limit


@dataclass
class RunConfig:
    dir: UserPath = "runs/debug"  # the run directory: config, metrics, events, checkpoints
    name: str = "debug"  # the run's name (W&B run name and group)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    run: RunConfig = field(default_factory=RunConfig)


# ---------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    if tp is UserPath:
        return "str"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotated type `tp`; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return _build(tp, value, key)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"union types are not supported in the config ({key})")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(float(value), key)
        if value == "inf" and key in UNBOUNDED_KEYS:
            return math.inf
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is UserPath:
        if isinstance(value, str):
            return os.path.expanduser(value)
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


# The spelling of "no limit" for the keys where a user may reach for `inf` to say it.
NO_LIMIT_SPELLING = {
    "train.grad_clip": "0 turns clipping off",
    "watchdog.first_s": "0 gives a phase not seen yet no limit",
    "watchdog.floor_s": "watchdog.enabled=false turns the watchdog off",
    "watchdog.multiple": "watchdog.enabled=false turns the watchdog off",
    "parallel.init_timeout_s": "there is no unlimited wait: give a long finite one, e.g. 86400",
    "parallel.collective_timeout_s": "there is no unlimited wait: give a long finite one, e.g. 86400",
}
# Float keys where inf means "no limit". JSON (a checkpoint's metadata) has no inf, so
# `config_to_dict` writes it as the string "inf", which these keys read back.
UNBOUNDED_KEYS = ("parallel.keep_gathered_gib",)


def _finite(value: float, key: str) -> float:
    """Every float setting is a finite number (but inf where `UNBOUNDED_KEYS` allows it): nan or
    inf would pass comparisons silently (nan) or break the run far from the config."""
    if key in UNBOUNDED_KEYS and value == math.inf:
        return value
    if not math.isfinite(value):
        spelling = NO_LIMIT_SPELLING.get(key)
        raise ConfigError(f"{key}: must be a finite number, got {value}" + (f" ({spelling})" if spelling else ""))
    return value


# Keys a release moved (old -> new) or removed (-> what to do instead). A user's config that sets one
# is refused with that line; a checkpoint's stored config is upgraded (`upgrade_stored_config`).
MOVED_KEYS = {
    "train.eval_every": "eval.every",
    "train.eval_batches": "eval.batches",
    **{f"metrics.{k}": f"eval.{k}" for k in ("position_buckets", "passkey_every", "passkey_lengths",
                                             "passkey_depths", "passkey_keys", "passkey_template")},
}
REMOVED_KEYS = {
    "parallel.reshard_after_forward": "it folded into parallel.keep_gathered_gib: false is "
                                      "keep_gathered_gib = inf (every block kept), true the default",
    "parallel.overlap_reduce_scatter": "a CPU job overlaps its reduce-scatters wherever they apply "
                                       "(GPUs on NCCL's stream); delete the line",
    "parallel.prefetch_all_gather": "a CPU job prefetches its all-gathers wherever they apply "
                                    "(GPUs on a CUDA stream); delete the line",
    "parallel.ep_waves": "the EP exchange's waves are internal; delete the line",
    "data.sample_order": "every run reads the stateless sample order; delete the line",
}


def _retired_key_message(key: str) -> str:
    if key in MOVED_KEYS:
        return f"config key '{key}' moved: use {MOVED_KEYS[key]}"
    return f"config key '{key}' was removed: {REMOVED_KEYS[key]}"


def upgrade_stored_config(table: dict) -> dict:
    """A config an earlier version stored (a checkpoint's meta.json) in today's keys and values:
    moved keys moved, removed ones dropped (`reshard_after_forward = false` as keep_gathered_gib =
    inf), renamed values renamed. A user's own config is never upgraded: it is refused in one line."""
    table = {section: dict(values) if isinstance(values, dict) else values for section, values in table.items()}
    parallel = table.get("parallel", {})
    if parallel.get("reshard_after_forward") is False:
        parallel["keep_gathered_gib"] = "inf"
    for key, renames in RENAMED_VALUES.items():
        section, name = key.split(".")
        value = table.get(section, {}).get(name)
        if isinstance(value, str) and value in renames:
            table[section][name] = renames[value]
    for old in [*MOVED_KEYS, *REMOVED_KEYS]:
        section, name = old.split(".")
        if isinstance(table.get(section), dict) and name in table[section]:
            value = table[section].pop(name)
            if old in MOVED_KEYS:
                new_section, new_name = MOVED_KEYS[old].split(".")
                table.setdefault(new_section, {})[new_name] = value
    return table


def _build(cls: type, table: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in table.items():
        key = f"{prefix}.{k}" if prefix else k
        if key in MOVED_KEYS or key in REMOVED_KEYS:
            raise ConfigError(_retired_key_message(key))
        if k not in names:
            raise ConfigError(_unknown_key_message(key, k, names))
        kwargs[k] = _coerce(_respelled(key, v), hints[k], key)
    return cls(**kwargs)


# The boolean values of a key that was a boolean before it took named values, and their names now.
OLD_SPELLINGS = {"data.verify_checksums": {True: "full", False: "sizes"}}
# Values a release renamed: refused with the new name (one vocabulary for the wire dtypes).
RENAMED_VALUES = {"parallel.ep_wire_dtype": {"compute": "full"}, "parallel.reduce_wire_dtype": {"fp32": "full"}}


def _respelled(key: str, value: Any) -> Any:
    if isinstance(value, bool) and key in OLD_SPELLINGS:
        return OLD_SPELLINGS[key][value]
    if isinstance(value, str) and value in RENAMED_VALUES.get(key, {}):
        raise ConfigError(f"{key}: {value!r} is now spelled {RENAMED_VALUES[key][value]!r}")
    return value


def _unknown_key_message(key: str, name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean '{key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{close[0]}'?)" if close else ""
    return f"unknown config key '{key}'{hint}"


def _parse_override_value(text: str) -> Any:
    """Read a command-line value as a TOML literal, falling back to a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> dict:
    """Turn ['--train.steps=50', '--run.dir', 'x'] into a nested dict."""
    nested: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument '{arg}': overrides look like --section.key=value")
        body = arg[2:]
        if "=" in body:
            path, text = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            path, text = body, args[i + 1]
            i += 1
        else:
            raise ConfigError(f"override '{arg}' has no value: write --{body}=VALUE")
        parts = path.split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"override '{arg}': the key must be a dotted path like --train.steps=50")
        node = nested
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{arg}' conflicts with another override")
        node[parts[-1]] = _parse_override_value(text)
        i += 1
    return nested


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def config_from_dict(table: dict) -> Config:
    cfg = _build(Config, table, "")
    validate(cfg)
    return cfg


def _read_toml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """Read a config file; a top-level `base = "other.toml"` (relative to this file) is read first
    and this file's tables are merged over it, so an ablation is its base plus what differs."""
    path = path.expanduser()
    if not path.is_file():
        what = "is a directory, not a TOML file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file '{path}' {what}; pass a .toml file (e.g. configs/debug.toml)")
    try:
        table = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{path}' is not UTF-8 text (a binary file?); pass a .toml file "
                          "(e.g. configs/debug.toml)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None
    base = table.pop("base", None)
    if base is None:
        return table
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected the path of another config file, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in seen or base_path == path.resolve():
        raise ConfigError(f"{path}: base '{base}' includes itself")
    return _merge(_read_toml(base_path, seen + (path.resolve(),)), table)


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> Config:
    table = _read_toml(Path(path)) if path is not None else {}
    if overrides:
        extra = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        table = _merge(table, extra)
    return config_from_dict(table)


def load_stored_config(path: str | Path) -> Config:
    """A resolved config the framework wrote (a study cell's, a run's config.toml), by an earlier
    version too: its retired keys upgraded (`upgrade_stored_config`), not refused."""
    return config_from_dict(upgrade_stored_config(_read_toml(Path(path))))


def config_to_dict(cfg: Config) -> dict:
    """The config as plain data (JSON-safe: an unbounded key's inf is the string "inf")."""
    table = dataclasses.asdict(cfg)
    for key in UNBOUNDED_KEYS:
        section, name = key.split(".")
        if table[section][name] == math.inf:
            table[section][name] = "inf"
    return table


def save_config(cfg: Config, path: str | Path) -> None:
    atomic_write_text(path, tomli_w.dumps(config_to_dict(cfg)))


def config_differences(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs, in key order."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        dotted = f"{prefix}.{key}" if prefix else key
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs.extend(config_differences(a, b, dotted))
        elif a != b:
            diffs.append((dotted, a, b))
    return diffs


def describe_differences(diffs: list[tuple[str, Any, Any]], limit: int = 3) -> str:
    shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diffs[:limit])
    return shown + (f" and {len(diffs) - limit} more" if len(diffs) > limit else "")


# ---------------------------------------------------------------------------- validation


def require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def one_of(value: str, allowed: tuple, key: str) -> None:
    require(value in allowed, key, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def validate(cfg: Config) -> None:
    """The field checks of every section (types were checked while building): each value in its
    range, consistent with the other fields of its section. The rules that belong to a package
    that uses a setting (the block variants, the fault drills, the parallel layout) live in that
    package and run through `run_config.validate_rules`."""
    _validate_model(cfg.model)
    _validate_data(cfg.data)
    _validate_train(cfg.train)
    _validate_optim(cfg.optim)
    _validate_parallel(cfg.parallel)
    _validate_checkpoint(cfg.checkpoint)
    _validate_stability(cfg.stability)
    _validate_metrics(cfg.metrics)
    _validate_eval(cfg.eval)
    _validate_watchdog(cfg.watchdog)
    require(bool(cfg.run.dir), "run.dir", "must not be empty")
    require(cfg.eval.passkey_every == 0 or min(cfg.eval.passkey_lengths) <= cfg.data.seq_len,
            "eval.passkey_lengths", f"none of {cfg.eval.passkey_lengths} is at most data.seq_len="
            f"{cfg.data.seq_len}: the probe runs at the lengths the model trains at; add one, or set "
            "eval.passkey_every=0")
    _no_negative_floats(cfg, "")


def _no_negative_floats(node: Any, prefix: str) -> None:
    """No float setting has a meaning below 0 (rates, weights, factors, seconds, thresholds):
    the rule for every float key, after each section's own range checks, whose messages say more."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            _no_negative_floats(item, f"{prefix}[{i}]")
        return
    if not dataclasses.is_dataclass(node):
        return
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}.{f.name}" if prefix else f.name
        if isinstance(value, float):
            require(value >= 0, key, f"must be >= 0, got {value}")
        else:
            _no_negative_floats(value, key)


def _validate_model(m: ModelConfig) -> None:
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "loss_chunk_tokens"):
        require(getattr(m, name) > 0, f"model.{name}", f"must be positive, got {getattr(m, name)}")
    require(m.sliding_window > 0, "model.sliding_window", f"must be positive, got {m.sliding_window}")
    require(0 <= m.num_dense_layers <= m.num_layers, "model.num_dense_layers",
            f"must be between 0 and model.num_layers={m.num_layers}, got {m.num_dense_layers}")
    require(m.num_shared_experts >= 0, "model.num_shared_experts", "must be >= 0")
    require(m.num_heads % m.num_kv_heads == 0, "model.num_heads",
            f"{m.num_heads} heads are not divisible by model.num_kv_heads={m.num_kv_heads}")
    require(m.num_experts_per_tok <= m.num_experts, "model.num_experts_per_tok",
            f"top-k {m.num_experts_per_tok} exceeds model.num_experts={m.num_experts}")
    require(m.head_dim % 2 == 0, "model.head_dim", f"must be even for RoPE, got {m.head_dim}")
    require(m.global_every >= 0, "model.global_every", "must be >= 0 (0: the block's own pattern)")
    require(m.norm_eps >= 0, "model.norm_eps", "must be >= 0 (0: the block's own)")
    require(m.route_scale > 0, "model.route_scale", "must be positive")
    for name in ("rope_theta", "global_rope_theta"):
        require(getattr(m, name) > 0, f"model.{name}", f"a RoPE base must be positive, got {getattr(m, name)}")
    require(0 <= m.smebu_beta < 1, "model.smebu_beta", f"a momentum must be in [0, 1), got {m.smebu_beta}")
    require(m.init_std >= 0, "model.init_std", "must be >= 0 (0 selects 0.5/sqrt(hidden_size))")
    for name in ("aux_loss_alpha", "z_loss_weight"):
        require(getattr(m, name) >= 0, f"model.{name}", f"a loss weight must be >= 0, got {getattr(m, name)}")
    one_of(m.expert_impl, ("grouped", "loop"), "model.expert_impl")
    one_of(m.load_balance, ("sign", "smebu", "none"), "model.load_balance")


VERIFY_MODES = ("stamp", "full", "sizes")


def _validate_data(d: DataConfig) -> None:
    one_of(d.verify_checksums, VERIFY_MODES, "data.verify_checksums")
    require(d.seq_len > 0, "data.seq_len", f"must be positive, got {d.seq_len}")
    require(0.0 < d.val_fraction < 0.5, "data.val_fraction", f"must be in (0, 0.5), got {d.val_fraction}")
    require(d.vocab_size >= 256 + 2, "data.vocab_size", "must be at least 258 (bytes plus specials)")
    for i, src in enumerate(d.mix):
        require(bool(src.path), f"data.mix[{i}].path", "must name a prepared dataset directory")
        require(src.weight > 0, f"data.mix[{i}].weight", f"must be positive, got {src.weight}")
    require(not d.phases or bool(d.mix), "data.phases", "needs data.mix: phases re-weight its sources")
    previous_start = 0
    for i, phase in enumerate(d.phases):
        key = f"data.phases[{i}]"
        require(phase.start_tokens > previous_start, f"{key}.start_tokens",
                f"must be positive and after the previous phase's, got {phase.start_tokens}")
        previous_start = phase.start_tokens
        require(len(phase.weights) == len(d.mix), f"{key}.weights",
                f"needs one weight per data.mix source ({len(d.mix)}), got {len(phase.weights)}")
        require(all(w >= 0 for w in phase.weights) and sum(phase.weights) > 0, f"{key}.weights",
                f"must be >= 0 with a positive sum, got {phase.weights}")
    for i, r in enumerate(d.skip_ranges):
        require(len(r) == 2 and 0 <= r[0] < r[1], f"data.skip_ranges[{i}]",
                f"must be [start, end) with 0 <= start < end, got {r}")


def _validate_train(t: TrainConfig) -> None:
    for name in ("steps", "micro_batch_size", "grad_accum", "log_every"):
        require(getattr(t, name) > 0, f"train.{name}", f"must be positive, got {getattr(t, name)}")
    require(t.global_batch_size >= 0, "train.global_batch_size", "must be >= 0 (0: micro_batch_size x grad_accum x dp)")
    if t.global_batch_size > 0:
        require(t.grad_accum == 1, "train.grad_accum",
                f"is derived from train.global_batch_size={t.global_batch_size}; leave it at 1")
        grad_accum_for(t, 1)
    require(t.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")
    one_of(t.dtype, ("fp32", "bf16"), "train.dtype")
    one_of(t.device, ("auto", "cpu", "cuda"), "train.device")


def _validate_optim(o: OptimConfig) -> None:
    one_of(o.name, ("adamw", "muon"), "optim.name")
    one_of(o.schedule, ("wsd", "cosine", "linear", "constant"), "optim.schedule")
    one_of(o.muon_scale, ("spectral", "rms_match"), "optim.muon_scale")
    for key in ("lr", "muon_lr"):
        value = getattr(o, key)
        require(value > 0 and math.isfinite(value), f"optim.{key}",
                f"a learning rate must be a positive finite number, got {value}")
    for name in ("beta1", "beta2"):
        require(0 <= getattr(o, name) < 1, f"optim.{name}", f"must be in [0, 1), got {getattr(o, name)}")
    require(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    require(o.eps > 0, "optim.eps", f"must be positive (it keeps AdamW's division finite), got {o.eps}")
    require(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    require(0 <= o.decay_fraction <= 1, "optim.decay_fraction", "must be in [0, 1]")
    require(0 < o.peak_lr_ratio <= 1, "optim.peak_lr_ratio", f"must be in (0, 1], got {o.peak_lr_ratio}")
    require(0 <= o.min_lr_ratio <= o.peak_lr_ratio, "optim.min_lr_ratio",
            f"must be in [0, optim.peak_lr_ratio={o.peak_lr_ratio}] (the schedule decays to it), got {o.min_lr_ratio}")
    require(o.muon_ns_steps > 0, "optim.muon_ns_steps", "must be positive")
    require(0 <= o.muon_momentum < 1, "optim.muon_momentum", f"must be in [0, 1), got {o.muon_momentum}")
    one_of(o.muon_ns_dtype, ("auto", "bf16", "fp32"), "optim.muon_ns_dtype")


WIRE_DTYPES = ("full", "bf16")  # parallel/wire_precision.py
EXPERT_GATHERS = ("micro_batch", "step")  # parallel/fsdp.py


def _validate_parallel(p: ParallelConfig) -> None:
    for name in ("dp_replicate", "cp", "tp", "ep"):
        require(getattr(p, name) >= 1, f"parallel.{name}", f"must be >= 1, got {getattr(p, name)}")
    require(p.dp_shard == -1 or p.dp_shard >= 1, "parallel.dp_shard", "must be >= 1, or -1 for the rest")
    for name in ("init_timeout_s", "collective_timeout_s"):
        require(getattr(p, name) > 0, f"parallel.{name}", f"must be positive (seconds), got {getattr(p, name)}")
    for name in ("ep_wire_dtype", "reduce_wire_dtype"):
        one_of(getattr(p, name), WIRE_DTYPES, f"parallel.{name}")
    one_of(p.expert_gather, EXPERT_GATHERS, "parallel.expert_gather")
    require(p.ranks_per_node >= 0, "parallel.ranks_per_node",
            f"must be >= 1, or 0 for the launcher's processes per node, got {p.ranks_per_node}")


def _validate_checkpoint(c: CheckpointConfig) -> None:
    require(c.every >= 0, "checkpoint.every", "must be >= 0 (0 disables periodic checkpoints)")
    require(c.keep >= 1, "checkpoint.keep", "must be >= 1")
    require(not c.init_optimizer or bool(c.init_from), "checkpoint.init_optimizer",
            "needs checkpoint.init_from: the checkpoint whose optimizer state the run continues")
    require(c.max_failed_saves >= 1, "checkpoint.max_failed_saves", "must be >= 1 (1: the first failed save stops the run)")


STABILITY_MODES = ("act", "observe")
PASSKEY_TEMPLATES = ("prose", "code")  # data/passkey.py TEMPLATES


def _validate_stability(s: StabilityConfig) -> None:
    require(s.mode in STABILITY_MODES, "stability.mode", f"must be one of {', '.join(STABILITY_MODES)}, got {s.mode!r}")
    require(s.spike_zscore >= 0, "stability.spike_zscore", "must be >= 0 (0 disables)")
    require(s.incident_zscore >= 0, "stability.incident_zscore", "must be >= 0 (0: only skips open incidents)")
    require(s.spike_zscore == 0 or s.incident_zscore <= s.spike_zscore, "stability.incident_zscore",
            f"must not exceed stability.spike_zscore ({s.spike_zscore}): an incident opens before a skip")
    require(s.window >= 2 and 1 <= s.min_history <= s.window, "stability.min_history",
            "needs window >= 2 and 1 <= min_history <= window")
    for name in ("loss_sigma_floor", "grad_norm_sigma_floor"):
        require(getattr(s, name) > 0, f"stability.{name}",
                f"a sigma floor must be positive (log units, e.g. 0.02), got {getattr(s, name)}")
    for name in ("loss_ceiling_margin", "warmup_grad_ratio", "routing_max_load", "routing_dead_experts"):
        require(getattr(s, name) >= 0, f"stability.{name}", f"must be >= 0 (0 disables), got {getattr(s, name)}")
    require(s.warmup_grad_ratio == 0 or s.warmup_grad_ratio > 1, "stability.warmup_grad_ratio",
            f"must be above 1 (or 0 to disable), got {s.warmup_grad_ratio}: it is a jump over the median")
    require(s.routing_max_load == 0 or s.routing_max_load > 1, "stability.routing_max_load",
            f"must be above 1 (or 0 to disable), got {s.routing_max_load}: 1 is a perfectly balanced layer")
    require(s.routing_steps >= 1, "stability.routing_steps", "must be >= 1")
    require(s.calm_steps >= 1, "stability.calm_steps", "must be >= 1")
    require(s.max_consecutive_skips >= 1, "stability.max_consecutive_skips", "must be >= 1")
    require(s.rollback_after >= 0, "stability.rollback_after", "must be >= 0 (0 disables rollback)")
    require(s.max_rollbacks >= 0, "stability.max_rollbacks", "must be >= 0")
    for name in ("rollback_lookback", "skip_extra_batches", "repeat_window", "lr_backoff_steps"):
        require(getattr(s, name) >= 0, f"stability.{name}", f"must be >= 0, got {getattr(s, name)}")
    require(0 < s.lr_backoff <= 1, "stability.lr_backoff", f"must be in (0, 1] (1: off), got {s.lr_backoff}")
    if s.rollback_after > 0:
        require(s.rollback_after < s.max_consecutive_skips, "stability.rollback_after",
                f"must be below stability.max_consecutive_skips ({s.max_consecutive_skips}), which "
                "would stop the run first")


def _validate_metrics(mc: MetricsConfig) -> None:
    one_of(mc.wandb_mode, ("auto", "online", "offline"), "metrics.wandb_mode")
    require(mc.peak_flops >= 0, "metrics.peak_flops", "must be >= 0 (0 measures it)")
    require(mc.layer_stats_every >= 0, "metrics.layer_stats_every",
            f"must be >= 0 (0 turns the layer statistics off), got {mc.layer_stats_every}")
    require(mc.rank_stats_every >= 0, "metrics.rank_stats_every",
            f"must be >= 0 (0 turns the rank statistics off), got {mc.rank_stats_every}")
    require(mc.straggler_ratio > 1, "metrics.straggler_ratio",
            f"must be above 1 (a rank this many times slower than the others), got {mc.straggler_ratio}")
    require(mc.straggler_reports >= 1, "metrics.straggler_reports", "must be >= 1")


def _validate_eval(ev: EvalConfig) -> None:
    require(ev.batches > 0, "eval.batches", f"must be positive, got {ev.batches}")
    require(ev.every >= 0, "eval.every", "must be >= 0 (0 disables validation)")
    b = ev.position_buckets
    require(not b or (b[0] == 0 and all(x < y for x, y in zip(b, b[1:]))), "eval.position_buckets",
            f"must be the first position of each bucket, increasing from 0 (e.g. [0, 256, 1024]), got {b}")
    require(ev.passkey_every >= 0, "eval.passkey_every", f"must be >= 0 (0 turns the probe off), got {ev.passkey_every}")
    require(bool(ev.passkey_lengths) and all(n > 0 for n in ev.passkey_lengths), "eval.passkey_lengths",
            f"must be positive token counts, got {ev.passkey_lengths}")
    require(bool(ev.passkey_depths) and all(0 <= d <= 1 for d in ev.passkey_depths), "eval.passkey_depths",
            f"must be fractions of the filler in [0, 1], got {ev.passkey_depths}")
    require(ev.passkey_keys >= 1, "eval.passkey_keys", f"must be >= 1, got {ev.passkey_keys}")
    require(ev.passkey_template in PASSKEY_TEMPLATES, "eval.passkey_template",
            f"must be one of {', '.join(PASSKEY_TEMPLATES)}, got '{ev.passkey_template}'")


def _validate_watchdog(w: WatchdogConfig) -> None:
    require(w.multiple >= 1, "watchdog.multiple", f"must be >= 1, got {w.multiple}")
    require(w.floor_s > 0, "watchdog.floor_s", f"must be positive (seconds), got {w.floor_s}")
    require(w.first_s >= 0, "watchdog.first_s", f"must be >= 0 (seconds; 0: no limit), got {w.first_s}")


# The smallest bucket of the default position buckets: [0, 64), then one per power of two.
FIRST_POSITION_BUCKET = 64


def position_bucket_starts(ev: EvalConfig, seq_len: int) -> list[int]:
    """The first position of each bucket of the validation loss by position: `eval.position_buckets`,
    or 0 and the powers of two from 64 below `seq_len` ([0, 64, 128] for 256 tokens)."""
    if ev.position_buckets:
        return list(ev.position_buckets)
    starts, edge = [0], FIRST_POSITION_BUCKET
    while edge < seq_len:
        starts.append(edge)
        edge *= 2
    return starts


def grad_accum_for(t: TrainConfig, dp: int) -> int:
    """Micro-batches per optimizer step on each of `dp` data-parallel ranks: `train.grad_accum`,
    or what makes `train.global_batch_size` (ConfigError when it cannot be split evenly)."""
    if t.global_batch_size == 0:
        return t.grad_accum
    step = t.micro_batch_size * dp
    if t.global_batch_size % step:
        raise ConfigError(
            f"train.global_batch_size: {t.global_batch_size} sequences cannot be split over {dp} data-parallel "
            f"rank(s) in micro-batches of {t.micro_batch_size} (it must be a multiple of micro_batch_size x dp = "
            f"{step}); change train.global_batch_size, train.micro_batch_size or the number of ranks")
    return t.global_batch_size // step


def rows_per_rank(t: TrainConfig, dp: int) -> int:
    """Sequences each of `dp` data-parallel ranks reads per optimizer step."""
    return t.micro_batch_size * grad_accum_for(t, dp)


def init_std(m: ModelConfig) -> float:
    return m.init_std if m.init_std > 0 else 0.5 / math.sqrt(m.hidden_size)
