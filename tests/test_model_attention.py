"""Attention masks, per-document positions, RoPE placement and document masking end to end."""

import pytest
import torch

from conftest import tiny_model
from trinity_train.config import ModelConfig
from trinity_train.model import build_model
from trinity_train.model.attention import build_attention_mask, positions_from_documents
from trinity_train.model.blocks import layer_rope_theta


def tiny(**overrides) -> ModelConfig:
    return tiny_model(**{"sliding_window": 3, **overrides})


def test_sliding_window_sees_the_last_w_keys_including_itself():
    mask = build_attention_mask(6, 3, None, torch.device("cpu"))[0, 0]
    for q in range(6):
        assert mask[q].nonzero().flatten().tolist() == [k for k in range(6) if q - 3 < k <= q]
    assert build_attention_mask(6, None, None, torch.device("cpu")) is None  # fused causal path
    assert build_attention_mask(6, 6, None, torch.device("cpu")) is None  # window covers it all


def test_document_mask_blocks_keys_of_other_documents():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = build_attention_mask(6, None, docs, torch.device("cpu"))[0, 0]
    assert mask[4].nonzero().flatten().tolist() == [2, 3, 4]
    assert mask[5].nonzero().flatten().tolist() == [5]
    windowed = build_attention_mask(6, 2, docs, torch.device("cpu"))[0, 0]
    assert windowed[4].nonzero().flatten().tolist() == [3, 4]


def test_positions_restart_at_every_document():
    docs = torch.tensor([[3, 3, 3, 7, 7, 9], [1, 1, 1, 1, 1, 1]])
    assert positions_from_documents(docs).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_rope_only_on_local_layers_except_in_gemma3():
    trinity = tiny(num_layers=8)
    assert [layer_rope_theta(trinity, i) for i in range(8)] == [1e4, 1e4, 1e4, None] * 2
    gemma = tiny(num_layers=12, block="gemma3")
    thetas = [layer_rope_theta(gemma, i) for i in range(12)]
    assert thetas == ([1e4] * 5 + [1e6]) * 2


@pytest.mark.parametrize("block", ["trinity", "gemma3"])
def test_doc_masking_makes_each_document_independent(block):
    """A packed document gives the same logits as the document on its own (no attention across
    the boundary, positions restart), which is false without document masking."""
    torch.manual_seed(0)
    cfg = tiny(block=block, doc_masking=True, num_layers=6 if block == "gemma3" else 4)
    model = build_model(cfg)
    first, second = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 7))
    packed = torch.cat([first, second], dim=1)
    docs = torch.tensor([[0] * 5 + [1] * 7])
    with torch.no_grad():
        together = model(packed, document_ids=docs).logits
        alone = model(second).logits
        torch.testing.assert_close(together[:, 5:], alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(together[:, :5], model(first).logits, atol=1e-5, rtol=1e-5)
        changed = model(torch.cat([first.flip(1), second], dim=1), document_ids=docs).logits
        torch.testing.assert_close(changed[:, 5:], alone, atol=1e-5, rtol=1e-5)

        model.cfg.doc_masking = False  # the same call then attends across the boundary
        leaky = model(packed, document_ids=docs).logits
    assert (leaky[:, 5:] - alone).abs().max() > 1e-3


def test_local_layers_ignore_keys_outside_the_window():
    torch.manual_seed(0)
    cfg = tiny(num_layers=1, num_dense_layers=1, global_every=100)  # one local layer only
    model = build_model(cfg)
    ids = torch.randint(0, 64, (1, 8))
    edited = ids.clone()
    edited[0, 0] = (ids[0, 0] + 1) % 64
    with torch.no_grad():
        a, b = model(ids).logits, model(edited).logits
    assert (a[0, :3] - b[0, :3]).abs().max() > 1e-4  # positions 0-2 see position 0
    torch.testing.assert_close(a[0, 3:], b[0, 3:])  # window 3: position 3 on no longer does


def test_masks_and_rotary_tables_are_built_once_per_forward_per_layer_kind(monkeypatch):
    import trinity_train.model.transformer as transformer

    calls = {"mask": 0, "rotary": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(transformer, "build_attention_mask",
                        counting("mask", transformer.build_attention_mask))
    monkeypatch.setattr(transformer, "rotary_cos_sin", counting("rotary", transformer.rotary_cos_sin))
    model = build_model(tiny(num_layers=8, doc_masking=True))  # 6 local + 2 global layers
    model(torch.randint(0, 64, (2, 6)), document_ids=torch.zeros(2, 6, dtype=torch.long))
    assert calls == {"mask": 2, "rotary": 1}
