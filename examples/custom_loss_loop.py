"""Plug the D3S core into your own PyTorch training loop: one GRPO step, end to end.

The steps are the ones any GRPO trainer runs, with the two D3S selections in between:

1. rollouts: G sampled responses per prompt from a tiny causal LM (embedding, causal
   prefix mean, linear LM head), and a toy verifiable reward per response;
2. sample selection (``D3SSelector.select_samples``): advantages on the FULL groups, then
   keep N rollouts per prompt (no model call needed);
3. old log-probs AND entropy of the kept rows in one no-grad forward
   (``core.entropy.entropy_and_logprobs`` + ``align_to_tokens``);
4. token selection (``D3SSelector.select_tokens``): top K% of |A| x H;
5. compaction: drop rows with no kept token (``rows_with_kept_tokens``) and cut every
   sequence after its last kept token (``kept_lengths``) - a causal model's log-prob of a
   kept token does not depend on later positions, so this changes no gradient;
6. the loss denominator is a GLOBAL count (``loss_denominator`` summed over all
   micro-batches, and over data-parallel ranks in a multi-GPU run) fixed BEFORE the
   micro-batch loop, so gradient accumulation gives exactly the full-batch gradient;
7. micro-batched forward/backward with ``policy_loss`` and one optimizer step.

The script checks steps 5-7 on the spot: it also computes the gradient of the same loss in
one full-batch pass over the uncompacted kept rows and asserts that the two agree (exit
code 1 if not). Runs on CPU in a few seconds::

    python examples/custom_loss_loop.py
    python examples/custom_loss_loop.py --preset d3s_i --loss gspo --aggregation seq_mean_token_mean
    python examples/custom_loss_loop.py --preset grpo --micro-batch-size 3

Only ``nemo_d3s.core`` is used. In a data-parallel job, the one extra line is an
all-reduce (SUM) of the denominator over the DP group, and a DP-global token selection
(``nemo_d3s.distributed``) instead of the per-process one; see examples/megatron_hooks.py.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List

import torch
from torch import nn

from nemo_d3s.core import (
    AGGREGATIONS,
    PRESETS,
    D3SConfig,
    D3SSelector,
    LossConfig,
    align_to_tokens,
    entropy_and_logprobs,
    finalize_metrics,
    kept_lengths,
    loss_denominator,
    policy_loss,
    rows_with_kept_tokens,
)

PAD = 0


class TinyCausalLM(nn.Module):
    """ids [b, L] long -> logits [b, L, V]; position s sees tokens 0..s only.

    A prefix mean of the token embeddings stands in for attention: it is causal, so the
    compaction of step 5 is exercised for real (an embedding-only bigram model would make
    it trivially true).
    """

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.mix = nn.Linear(2 * dim, dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        steps = torch.arange(1, ids.shape[1] + 1, device=ids.device, dtype=x.dtype)
        prefix_mean = x.cumsum(dim=1) / steps[None, :, None]
        return self.lm_head(torch.tanh(self.mix(torch.cat([x, prefix_mean], dim=-1))))


def token_logprobs_and_entropy(model: nn.Module, ids: torch.Tensor):
    """(log-probs [b, L], entropy [b, L]) of every token of ``ids`` under ``model``,
    token-aligned: position t scores token t from the logits at t - 1; position 0 is 0.
    log-probs are differentiable; entropy never is."""
    logits = model(ids)
    entropy, logprobs = entropy_and_logprobs(logits[:, :-1], ids[:, 1:])
    return align_to_tokens(logprobs), align_to_tokens(entropy)


@torch.no_grad()
def generate_rollouts(model, n_prompts, group_size, prompt_len, max_new, vocab_size, gen):
    """Sample G responses per prompt. Returns ids [B, S], response_mask [B, S] bool,
    group_ids [B] long, rewards [B] f32 (B = n_prompts x G, S = prompt_len + max_new)."""
    prompts = torch.randint(2, vocab_size, (n_prompts, prompt_len), generator=gen)
    ids = prompts.repeat_interleave(group_size, dim=0)
    for _ in range(max_new):
        probs = torch.softmax(model(ids)[:, -1], dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    B, S = ids.shape
    # A stop token would end responses at different lengths; draw the lengths instead.
    lengths = torch.randint(max_new // 3, max_new + 1, (B,), generator=gen)
    pos = torch.arange(S)
    response_mask = (pos >= prompt_len) & (pos < prompt_len + lengths[:, None])
    ids = torch.where(response_mask | (pos < prompt_len), ids, torch.full_like(ids, PAD))
    # Toy verifiable reward: 1 when most response tokens are in the lower half of the vocabulary.
    low = ((ids < vocab_size // 2) & response_mask).sum(dim=1)
    rewards = (2 * low > lengths).float()
    group_ids = torch.arange(n_prompts).repeat_interleave(group_size)
    return ids, response_mask, group_ids, rewards


def micro_batches(n: int, size: int) -> List[torch.Tensor]:
    return list(torch.arange(n).split(size))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="d3s", choices=sorted(PRESETS))
    ap.add_argument("--loss", default="grpo", help="grpo | gspo | gspo_token")
    ap.add_argument("--aggregation", default="token_mean", choices=AGGREGATIONS)
    ap.add_argument("--progress", type=float, default=0.5, help="training progress p in [0, 1]")
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    V, n_prompts, G = 64, 8, 8
    model = TinyCausalLM(V, dim=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    selector = D3SSelector(D3SConfig.from_preset(args.preset))
    loss_cfg = LossConfig(aggregation=args.aggregation)

    # 1. rollouts --------------------------------------------------------------------
    ids, response_mask, group_ids, rewards = generate_rollouts(
        model, n_prompts, G, prompt_len=5, max_new=24, vocab_size=V, gen=gen
    )
    print(
        f"rollouts: {ids.shape[0]} = {n_prompts} prompts x G={G}, "
        f"{int(response_mask.sum())} response tokens, mean reward {rewards.mean():.2f}"
    )

    # 2. sample selection: advantages on full groups, keep N per prompt ------------------
    stage = selector.select_samples(rewards, group_ids, args.progress)
    if stage.all_degenerate:
        # Every group has equal rewards: A = 0 everywhere, no gradient. Skip the update
        # (and keep advancing the schedule), as the nemo_d3s trainer does.
        print("every group had equal rewards: update skipped")
        return 0
    rows = stage.kept_rows
    print(
        f"sample selection ({args.preset}): kept {rows.numel()}/{ids.shape[0]} rollouts, "
        f"Var(A) of kept {stage.metrics['kept_adv_var']:.3f}"
    )

    # 3. old log-probs + entropy of the kept rows, one no-grad pass -----------------------
    # (A real trainer does this in micro-batches too; both are per-row quantities.)
    kept_ids, kept_resp = ids[rows], response_mask[rows]
    with torch.no_grad():
        old_logprobs, entropy = token_logprobs_and_entropy(model, kept_ids)

    # 4. token selection: top K% of |A| x H among the kept rows' response tokens ----------
    tokens = selector.select_tokens(stage, entropy, kept_resp, args.progress)
    token_keep = tokens.token_keep
    n_kept = int(tokens.metrics["n_kept_tokens"])
    if n_kept == 0:
        print("no token kept: update skipped")
        return 0
    print(f"token selection: kept {n_kept}/{int(kept_resp.sum())} tokens (K={tokens.k_frac:.3f})")

    # 5. compaction -----------------------------------------------------------------------
    live = rows_with_kept_tokens(token_keep)
    cut = int(kept_lengths(token_keep[live]).max())
    c_ids, c_mask = kept_ids[live, :cut], token_keep[live, :cut]
    c_old, c_adv = old_logprobs[live, :cut], stage.kept_advantages[live]
    print(
        f"compaction: {live.numel()} rows x {cut} positions (from {kept_ids.shape[0]} x "
        f"{kept_ids.shape[1]})"
    )

    # 6. global denominator, fixed before the micro-batch loop ---------------------------
    mbs = micro_batches(live.numel(), args.micro_batch_size)
    denominator = sum(loss_denominator(c_mask[mb], args.aggregation) for mb in mbs)
    # Data parallel: torch.distributed.all_reduce(torch.tensor(denominator), group=dp_group)
    # here, so that every rank divides by the same global count.

    # 7. micro-batched loss and backward ---------------------------------------------------
    optimizer.zero_grad(set_to_none=True)
    summed: Dict[str, float] = {}
    total_loss = 0.0
    for mb in mbs:
        # Each micro-batch is cut again to its own longest kept prefix: less compute.
        mb_cut = int(kept_lengths(c_mask[mb]).max())
        logprobs, _ = token_logprobs_and_entropy(model, c_ids[mb, :mb_cut])
        out = policy_loss(
            args.loss,
            logprobs,
            c_old[mb, :mb_cut],
            c_adv[mb],
            c_mask[mb, :mb_cut],
            cfg=loss_cfg,
            denominator=denominator,
        )
        out.loss.backward()  # gradients accumulate in .grad across micro-batches
        total_loss += float(out.loss.detach())
        for k, v in out.metrics.items():
            summed[k] = summed.get(k, 0.0) + v
    micro_grads = [p.grad.detach().clone() for p in model.parameters()]

    # Check: the same loss over the UNcompacted kept rows in one pass, with this batch's
    # own denominator. Same value and gradient => compaction + micro-batching are exact.
    logprobs, _ = token_logprobs_and_entropy(model, kept_ids)
    full = policy_loss(
        args.loss,
        logprobs,
        old_logprobs,
        stage.kept_advantages,
        token_keep,
        cfg=loss_cfg,
        denominator=loss_denominator(token_keep, args.aggregation),
    )
    full_grads = torch.autograd.grad(full.loss, list(model.parameters()))
    # fp32 sums in a different order: agreement to rounding, not bit for bit.
    try:
        torch.testing.assert_close(
            torch.tensor(total_loss), full.loss.detach(), rtol=1e-5, atol=1e-7
        )
        for g_micro, g_full in zip(micro_grads, full_grads):
            torch.testing.assert_close(g_micro, g_full, rtol=1e-4, atol=1e-7)
    except AssertionError as e:
        print(f"CHECK FAILED: micro-batched gradient != full-batch gradient\n{e}", file=sys.stderr)
        return 1
    grad_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in micro_grads))
    print(
        f"check: {len(mbs)} micro-batches give the full-batch loss and gradient "
        f"(loss {total_loss:.6f}, |grad| {grad_norm:.6f})"
    )

    optimizer.step()
    m = finalize_metrics(summed)
    print(
        f"optimizer step done: loss={args.loss} aggregation={args.aggregation} "
        f"denominator={denominator:g} tokens={int(m['token_count'])} "
        f"clip_frac={m['clip_frac_low'] + m['clip_frac_high']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
