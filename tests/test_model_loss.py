"""Chunked cross entropy agrees with the full computation and never holds all fp32 logits."""

import pytest
import torch
import torch.nn.functional as F

from trinity_train.model.loss import chunked_cross_entropy


def full_ce_sum(hidden, labels, head):
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 7, 23, 1000])  # 23 tokens: uneven and single-chunk cases
def test_chunked_and_full_cross_entropy_agree_in_values_and_gradients(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(23, 16, requires_grad=True)
    labels = torch.randint(0, 50, (23,))
    labels[[0, 5, 6, 22]] = -100

    ce_sum, num_tokens = chunked_cross_entropy(hidden, labels, head, chunk)
    ce_sum.backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = None
    head.weight.grad = None
    expected = full_ce_sum(hidden, labels, head)
    expected.backward()

    assert num_tokens.item() == 19 and num_tokens.dtype == torch.long
    assert ce_sum.dtype == torch.float32
    torch.testing.assert_close(ce_sum, expected)
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], head.weight.grad)


def test_bf16_logits_are_upcast_per_chunk():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).to(torch.bfloat16)
    hidden = torch.randn(12, 16, dtype=torch.bfloat16)
    labels = torch.randint(0, 50, (12,))
    with torch.no_grad():
        ce_sum, _ = chunked_cross_entropy(hidden, labels, head, 5)
    assert ce_sum.dtype == torch.float32
    torch.testing.assert_close(ce_sum, full_ce_sum(hidden, labels, head))


def test_backward_recomputes_chunk_logits_instead_of_keeping_them():
    head = torch.nn.Linear(8, 1000, bias=False)
    hidden = torch.randn(64, 8, requires_grad=True)
    labels = torch.randint(0, 1000, (64,))
    logits_numel = 64 * 1000
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ce_sum, _ = chunked_cross_entropy(hidden, labels, head, 16)
    # Only small tensors (inputs of each chunk) are kept by the graph, never a chunk's logits.
    assert max(saved) < 16 * 1000, saved
    assert sum(saved) < logits_numel
    ce_sum.backward()
    assert hidden.grad is not None


def _fused_loss_peak(tokens: int, chunk: int, vocab: int = 4000, width: int = 8) -> int:
    """Peak bytes the fused loss's forward allocates (MemTracker, torch.distributed._tools)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    head = torch.nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(tokens, width, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    tracker = MemTracker()
    tracker.track_external(head, hidden)
    with tracker:
        chunked_cross_entropy(hidden, labels, head, chunk)
    return sum(tracker.get_tracker_snapshot("peak")[torch.device("cpu")].values())


def test_one_chunk_of_logits_lives_at_a_time():
    # Four chunks of 64 tokens peak like one: each chunk frees its [64, 4000] fp32 logits and
    # their cast before the next allocates its own (about 1.5 MB a chunk).
    one, four = _fused_loss_peak(64, 64), _fused_loss_peak(256, 64)
    per_chunk = 64 * 4000 * (4 + 4)
    assert four - one < per_chunk / 4, (one, four)


RSS_PROBE = """
import ctypes, pathlib, torch
from trinity_train.model.loss import chunked_cross_entropy
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD: big blocks mmapped on their own, unmapped when freed
libc.mallopt(-1, 65536)  # M_TRIM_THRESHOLD
torch.set_num_threads(1)
head = torch.nn.Linear(16, 16384, bias=False)
hidden = torch.randn(2048, 16, requires_grad=True)
labels = torch.randint(0, 16384, (2048,))
chunked_cross_entropy(hidden, labels, head, 2048)  # warm-up: the allocator's own first needs

def rss(field):
    line = next(l for l in pathlib.Path("/proc/self/status").read_text().splitlines() if l.startswith(field))
    return int(line.split()[1]) * 1024

pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
before = rss("VmRSS")
chunked_cross_entropy(hidden, labels, head, 2048)
print(rss("VmHWM") - before)
"""


def test_logsumexp_by_row_blocks_is_bitwise_one_call():
    from trinity_train.model.loss import logsumexp_by_row_blocks

    torch.manual_seed(0)
    logits = torch.randn(3000, 4000) * 5  # 48 MB: three row blocks, the last one short
    assert torch.equal(logsumexp_by_row_blocks(logits), torch.logsumexp(logits, dim=-1, keepdim=True))


def test_the_fused_loss_holds_one_logits_buffer_not_two():
    # What a memory tracker cannot see: buffers an op allocates inside itself (torch.logsumexp
    # makes one as large as its input, so the loss hands it 32 MiB row blocks). Measured by the
    # OS: the peak RSS over one fused forward of a 2,048 x 16,384 chunk (128 MiB of fp32 logits)
    # above the RSS before it.
    from conftest import run_python

    logits_bytes = 2048 * 16384 * 4
    growth = int(run_python("-c", RSS_PROBE).stdout.split()[-1])
    assert logits_bytes <= growth < 1.5 * logits_bytes, growth / logits_bytes
