"""Context parallelism (`parallel.cp`, issue 32): rows split zigzag over the ranks of a cp group,
halo exchange for the sliding-window layers, keys and values gathered for the global ones.

On one process: the zigzag split, the positions and document ids computed on the whole row, the
halo plans (each chunk receives exactly the `window - 1` positions before it, also when the window
is longer than a chunk and the halo comes from several ranks), and the CP attention of every rank
equal to the whole row's, with the collectives answered from every rank's inputs.

On gloo ranks (slow): training equals one process, like every other layout
(`layout_runs.assert_run_matches`: losses and gradient norms rel 1e-5, parameters 1e-4, expert
biases 1e-7 and rank-identical, bit-identical initial weights, the same layer statistics) for cp =
2 and 4, cp 2 x dp_shard 2, cp 2 x ep 2 and cp 2 x tp 2, at the issue's setting (seq_len 4,096,
sliding window 128, document masking, three local layers to one global, MoE with the aux and z
losses on) and at a short one (seq_len 32, window 8: at cp = 4 each chunk holds 4 tokens, so the
7-token halo spans two chunks), where HSDP 2 x cp 2, activation checkpointing and Muon (cp 2,
HSDP 2 x cp 2) are checked too. And a resume that changes cp keeps the data order: a cp = 2 run's
checkpoint resumed by one process trains on the same batches as an uninterrupted run.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist

from conftest import WORDS, layout_config, merge_sections, run_config, run_layouts
from trinity_harness.corpus import prepare_word_corpus
from layout_runs import COMMON, assert_run_matches, assert_stats_match, recorded
from trinity_harness.ranks import rank_trainer
from trinity_train.errors import ConfigError
from trinity_train.files import read_jsonl
from trinity_train.model.attention import build_attention_mask, positions_from_documents, scaled_dot_product
from trinity_train.model.context_attention import SequenceShard, context_attention_mask, halo_plan
from trinity_train.model.transformer import layer_attention_mask
from trinity_train.parallel.context_parallel import context_token_index, shard_micro_batch, split_for_context
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.parallel.node_layout import Nodes, layout_on_nodes
from trinity_train.records import RecordKind
from trinity_train.train import Trainer


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert context_token_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert context_token_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert context_token_index(16, 4, 3).tolist() == [6, 7, 8, 9]
    for cp in (1, 2, 4):
        every = torch.cat([context_token_index(32, cp, r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(32))  # a partition of the row
    rows = torch.arange(2 * 16 * 3).view(2, 16, 3)
    assert torch.equal(split_for_context(rows, 2, 1), rows[:, 4:12])


def test_positions_and_documents_come_from_the_whole_row():
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4])
    mb = {"input_ids": torch.arange(16)[None], "labels": torch.arange(1, 17)[None], "document_ids": docs}
    whole_positions = positions_from_documents(docs)
    for rank in range(2):
        index = context_token_index(16, 2, rank)
        part = shard_micro_batch(mb, 2, rank, doc_masking=True)
        assert torch.equal(part["position_ids"], whole_positions[:, index])  # per-document, global
        assert torch.equal(part["input_ids"], mb["input_ids"][:, index])
        assert torch.equal(part["labels"], mb["labels"][:, index])  # aligned: no edge case at a chunk end
        assert torch.equal(part["document_ids"], docs[:, index])
        assert torch.equal(part["row_document_ids"], docs) and torch.equal(part["token_index"], index)
    plain = shard_micro_batch({k: mb[k] for k in ("input_ids", "labels")}, 2, 1, doc_masking=False)
    assert torch.equal(plain["position_ids"], context_token_index(16, 2, 1)[None])
    assert "row_document_ids" not in plain


def all_to_all_by_hand(cp: int, rank: int, sent_by: list[torch.Tensor], plans: list) -> torch.Tensor:
    """What `rank` receives when every rank s sends `sent_by[s]` cut by its plan's input splits."""
    pieces = []
    for s in range(cp):
        start = sum(plans[s].input_splits[:rank])
        pieces.append(sent_by[s][start:start + plans[s].input_splits[rank]])
    return torch.cat(pieces)


@pytest.mark.parametrize("seq_len, cp, window", [(32, 2, 4), (32, 4, 4), (64, 4, 20), (64, 2, 40), (48, 3, 9),
                                                 (16, 4, 16)])
