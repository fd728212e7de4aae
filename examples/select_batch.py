"""What each D3S / PODS preset keeps from one batch of rollouts.

Builds a synthetic GRPO batch (by default 4 prompts x G=8 rollouts, binary rewards, random
response lengths, random per-token entropies of the old policy), runs every preset of
``nemo_d3s.core.PRESETS`` through :class:`nemo_d3s.core.D3SSelector` and prints one row
per preset:

- kept samples / kept tokens: how much of the batch would get a gradient;
- Var(A) kept: unbiased variance of the advantages of all kept samples, pooled over the
  prompts. D3S keeps the samples that maximise it (a larger Var(A) raises the lower bound
  on the policy-gradient norm): ``d3s_cross`` over the pooled batch, ``d3s_intra`` within
  each prompt. PODS instead re-normalises the advantages of the kept rollouts within each
  prompt, so its value is on a different scale (+-0.71 for two kept rollouts);
- share A != 0: kept samples that carry any gradient at all. A prompt whose G rollouts all
  got the same reward has A = 0 for every rollout. GRPO and the per-prompt rules still
  spend compute on such prompts; the cross-prompt rule drops them first.

Only ``nemo_d3s.core`` is used: no model, no torch.distributed. Runs on CPU in a few
seconds::

    python examples/select_batch.py
    python examples/select_batch.py --prompts 8 --group-size 16 --progress 1.0

``--progress`` is the training progress p in [0, 1]; only the presets with a dynamic
schedule (d3s, d3s_i) change with it (N and K grow linearly from p = 0 to p = 1). The K
column is the K used: d3s and d3s_i keep at least 256 tokens a step (``min_kept_tokens``),
which on a batch this small raises K above the schedule's; ``--min-kept-tokens 0`` shows the
papers' rule (K from the schedule alone).
"""

from __future__ import annotations

import argparse

import torch

from nemo_d3s.core import PRESETS, D3SConfig, D3SSelector, resolve_n_keep


def synthetic_batch(n_prompts: int, group_size: int, max_len: int, prompt_len: int, seed: int):
    """A batch laid out the way a GRPO trainer holds it after generation and scoring.

    Returns (rewards [B] f32, group_ids [B] long, response_mask [B, S] bool,
    entropy [B, S] f32) with B = n_prompts x group_size, S = prompt_len + max_len.
    Rows of one prompt are contiguous; ``group_ids`` names the prompt of every row.
    """
    g = torch.Generator().manual_seed(seed)
    B, S = n_prompts * group_size, prompt_len + max_len
    group_ids = torch.arange(n_prompts).repeat_interleave(group_size)

    # Prompts of graded difficulty: success rates from hard to easy. The easiest prompt is
    # solved by every rollout, so its group is degenerate (all rewards equal -> A = 0),
    # which is what makes "share A != 0" differ between the presets.
    p_success = torch.linspace(0.15, 0.85, n_prompts)
    rewards = (torch.rand(B, generator=g) < p_success.repeat_interleave(group_size)).float()
    rewards[group_ids == n_prompts - 1] = 1.0

    # Responses of random length start after the prompt; only they are loss-eligible.
    lengths = torch.randint(max_len // 4, max_len + 1, (B,), generator=g)
    pos = torch.arange(S)
    response_mask = (pos >= prompt_len) & (pos < prompt_len + lengths.unsqueeze(1))

    # Next-token entropies of the old policy: mostly low (confident tokens) with a heavy
    # tail of "forking" tokens, roughly the shape seen in LLM rollouts. 0 off the response.
    entropy = torch.empty(B, S).exponential_(2.0, generator=g) * response_mask
    return rewards, group_ids, response_mask, entropy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8, help="G, rollouts per prompt")
    ap.add_argument("--max-len", type=int, default=48, help="longest response, tokens")
    ap.add_argument("--progress", type=float, default=0.0, help="training progress p in [0, 1]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--min-kept-tokens",
        type=int,
        default=None,
        help="floor on kept tokens for every preset (default: each preset's own; 0 = none)",
    )
    args = ap.parse_args()

    rewards, group_ids, response_mask, entropy = synthetic_batch(
        args.prompts, args.group_size, args.max_len, prompt_len=6, seed=args.seed
    )
    B = rewards.numel()
    n_tokens = int(response_mask.sum())
    print(
        f"batch: {args.prompts} prompts x G={args.group_size} = {B} rollouts, "
        f"{n_tokens} response tokens, progress p={args.progress:g}"
    )
    print(
        "rewards per prompt:",
        [int(rewards[group_ids == i].sum()) for i in range(args.prompts)],
        f"correct of {args.group_size}",
    )
    print()

    header = (
        f"{'preset':<10} {'samples':<10} {'tokens':<9} {'N/prompt':>8} {'K':>5}  "
        f"{'kept samples':>12}  {'kept tokens':>15}  {'Var(A) kept':>11}  {'share A!=0':>10}"
    )
    print(header)
    print("-" * len(header))
    one_per_prompt = []
    for name in PRESETS:
        # from_preset returns a copy: the shared PRESETS entries are never modified.
        floor = {} if args.min_kept_tokens is None else {"min_kept_tokens": args.min_kept_tokens}
        cfg = D3SConfig.from_preset(name, **floor)
        selector = D3SSelector(cfg)
        # apply() = select_samples() then select_tokens() on the kept rows. A trainer calls
        # the two stages separately so that entropy is only computed for the kept rows.
        stage, tokens = selector.apply(rewards, group_ids, entropy, response_mask, args.progress)
        n_per_prompt = resolve_n_keep(stage.n_keep, args.group_size)
        if n_per_prompt == 1 and cfg.sample_rule in ("pods", "d3s_intra"):
            one_per_prompt.append(name)
        sm, tm = stage.metrics, tokens.metrics
        kept_s, kept_t = int(sm["n_kept_samples"]), int(tm["n_kept_tokens"])
        print(
            f"{name:<10} {cfg.sample_rule:<10} {cfg.token_scope:<9} {n_per_prompt:>8d} "
            f"{tokens.k_frac:>5.2f}  {f'{kept_s}/{B}':>12}  "
            f"{f'{kept_t}/{n_tokens} ({kept_t / n_tokens:4.0%})':>15}  "
            f"{sm['kept_adv_var']:>11.3f}  {sm['share_nonzero_adv']:>10.2f}"
        )
    print()
    print(
        "Var(A) kept: unbiased variance of the kept advantages, pooled over prompts "
        "(pods: re-normalised within each prompt)."
    )
    print(
        "share A!=0: kept rollouts of prompts whose rewards differ (only these carry a gradient)."
    )
    if one_per_prompt:
        # The preset's N is a fraction of G (1/8 at p = 0); with a small G that rounds to one
        # rollout per prompt, where a per-prompt max-variance rule has no choice to make.
        print(
            f"note: {', '.join(one_per_prompt)} keep(s) 1 rollout per prompt here: a "
            "single value has no variance, so every choice ties and the rule keeps the "
            "rollout farthest from its prompt's mean (the largest |A|); use a larger G or "
            "--progress."
        )


if __name__ == "__main__":
    main()
