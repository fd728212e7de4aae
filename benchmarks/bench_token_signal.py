"""How much of a batch's policy gradient do D3S's top-K% tokens carry, against other picks?

D3S keeps the K% of response tokens with the largest |A| x H. This measures, on real
rollouts of the CPU default's policy (SmolLM2-135M) on ``task=basic_arithmetic_2d``, the
cosine between the gradient of the loss restricted to the kept tokens and the gradient of the
full GRPO loss on the same batch (all response tokens, token mean), for K in {5, 10, 20, 50}%
and four ways of choosing the same number of tokens:

  d3s       top-K by |A| x H over the batch (the trainer's ``token_scope=batch`` selector)
  adv       top by |A| alone (ties broken at random: |A| is constant within a rollout)
  entropy   top by H among tokens with A != 0
  random    uniformly among tokens with A != 0 (``--random-draws``, averaged)

Then whole selections as the trainer makes them (samples, then tokens; PODS re-normalises its
advantages), at the start, middle and end of their schedules: ``d3s`` (N G/8 -> G/2 per
prompt, K 5% -> 20%, no floor on kept tokens: the papers' rule), ``d3s_paper`` (N G/4 -> G),
``d2s`` (N G/4, K 20%), ``pods`` (N G/4, all tokens), ``d1s_cross`` (pooled N G/4, all
tokens), each against the same full gradient.

The gradient is the on-policy one (ratio 1): d/dtheta of -sum A_i log pi(token), so clipping
plays no part. A cosine near 1 means the subset points where the whole batch points; it
says how much direction the update keeps, not how good that direction is for the task.

    python benchmarks/bench_token_signal.py [--batches 2] [--quick]
    python benchmarks/bench_token_signal.py --seed 1 --append   # more batches, one summary

Writes results/bench_token_signal.json and .png (``--quick``: results/quick/, 1 batch of 4
prompts). One process; set OMP_NUM_THREADS to the cores it may use.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as C  # noqa: E402

NAME = "bench_token_signal"
RULES = ("d3s", "adv", "entropy", "random")
K_FRACS = (0.05, 0.1, 0.2, 0.5)


def _compose(overrides):
    from nemo_d3s.train import compose_config

    return compose_config(overrides)


def _top_n(scores, eligible, n, generator=None):
    """bool mask of the n eligible positions with the largest score (random ties when a
    generator is given: a tiny random jitter below the scores' resolution)."""
    import torch

    s = scores.double().clone()
    if generator is not None:
        s = s + 1e-9 * torch.rand(s.shape, generator=generator, dtype=torch.float64)
    s[~eligible] = -math.inf
    keep = torch.zeros_like(eligible)
    idx = torch.topk(s.flatten(), int(n)).indices
    keep.view(-1)[idx] = True
    return keep & eligible


def _gradient(policy, batch, advantages, keep):
    """Flat gradient of -sum_{kept} A_i log pi(token) / n_kept over the rows that hold a kept
    token (the others contribute nothing). [P] f32 on the CPU; the policy's grads are cleared."""
    import torch

    rows = (
        (keep & (advantages != 0)[:, None]).any(1).nonzero().flatten()
    )  # zero-weight rows add nothing
    sub, a, k = batch.select(rows), advantages[rows].float(), keep[rows].float()

    def loss_fn(lp, r):
        return -(a[r][:, None] * k[r] * lp).sum()

    policy.accumulate_gradients(sub, loss_fn, micro_batch_size=8, denominator=float(k.sum()))
    flat = torch.cat([p.grad.detach().flatten().float() for p in policy.params])
    for p in policy.params:
        p.grad = None
    return flat


def _cosine(a, b) -> float:
    # float64 sums: over ~1e8 entries float32 accumulation drifts by percents
    a, b = a.double(), b.double()
    return float(a @ b / (a.norm() * b.norm()))


# d3s and d3s_paper without the preset's floor of 256 kept tokens (the papers' K alone): what
# the recorded results measure, and the case where the token count is smallest.
PIPELINES = {
    "d3s": ["d3s=d3s", "d3s.min_kept_tokens=0"],
    "d3s_paper": [
        "d3s=d3s",
        "d3s.schedule.n_init=0.25",
        "d3s.schedule.n_final=1.0",
        "d3s.min_kept_tokens=0",
    ],
    "d2s": ["d3s=d2s"],
    "pods": ["d3s=pods"],
    "d1s_cross": ["d3s=d1s_cross"],
}
PROGRESS = (0.0, 0.5, 1.0)


def run(args) -> dict:
    import torch

    from nemo_d3s.core.token_selection import TOKEN_SELECTORS
    from nemo_d3s.trainer.data import generate_groups
    from nemo_d3s.trainer.loop import Trainer

    overrides = [
        "task=basic_arithmetic_2d",
        "d3s=grpo",
        "task.eval_size=1",
        "output_dir=/tmp/unused-bench",
        f"trainer.prompts_per_step={args.prompts}",
        f"seed={args.seed}",
    ]
    trainer = Trainer(_compose(overrides))
    from nemo_d3s.core.d3s import D3SSelector
    from nemo_d3s.trainer.build import d3s_config

    pipelines = {
        name: D3SSelector(d3s_config(_compose([*overrides, *extra])))
        for name, extra in PIPELINES.items()
    }
    ctx, policy = trainer.ctx, trainer.policy
    gen = torch.Generator().manual_seed(args.seed)
    out = {
        "batches": [],
        "k_fracs": list(K_FRACS),
        "rules": list(RULES),
        "overrides": overrides,
        "pipelines": {k: v for k, v in PIPELINES.items()},
        "progress": list(PROGRESS),
    }
    for b in range(args.batches):
        t0 = time.perf_counter()
        prompts = ctx.prompts.for_step(b)
        ro = generate_groups(ctx.engine, prompts, ctx.num_generations, ctx.gen)
        rewards, _ = ctx.task.score(prompts.problems, ro.response_texts, ctx.num_generations)
        group_ids = prompts.global_index.repeat_interleave(ctx.num_generations)
        stage = ctx.selector.select_samples(rewards, group_ids, 0.0)  # d3s=grpo: every rollout kept
        assert stage.kept_rows.tolist() == list(
            range(len(rewards))
        )  # d3s=grpo keeps every rollout, in order
        batch, adv = ro.batch, stage.kept_advantages.float()
        resp = batch.response_mask.bool()
        entropy = policy.score(batch, with_entropy=True, micro_batch_size=16).entropy
        informative = resp & (adv != 0)[:, None]
        row = {
            "reward_mean": float(rewards.mean()),
            "response_tokens": int(resp.sum()),
            "informative_tokens": int(informative.sum()),
            "cos": {r: {} for r in RULES},
            "n_kept": {},
            "pipeline_cos": {},
            "pipeline_tokens": {},
        }
        if int(informative.sum()) == 0:
            print(f"batch {b}: every group has equal rewards; skipped")
            continue
        g_full = _gradient(policy, batch, adv, resp)
        for k in K_FRACS:
            keep_d3s = TOKEN_SELECTORS.get("batch")(adv.abs()[:, None] * entropy, resp, k)
            n = int(keep_d3s.sum())
            row["n_kept"][str(k)] = n
            picks = {
                "d3s": [keep_d3s],
                "adv": [_top_n(adv.abs()[:, None].expand_as(entropy), resp, n, gen)],
                "entropy": [_top_n(entropy, informative, min(n, int(informative.sum())))],
                "random": [
                    _top_n(
                        torch.rand(resp.shape, generator=gen),
                        informative,
                        min(n, int(informative.sum())),
                    )
                    for _ in range(args.random_draws)
                ],
            }
            for rule, keeps in picks.items():
                cos = [_cosine(_gradient(policy, batch, adv, kp), g_full) for kp in keeps]
                row["cos"][rule][str(k)] = sum(cos) / len(cos)
        for name, sel in pipelines.items():
            row["pipeline_cos"][name], row["pipeline_tokens"][name] = {}, {}
            for prog in PROGRESS:
                st = sel.select_samples(rewards, group_ids, prog)
                rows = st.kept_rows
                tok = sel.select_tokens(st, entropy[rows], resp[rows], prog)
                keep = torch.zeros_like(resp)
                keep[rows] = tok.token_keep.bool()
                a = torch.zeros_like(adv)
                a[rows] = st.kept_advantages.float()
                row["pipeline_tokens"][name][str(prog)] = int(keep.sum())
                row["pipeline_cos"][name][str(prog)] = (
                    _cosine(_gradient(policy, batch, a, keep), g_full) if keep.any() else 0.0
                )
        row["seconds"] = time.perf_counter() - t0
        row["seed"] = args.seed
        out["batches"].append(row)
        print(
            f"batch {b}: reward {row['reward_mean']:.2f}, {row['response_tokens']} response tokens "
            f"({row['informative_tokens']} with A != 0), {row['seconds']:.0f} s"
        )
        C.print_table(
            ["K", "kept"] + list(RULES),
            [
                [f"{k:.0%}", row["n_kept"][str(k)]]
                + [f"{row['cos'][r][str(k)]:.3f}" for r in RULES]
                for k in K_FRACS
            ],
        )
        C.print_table(
            ["selection"] + [f"progress {p}: cos (tokens)" for p in PROGRESS],
            [
                [n]
                + [
                    f"{row['pipeline_cos'][n][str(p)]:.3f} ({row['pipeline_tokens'][n][str(p)]})"
                    for p in PROGRESS
                ]
                for n in PIPELINES
            ],
        )
    return out


def summarize(out: dict) -> dict:
    """Mean and min/max over batches of the cosine per (rule, K)."""
    summary = {}
    for r in RULES:
        summary[r] = {}
        for k in K_FRACS:
            xs = [b["cos"][r][str(k)] for b in out["batches"] if str(k) in b["cos"][r]]
            if xs:
                summary[r][str(k)] = {
                    "mean": sum(xs) / len(xs),
                    "min": min(xs),
                    "max": max(xs),
                    "n": len(xs),
                }
    for name in PIPELINES:
        summary[f"pipeline:{name}"] = {}
        for prog in PROGRESS:
            xs = [b["pipeline_cos"][name][str(prog)] for b in out["batches"]]
            ts = [b["pipeline_tokens"][name][str(prog)] for b in out["batches"]]
            if xs:
                summary[f"pipeline:{name}"][str(prog)] = {
                    "mean": sum(xs) / len(xs),
                    "min": min(xs),
                    "max": max(xs),
                    "tokens_mean": sum(ts) / len(ts),
                    "n": len(xs),
                }
    return summary


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in RULES:
        ks = [k for k in K_FRACS if str(k) in out["summary"][r]]
        ms = [out["summary"][r][str(k)]["mean"] for k in ks]
        lo = [out["summary"][r][str(k)]["min"] for k in ks]
        hi = [out["summary"][r][str(k)]["max"] for k in ks]
        line = ax.plot([100 * k for k in ks], ms, marker="o", label=r)[0]
        ax.fill_between([100 * k for k in ks], lo, hi, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("kept tokens K (% of the batch's response tokens)")
    ax.set_ylabel("cos(gradient of kept tokens, full-batch gradient)")
    ax.set_title(
        f"SmolLM2-135M, basic_arithmetic_2d, {len(out['batches'])} batches (band: min-max)"
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch (x 8 rollouts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-draws", type=int, default=2)
    p.add_argument(
        "--append",
        action="store_true",
        help="add this run's batches to the existing results JSON (use another --seed)",
    )
    p.add_argument("--quick", action="store_true", help="1 batch of 4 prompts, results/quick/")
    args = p.parse_args()
    if args.quick:
        args.batches, args.prompts = 1, 4
    previous = []
    path = os.path.join(C.results_dir(args.quick), f"{NAME}.json")
    if args.append and os.path.isfile(path):
        import json

        with open(path) as f:
            old = json.load(f)
        if any(b.get("seed") == args.seed for b in old.get("batches", [])):
            raise SystemExit(
                f"{path} already holds batches of seed {args.seed}; pass another --seed"
            )
        previous = old.get("batches", [])
    out = run(args)
    out["batches"] = previous + out["batches"]
    out["summary"] = summarize(out)
    out["machine"] = C.machine_info()
    C.write_json(NAME, out, quick=args.quick)
    plot(out, C.png_path(NAME, quick=args.quick))
    print(f"wrote {C.png_path(NAME, quick=args.quick)}")


if __name__ == "__main__":
    main()
