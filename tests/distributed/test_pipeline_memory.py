"""The training loss function's backward holds ONE gradient of the last stage's logits.

``pipeline.train_loss_func`` scores token t from the logits at t - 1. Scoring the view
``logits[:, :-1]`` gave the right numbers but made the backward allocate two [b, L, V/TP]
buffers: the kernel's gradient of the slice, then the slice's backward zero-filled the full shape
and copied into it. At 70B (TP 8, V 128k) that is one more ~0.25 GB buffer per micro-batch on
the last stage, which the dry run's logits term (3 x, ``dry_run/memory.py``) does not plan for.
These tests count the new storages of at least [b, L-1, V] elements created during backward
(a dispatch mode sees every op autograd runs), and check the gradient against the sliced
reference, single process (``tp_group=None``; the TP ranks' kernel is compared to the
single-process one in ``test_dist_vocab_parallel.py`` and ``test_dist_megatron_grads.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nemo_d3s.core.entropy import align_to_tokens, entropy_and_logprobs
from nemo_d3s.distributed.normalizers import StepNormalizer
from nemo_d3s.distributed.pipeline import train_loss_func

B, L, V = 2, 6, 11
CHUNK = 3  # chunk buffers [3, V] stay far below the [B, L-1, V] threshold


class _NewStorages(TorchDispatchMode):
    """Distinct storages of >= ``numel`` elements that ops create (views of an existing
    storage, and in-place results, are not new)."""

    def __init__(self, numel, known):
        super().__init__()
        self.numel, self.known, self.new = numel, set(known), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.known:
                    self.known.add(ptr)
                    self.new.append(str(func))
        return out


def _sum_loss(lp, rows):
    weights = torch.arange(1, lp.numel() + 1, dtype=lp.dtype).view_as(lp)
    return (lp * weights).sum()


@pytest.mark.parametrize("seq_first", [False, True])
def test_backward_allocates_one_logits_gradient(seq_first):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, L), generator=g)
    base = torch.randn(B, L, V, generator=g, dtype=torch.float64)
    logits = (base.transpose(0, 1).contiguous() if seq_first else base.clone()).requires_grad_()
    attended = torch.ones(B, L, dtype=torch.bool)
    attended[1, -2:] = False
    fn = train_loss_func(
        ids,
        attended,
        torch.arange(B),
        _sum_loss,
        StepNormalizer(denominator=1.0, megatron_schedule=False),
        None,
        chunk_size=CHUNK,
        seq_first=seq_first,
    )
    loss, _ = fn(logits)
    mode = _NewStorages(B * (L - 1) * V, [logits.untyped_storage().data_ptr()])
    with mode:
        loss.backward()
    # seq_first (no caller in the backend: GPTModel hands it batch-first logits) adds the leaf's
    # stride-matching copy of a transposed gradient, which a non-leaf's backward would not make.
    if not seq_first:
        assert len(mode.new) == 1, (
            f"backward created {len(mode.new)} logits-sized buffers: {mode.new}"
        )

    # The sliced reference: token t from the logits at t - 1, position 0 and unattended tokens 0.
    ref = base.clone().requires_grad_()
    _, lp = entropy_and_logprobs(ref[:, :-1], ids[:, 1:], chunk_size=CHUNK)
    ref_loss = _sum_loss(align_to_tokens(lp).float() * attended, None)
    ref_loss.backward()
    got = logits.grad.transpose(0, 1) if seq_first else logits.grad
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=0, atol=0)
    torch.testing.assert_close(got, ref.grad, rtol=0, atol=0)
    assert bool((got[:, -1] == 0).all())  # the last position scores nothing


def test_context_parallel_scoring_refuses_targets_shifted_by_the_caller():
    """The CP path scores position t from the logits at t - 1 itself: targets already shifted
    would be shifted twice (token t + 2 scored at t), so they are refused."""
    from nemo_d3s.distributed.pipeline import PerTokenStore, logprob_loss_func

    fn = logprob_loss_func(PerTokenStore(), torch.zeros(1, 4, dtype=torch.long), None, cp=object())
    with pytest.raises(ValueError, match="token_aligned"):
        fn(torch.zeros(1, 4, V))