def test_each_chunk_receives_the_window_before_it(seq_len, cp, window):
    plans = [halo_plan(seq_len, cp, r, window) for r in range(cp)]
    held = [context_token_index(seq_len, cp, r) for r in range(cp)]  # each rank's global positions
    chunk = seq_len // (2 * cp)
    for rank in range(cp):
        got = all_to_all_by_hand(cp, rank, [held[s][plans[s].send_index] for s in range(cp)], plans)
        assert [len(p) for p in got.split(plans[rank].output_splits)] == plans[rank].output_splits
        halos = torch.cat([got, torch.tensor([-1])])[plans[rank].recv_index].view(2, window - 1)
        for halo, j in zip(halos, (rank, 2 * cp - 1 - rank)):
            want = torch.arange(j * chunk - window + 1, j * chunk)
            assert torch.equal(halo, torch.where(want >= 0, want, -1))  # -1: before the row's start
        # Only the halo travels: never more rows than the two halos hold.
        assert sum(plans[rank].output_splits) <= 2 * (window - 1)


class ExchangeByHand:
    """A `ContextExchange` of rank `rank` whose collectives are answered from every rank's inputs,
    computed in advance from the whole row's keys and values (`rows_of(s)`: rank s's [T/cp, ...])."""

    def __init__(self, cp: int, rank: int, rows_of, window: int | None, seq_len: int):
        self.cp, self.rank, self.rows_of, self.window, self.seq_len = cp, rank, rows_of, window, seq_len

    def all_gather(self, x):
        return torch.cat([self.rows_of(s) for s in range(self.cp)])

    def all_to_all(self, x, output_splits, input_splits):
        plans = [halo_plan(self.seq_len, self.cp, s, self.window) for s in range(self.cp)]
        sent = [self.rows_of(s)[plans[s].send_index] for s in range(self.cp)]
        return all_to_all_by_hand(self.cp, self.rank, sent, plans)

    def all_reduce(self, x):
        raise AssertionError("attention does not all-reduce")


@pytest.mark.parametrize("cp, window, doc_masking", [(2, 8, False), (2, 8, True), (4, 8, True), (4, 20, True),
                                                     (2, 64, True), (2, 5, False)])
def test_every_rank_attends_as_the_whole_row_does(cp, window, doc_masking):
    torch.manual_seed(0)
    b, t, heads, kv_heads, hd = 2, 64, 4, 2, 8
    q, k, v = torch.randn(b, t, heads, hd), torch.randn(b, t, kv_heads, hd), torch.randn(b, t, kv_heads, hd)
    docs = torch.tensor([[0] * 10 + [1] * 30 + [2] * 24, [0] * 64]) if doc_masking else None
    for layer_window in (window, None):  # a local layer, a global one
        mask = build_attention_mask(t, layer_window, docs, q.device)
        whole = scaled_dot_product(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, 0.3).transpose(1, 2)
        for rank in range(cp):
            index = context_token_index(t, cp, rank)

            def rows_of(s):
                i = context_token_index(t, cp, s)
                return torch.cat([k[:, i], v[:, i]], dim=-1).transpose(0, 1)

            shard = SequenceShard(cp, rank, index, docs, ExchangeByHand(cp, rank, rows_of, layer_window, t))
            attention = context_attention_mask(shard, layer_window, b, layer_attention_mask)
            ours = attention.attend(q[:, index], k[:, index], v[:, index], 0.3)
            torch.testing.assert_close(ours, whole[:, index], rtol=1e-5, atol=1e-6)


def cfg_with(corpus, tmp_path, seq_len=64, **parallel):
    return run_config(corpus, tmp_path, data={"seq_len": seq_len}, parallel=parallel)


def test_a_layout_cp_cannot_split_is_refused_in_one_line(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"^parallel.cp: data.seq_len=36 must be a multiple of 2 x cp x tp = 8"):
        ParallelDims.from_config(cfg_with(corpus, tmp_path, seq_len=36, cp=4), 4)
    with pytest.raises(ConfigError, match=r"^parallel.cp: must be >= 1, got 0"):
        cfg_with(corpus, tmp_path, cp=0)
    with pytest.raises(ConfigError, match=r"6 ranks cannot be split into dp_replicate=1 x cp=4 x tp=1 = 4 groups"):
        ParallelDims.from_config(cfg_with(corpus, tmp_path, cp=4), 6)
    with pytest.raises(ConfigError, match=r"dp_shard=2 x cp=2 x tp=1 = 4 ranks, but 8 processes"):
        ParallelDims.from_config(cfg_with(corpus, tmp_path, cp=2, dp_shard=2), 8)
    with pytest.raises(ConfigError, match=r"^parallel.cp: cp=2 would put its groups across nodes"):
        layout_on_nodes(cfg_with(corpus, tmp_path, cp=2), 4, Nodes(1, "test"))


