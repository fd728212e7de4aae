"""The GRPO loss and its global normaliser that the Megatron backend tests hand to
``backend.update`` (the trainer's own, one minibatch, input checks off)."""

from __future__ import annotations


def grpo_loss_fn(batch, old_lp, adv, keep, agg):
    """``trainer.update.one_minibatch_loss_fn`` with GRPO over ``batch`` [B, S]."""
    from nemo_d3s.trainer.update import one_minibatch_loss_fn

    return one_minibatch_loss_fn(batch, old_lp, adv, keep, aggregation=agg)


def denominator(keep, agg) -> float:
    """The loss's global normaliser over every kept token of the step."""
    from nemo_d3s.core.losses import loss_denominator

    return float(loss_denominator(keep, agg))
