"""model/loss.py's chunked cross-entropy: the loss and gradients of ``F.cross_entropy(logits.float(), targets)``
(what ``cross_entropy_loss`` computed before) within fp32 rounding, chunk boundaries included, ignored
targets included, and no fp32 copy of the whole logits kept for backward (the old formula keeps one: the
negative control)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.config.model import ModelConfig
from lmforge.model import loss as loss_module
from lmforge.model.gpt import GPT, cross_entropy_loss
from lmforge.model.loss import IGNORE_INDEX, chunked_cross_entropy

pytestmark = pytest.mark.usefixtures("one_thread")

N, V = 70, 300


def reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets)  # the formula cross_entropy_loss used before


def batch(dtype: torch.dtype, ignored: int = 9):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(N, V, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[torch.randperm(N, generator=gen)[:ignored]] = IGNORE_INDEX  # data.loss_after_eod=mask
    return logits, targets


def loss_and_grad(fn, logits, targets):
    x = logits.clone().requires_grad_(True)
    loss = fn(x, targets)
    loss.backward()
    return loss.detach(), x.grad


def saved_bytes(fn, logits, targets) -> dict:
    """dtype -> largest tensor (elements) autograd keeps for backward of ``fn`` (the inputs' own storage excluded)."""
    kept = {}

    def pack(t):
        if t.data_ptr() != logits.data_ptr():
            kept[t.dtype] = max(kept.get(t.dtype, 0), t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits, targets)
    return kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_gradient_equal_cross_entropy_across_chunks(monkeypatch, dtype):
    logits, targets = batch(dtype)
    want_loss, want_grad = loss_and_grad(reference, logits, targets)
    for chunk in (3 * V + 7, 10**9):  # uneven chunks (24 of them, the last short) and one chunk
        monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", chunk)
        got_loss, got_grad = loss_and_grad(chunked_cross_entropy, logits, targets)
        assert got_loss.dtype == torch.float32 and got_grad.dtype == dtype
        torch.testing.assert_close(got_loss, want_loss, rtol=2e-6, atol=0)
        if dtype == torch.float32:
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-8)
        else:  # both round the same fp32 gradient to bf16: at most one bf16 step apart
            torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=2**-7, atol=1e-7)
        assert got_grad[targets == IGNORE_INDEX].abs().max() == 0  # ignored rows get no gradient


def test_all_targets_ignored_is_nan_like_torch():
    logits, targets = batch(torch.float32)
    targets[:] = IGNORE_INDEX
    assert reference(logits, targets).isnan() and chunked_cross_entropy(logits, targets).isnan()


def test_no_fp32_copy_of_the_logits_is_kept_for_backward():
    logits, targets = batch(torch.bfloat16)
    logits.requires_grad_(True)
    new = saved_bytes(chunked_cross_entropy, logits, targets)
    old = saved_bytes(reference, logits, targets)
    assert old.get(torch.float32, 0) == N * V  # negative control: the old formula keeps fp32 log-probabilities
    assert max(new.values()) <= N  # the chunked loss: the logits themselves (excluded above) and the targets
    assert new.get(torch.float32, 0) == 0 and new.get(torch.bfloat16, 0) == 0


def test_model_gradients_equal_the_old_loss():
    cfg = ModelConfig(name="loss_tiny", vocab_size=512, d_model=64, n_layers=2, n_heads=4, seq_len=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    grads = []
    for fn in (cross_entropy_loss, lambda lg, t: reference(lg.flatten(0, 1), t.flatten(0, 1))):
        model.zero_grad(set_to_none=True)
        loss = fn(model(tokens), tokens)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (new_loss, new), (old_loss, old) = grads
    torch.testing.assert_close(new_loss, old_loss, rtol=2e-6, atol=0)
    for name in old:
        torch.testing.assert_close(new[name], old[name], rtol=1e-4, atol=1e-6, msg=name)