def test_cp_ranks_shard_the_weights_and_lend_ranks_to_ep(corpus, tmp_path):
    dims = ParallelDims.from_config(cfg_with(corpus, tmp_path, cp=2, ep=4), 8)
    assert (dims.dp_shard, dims.cp, dims.dp, dims.fsdp_shards, dims.ep, dims.efsdp) == (4, 2, 4, 8, 4, 2)
    assert "cp=2" in dims.describe()
    # ep may take the cp ranks: two ranks, one row each, the experts split between them
    assert ParallelDims.from_config(cfg_with(corpus, tmp_path, cp=2, ep=2), 2).efsdp == 1


# ------------------------------------------------------------------- gloo ranks (slow)

# The setting on the smallest model that keeps its shape: three local layers to one global,
# three MoE layers with the sequence-wise aux loss and the router z-loss on, document masking.
LONG = {"model": {"num_layers": 4, "global_every": 4, "doc_masking": True, "aux_loss_alpha": 0.01,
                  "z_loss_weight": 0.001, "sliding_window": 128}, "data": {"seq_len": 4096}}
SHORT = merge_sections(LONG, {"model": {"sliding_window": 8}, "data": {"seq_len": 32}})
# Muon's exchange over the FSDP dim dp_shard_cp (and HSDP's 2-D mesh with it), at the short setting.
MUON = merge_sections(SHORT, {"optim": {"name": "muon", "muon_lr": 1e-2}})
REFERENCES = {"long": LONG, "short": SHORT, "muon": MUON}
# name: (reference, the parallel section[, other sections])
TWO_RANK = {"cp2": {"cp": 2}, "cp2_ep2": {"cp": 2, "ep": 2}}
FOUR_RANK = {"cp4": {"cp": 4}, "cp2_fsdp2": {"cp": 2, "dp_shard": 2}, "cp2_tp2": {"cp": 2, "tp": 2}}
TWO_RANK_LAYOUTS = {**{f"{ref}_{name}": (ref, parallel) for ref in ("long", "short") for name, parallel in TWO_RANK.items()},
                    # the recomputation exchanges the halos and gathers the keys again in backward
                    "short_cp2_checkpointed": ("short", {"cp": 2}, {"train": {"activation_checkpointing": True}}),
                    "muon_cp2": ("muon", {"cp": 2})}
FOUR_RANK_LAYOUTS = {**{f"{ref}_{name}": (ref, parallel) for ref in ("long", "short") for name, parallel in FOUR_RANK.items()},
                     "short_hsdp2_cp2": ("short", {"dp_replicate": 2, "dp_shard": 1, "cp": 2}),
                     "muon_hsdp2_cp2": ("muon", {"dp_replicate": 2, "dp_shard": 1, "cp": 2})}


def sections(layouts: dict) -> dict:
    """{layout: its config sections} for `run_layouts`."""
    return {name: merge_sections(REFERENCES[ref], {"parallel": parallel, **(other[0] if other else {})})
            for name, (ref, parallel, *other) in layouts.items()}


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory):
    """~70k tokens of documents of ~350 tokens: 4-row batches of 4,096 tokens for three steps."""
    root = tmp_path_factory.mktemp("long_corpus")
    return prepare_word_corpus(root, WORDS, seed=0, num_docs=200)


@pytest.fixture(scope="module")
def cp_runs(long_corpus, tmp_path_factory, rank_pool) -> dict:
    root = tmp_path_factory.mktemp("cp")
    references = {name: recorded(Trainer(layout_config(long_corpus, root / name, merge_sections(COMMON, setting), 1)))
                  for name, setting in REFERENCES.items()}
    return {"references": references,
            2: rank_pool(2).run(run_layouts, long_corpus, root / "two", sections(TWO_RANK_LAYOUTS), recorded, COMMON),
            4: rank_pool(4).run(run_layouts, long_corpus, root / "four", sections(FOUR_RANK_LAYOUTS), recorded,
                                COMMON)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [*TWO_RANK_LAYOUTS, *FOUR_RANK_LAYOUTS])
