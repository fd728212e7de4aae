"""The GRPO loss and its global normaliser that the Megatron backend tests hand to
``backend.update`` (the trainer's own ``make_loss_fn``, one minibatch, input checks off)."""

from __future__ import annotations

import torch


def grpo_loss_fn(batch, old_lp, adv, keep, agg):
    """``make_loss_fn("grpo", ...)`` over ``batch`` [B, S] with one minibatch."""
    from nemo_d3s.core.losses import LossConfig
    from nemo_d3s.trainer.update import UpdateBatch, make_loss_fn

    upd = UpdateBatch(
        batch=batch,
        old_logprobs=old_lp,
        advantages=adv,
        token_keep=keep,
        minibatch=torch.zeros(len(batch), dtype=torch.long),
    )
    return make_loss_fn("grpo", LossConfig(aggregation=agg, check_inputs=False), upd)


def denominator(keep, agg) -> float:
    """The loss's global normaliser over every kept token of the step."""
    from nemo_d3s.core.losses import loss_denominator

    return float(loss_denominator(keep, agg))