def test_context_parallel_layout_trains_like_one_process(cp_runs, layout):
    world = 2 if layout in TWO_RANK_LAYOUTS else 4
    reference = cp_runs["references"][{**TWO_RANK_LAYOUTS, **FOUR_RANK_LAYOUTS}[layout][0]]
    assert reference["losses"][-1] < reference["losses"][0]
    assert_run_matches(cp_runs[world], layout, reference)
    assert_stats_match(cp_runs[world], layout, reference)


def resume_config(corpus, run_dir, cp: int, steps: int, resume: str = "none"):
    """Four-row global batches (fixed whatever the layout), a checkpoint every 2 steps."""
    return layout_config(corpus, run_dir, merge_sections(SHORT, {
        "parallel": {"cp": cp}, "train": {"steps": steps, "global_batch_size": 4, "grad_accum": 1},
        "checkpoint": {"every": 2, "resume": resume}}), cp)


def cp2_run(corpus, run_dir) -> int:
    rank_trainer(resume_config(corpus, run_dir, cp=2, steps=2)).run()
    dist.barrier()
    return dist.get_rank()


def train_records(run_dir) -> list[tuple[int, int, float]]:
    """(step, global batch index, loss) of every training step."""
    return [(r["step"], r["batch"], r["loss"]) for r in read_jsonl(run_dir / "metrics.jsonl")
            if r["kind"] == RecordKind.TRAIN]


@pytest.mark.slow
def test_a_resume_that_changes_cp_keeps_the_data_order(long_corpus, tmp_path, rank_pool):
    rank_pool(2).run(cp2_run, long_corpus, tmp_path / "cp2")
    straight = tmp_path / "straight"
    Trainer(resume_config(long_corpus, straight, cp=1, steps=4)).run()
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "cp2" / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    Trainer(resume_config(long_corpus, resumed, cp=1, steps=4, resume="auto")).run()
    expected, first_two, ours = train_records(straight), train_records(tmp_path / "cp2"), train_records(resumed)
    assert [(s, b) for s, b, _ in first_two] == [(s, b) for s, b, _ in expected[:2]]
    assert [(s, b) for s, b, _ in ours] == [(s, b) for s, b, _ in expected[2:]]  # the same batches, in order
    for (_, _, loss), (_, _, want) in zip(first_two + ours, expected):
        assert loss == pytest.approx(want, rel=1e-5)


def phase_config(corpus, run_dir, source, steps: int, resume: str = "none"):
    """A context-extension phase (docs/guides/context-extension.md) of a cp=2 run: rows of 64
    tokens instead of 32, started from `source`'s newest checkpoint with its optimizer state."""
    return layout_config(corpus, run_dir, merge_sections(SHORT, {
        "parallel": {"cp": 2}, "data": {"seq_len": 64},
        "train": {"steps": steps, "global_batch_size": 4, "grad_accum": 1},
        "checkpoint": {"every": 2, "resume": resume, "init_from": str(source), "init_optimizer": True}}), 2)


def phase_run(corpus, run_dir, source, steps: int, resume: str) -> int:
    rank_trainer(phase_config(corpus, run_dir, source, steps, resume)).run()
    dist.barrier()
    return dist.get_rank()


@pytest.mark.slow
def test_an_extension_phase_under_cp_resumes_bit_exactly(long_corpus, tmp_path, rank_pool):
    """The phase stopped after its step 2 (as a kill leaves it: the step-2 checkpoint) and resumed
    trains steps 3 and 4 on the same batches with the same losses, bit for bit, as the phase run
    straight through."""
    pool = rank_pool(2)
    pool.run(cp2_run, long_corpus, tmp_path / "source")
    pool.run(phase_run, long_corpus, tmp_path / "straight", tmp_path / "source", 4, "none")
    pool.run(phase_run, long_corpus, tmp_path / "resumed", tmp_path / "source", 2, "none")
    pool.run(phase_run, long_corpus, tmp_path / "resumed", tmp_path / "source", 4, "auto")
    straight, resumed = train_records(tmp_path / "straight"), train_records(tmp_path / "resumed")
    assert [s for s, _, _ in straight] == [1, 2, 3, 4]
    assert resumed == straight
