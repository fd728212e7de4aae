"""Micro-batch layouts on a long-tailed length mix: fixed rows (``trainer.micro_batch_size``),
token budgets (``trainer.micro_batch_tokens``) and packed rows (``trainer.pack_sequences``):
padded tokens and time per step; and the memory of context parallelism 2 against 1.

Batch: B rows, a P-token prompt then a response; most responses short (uniform in
[short_min, short_max] tokens), ``n_long`` of them at the length limit S, in a shuffled
rollout order (seed 0), so fixed consecutive micro-batches mix long and short rows as a
real rollout batch does. Loss: GRPO token_mean over every response token, old log-probs =
the first score + small noise (``trainer.update.make_loss_fn``).

Model: the HF backend's random Llama (``model="tiny-random"``, ``--hidden``/``--layers``,
float32, CPU). Compared (same weights, same batch): ``fixed`` = M rows; ``budget`` = a
token budget T = M x S (the fixed plan's worst-case micro-batch, so the peak activation
memory is no larger); ``packed`` = rows end to end in packs of T tokens (on the CPU the
attention masks a dense [T, T] block diagonal: the HF backend packs by default only with
flash attention). Per method, ``--reps`` interleaved repetitions of
``policy.score(with_entropy=True)`` and ``policy.train_step`` (lr 0: every repetition
sees the same weights), the order rotating; reported: fed tokens, the padding share
1 - real / fed, micro-batches, median wall seconds, the gradient norm (equal across
methods: the global denominator makes the loss partition-invariant).

The Megatron backend's plans (``backends.megatron.batches``, no run) are reported for the
same batch at PP 1 and PP 2 (1F1B: fixed rows all take the batch's longest row), widths a
multiple of ``model.params.width_quantum`` (128, and 0 = exact), and for the long-response
recipe's scale (``experiment=llama3_70b_long``: 128 rows per DP rank of up to 16384 tokens,
budget 32768; response lengths drawn long-tailed, ``--long-seed``).

Context parallelism (``--cp-len`` tokens per row, 2 rows, a Megatron ``tiny-random`` model
on gloo ranks): the peak of torch's CPU allocations during one ``train_step`` per rank at
CP 1 and CP 2, rows and packed (``benchlib.TorchAllocPeak``): the local attention's
[heads, L / CP, L] scores dominate at this length.

    python benchmarks/bench_microbatch.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as C  # noqa: E402

NAME = "bench_microbatch"
METHODS = ("fixed", "budget", "packed")
OPS = ("score", "train_step")


def make_batch(cfg):
    """(TokenBatch [B, S], advantages [B], noise [B, S]): the long-tailed mix."""
    import torch

    from nemo_d3s.backends.base import TokenBatch

    B, S, P = cfg["B"], cfg["S"], cfg["prompt"]
    g = torch.Generator().manual_seed(0)
    resp_len = torch.randint(cfg["short_min"], cfg["short_max"] + 1, (B,), generator=g)
    resp_len[: cfg["n_long"]] = S - P
    lengths = (P + resp_len)[torch.randperm(B, generator=g)]
    pos = torch.arange(S)
    attn = pos < lengths.unsqueeze(1)
    resp = attn & (pos >= P)
    ids = torch.randint(0, 256, (B, S), generator=g) * attn
    return (
        TokenBatch(ids, attn, resp),
        torch.randn(B, generator=g),
        0.01 * torch.randn(B, S, generator=g),
    )


def megatron_plans(mask, M, T, quantum=128):
    """Fed tokens and padding share of the Megatron backend's plans (no run) at PP 1 and 2."""
    from nemo_d3s.backends.megatron.batches import plan_micro_batches, plan_packed

    real = float(mask.sum())
    out = {}
    for pp in (1, 2):
        for name, tokens in (("fixed", 0), ("budget", T)):
            plan = plan_micro_batches(mask, M, uniform=pp > 1, max_tokens=tokens, quantum=quantum)
            out[f"pp{pp}_{name}"] = plan
        out[f"pp{pp}_packed"] = plan_packed(mask, M, T, quantum=quantum)  # one width per call
    return {
        k: {
            "fed_tokens": sum(m.b * m.width for m in plan),
            "micro_batches": len(plan),
            "padding_share": 1 - real / sum(m.b * m.width for m in plan),
        }
        for k, plan in out.items()
    }


def long_recipe_mask(seed: int, rows=128, S=16384, prompt=1024, long_share=0.1):
    """[rows, S] mask of the long-response recipe's scale: responses uniform in [512,
    6144] tokens, ``long_share`` of them at the limit."""
    import torch

    g = torch.Generator().manual_seed(seed)
    resp = torch.randint(512, 6145, (rows,), generator=g)
    resp[: int(rows * long_share)] = S - prompt
    lengths = (prompt + resp)[torch.randperm(rows, generator=g)]
    return torch.arange(S) < lengths.unsqueeze(1)


def run(cfg):
    import torch

    from nemo_d3s.backends.hf.backend import HFBackend
    from nemo_d3s.backends.hf.config import HFBackendConfig, TinyModelSpec
    from nemo_d3s.core.losses import LossConfig, loss_denominator
    from nemo_d3s.trainer.update import UpdateBatch, make_loss_fn

    torch.manual_seed(0)
    spec = TinyModelSpec(
        hidden_size=cfg["hidden"],
        num_layers=cfg["layers"],
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=2 * cfg["hidden"],
        max_position_embeddings=cfg["S"],
    )
    settings = dict(
        model="tiny-random",
        tiny=spec,
        device="cpu",
        dtype="float32",
        autocast=None,
        lr=0.0,
        grad_clip=None,
    )
    plain = HFBackend(HFBackendConfig(**settings, pack_sequences=False))
    packed = HFBackend(HFBackendConfig(**settings, pack_sequences=True))  # the same weights
    pols = {"fixed": plain, "budget": plain, "packed": packed}
    pol = plain
    batch, adv, noise = make_batch(cfg)
    M, T = cfg["M"], cfg["M"] * cfg["S"]
    tokens = {"fixed": 0, "budget": T, "packed": T}
    first = pol.score(batch, with_entropy=True, micro_batch_size=M)
    upd = UpdateBatch(
        batch=batch,
        old_logprobs=first.logprobs + noise * batch.attention_mask,
        advantages=adv,
        token_keep=batch.response_mask.clone(),
        minibatch=torch.zeros(len(batch), dtype=torch.long),
    )
    loss_fn = make_loss_fn("grpo", LossConfig(aggregation="token_mean", check_inputs=False), upd)
    denom = float(loss_denominator(batch.response_mask, "token_mean"))
    calls = {
        (m, "score"): (
            lambda m=m: (
                pols[m]
                .score(batch, with_entropy=True, micro_batch_size=M, micro_batch_tokens=tokens[m])
                .stats
            )
        )
        for m in METHODS
    }
    calls.update(
        {
            (m, "train_step"): (
                lambda m=m: pols[m].train_step(
                    batch, loss_fn, M, denominator=denom, micro_batch_tokens=tokens[m]
                )
            )
            for m in METHODS
        }
    )
    keys = list(calls)
    wall = {k: [] for k in keys}
    last = {}
    for rep in range(cfg["reps"]):
        for k in C.rotate(keys, rep):
            t0 = time.perf_counter()
            last[k] = calls[k]()
            wall[k].append(time.perf_counter() - t0)
    real = float(batch.attention_mask.sum())
    methods = {}
    for m in METHODS:
        st, tr = last[m, "score"], last[m, "train_step"]
        methods[m] = {
            "micro_batch_tokens": tokens[m],
            "fed_tokens": st["fed_tokens"],
            "padding_share": 1 - real / st["fed_tokens"],
            "train_fed_tokens": tr["fed_tokens"],
            "micro_batches": tr["n_micro_batches"],
            "grad_norm": tr["grad_norm"],
            "score_s_median": C.median(wall[m, "score"]),
            "train_step_s_median": C.median(wall[m, "train_step"]),
            "score_s_all": wall[m, "score"],
            "train_step_s_all": wall[m, "train_step"],
        }
    long_mask = long_recipe_mask(cfg["long_seed"])
    return {
        "real_tokens": real,
        "lengths": batch.attention_mask.sum(1).tolist(),
        "methods": methods,
        "megatron_plans": megatron_plans(batch.attention_mask, M, T),
        "megatron_plans_exact_widths": megatron_plans(batch.attention_mask, M, T, quantum=0),
        "long_recipe_plans": {
            "rows": int(long_mask.shape[0]),
            "real_tokens": float(long_mask.sum()),
            **megatron_plans(long_mask, 1, 32768),
        },
    }


def _cp_rank(rank, folder, cp, L, pack):
    """One train_step of two rows of L tokens at CP ``cp``: this rank's torch-allocation peak."""
    import torch

    from nemo_d3s.backends.base import TokenBatch
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    pol = MegatronBackend(
        MegatronBackendConfig(
            model=folder, device="cpu", lr=0.0, context_parallel_size=cp, pack_sequences=pack
        )
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, L), generator=g)
    mask = torch.ones(2, L, dtype=torch.bool)
    resp = mask & (torch.arange(L) >= 16)
    batch = TokenBatch(ids, mask, resp)

    def loss_fn(lp, rows):
        return -(lp * resp[rows, : lp.shape[1]]).sum()

    pol.train_step(batch, loss_fn, 2, denominator=float(resp.sum()))  # first-call costs
    with C.TorchAllocPeak() as peak:
        m = pol.train_step(batch, loss_fn, 2, denominator=float(resp.sum()))
    return {"alloc_peak_bytes": peak.peak, "grad_norm": m["grad_norm"]}


def cp_memory(cfg):
    """{"cp1" / "cp2" (+ "_packed"): per-rank torch-allocation peaks of one train_step}."""
    from nemo_d3s.backends.hf.config import TinyModelSpec
    from nemo_d3s.backends.hf.loading import ensure_tiny_folder

    L = cfg["cp_len"]
    folder = str(ensure_tiny_folder(TinyModelSpec(max_position_embeddings=L), seed=0))
    out = {}
    for pack in (False, True):
        for cp in (1, 2):
            ranks = C.run_ranks(_cp_rank, cp, folder, cp, L, pack, timeout=1800)
            out[f"cp{cp}{'_packed' if pack else ''}"] = {
                "alloc_peak_bytes_per_rank": [r["alloc_peak_bytes"] for r in ranks],
                "grad_norm": ranks[0]["grad_norm"],
            }
    return out


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = res["methods"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].hist(res["lengths"], bins=30, color="grey")
    axes[0].set(title="row lengths (tokens)", xlabel="tokens", ylabel="rows")
    x = range(len(METHODS))
    axes[1].bar(x, [ms[m]["fed_tokens"] for m in METHODS], color=["C0", "C1", "C2"])
    axes[1].axhline(res["real_tokens"], color="k", ls="--", lw=1, label="real tokens")
    axes[1].set(title="tokens fed per pass", xticks=list(x), xticklabels=METHODS)
    axes[1].legend()
    w = 0.38
    for i, op in enumerate(OPS):
        axes[2].bar(
            [j + (i - 0.5) * w for j in x], [ms[m][f"{op}_s_median"] for m in METHODS], w, label=op
        )
    axes[2].set(title="median seconds per call", xticks=list(x), xticklabels=METHODS)
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.quick:
        cfg = dict(
            B=16,
            S=256,
            prompt=16,
            short_min=8,
            short_max=48,
            n_long=2,
            M=4,
            hidden=64,
            layers=2,
            reps=2,
            long_seed=0,
            cp_len=512,
        )
    else:
        cfg = dict(
            B=32,
            S=1024,
            prompt=32,
            short_min=32,
            short_max=192,
            n_long=3,
            M=4,
            hidden=128,
            layers=4,
            reps=args.reps,
            long_seed=0,
            cp_len=4096,
        )
    t0 = time.perf_counter()
    res = run(cfg)
    res["context_parallel"] = cp_memory(cfg)
    res.update(config=cfg, machine=C.machine_info(), wall_s=time.perf_counter() - t0)
    ms = res["methods"]
    C.print_table(
        [
            "method",
            "fed tokens",
            "padding",
            "micro-batches",
            "score s",
            "train_step s",
            "grad norm",
        ],
        [
            [
                m,
                int(ms[m]["fed_tokens"]),
                f"{ms[m]['padding_share']:.1%}",
                int(ms[m]["micro_batches"]),
                f"{ms[m]['score_s_median']:.3f}",
                f"{ms[m]['train_step_s_median']:.3f}",
                f"{ms[m]['grad_norm']:.6g}",
            ]
            for m in METHODS
        ],
    )
    for key in ("megatron_plans", "long_recipe_plans"):
        print(
            f"{key} (padding share): "
            + ", ".join(
                f"{k} {v['padding_share']:.1%}" for k, v in res[key].items() if isinstance(v, dict)
            )
        )
    print(
        "context parallelism, torch allocation peak of a train_step per rank: "
        + ", ".join(
            f"{k} {C.fmt_bytes(max(v['alloc_peak_bytes_per_rank']))}"
            for k, v in res["context_parallel"].items()
        )
    )
    print(
        f"real tokens {int(res['real_tokens'])}; Megatron plans (fed tokens): "
        + ", ".join(f"{k} {v['fed_tokens']}" for k, v in res["megatron_plans"].items())
    )
    print("wrote", C.write_json(NAME, res, quick=args.quick))
    plot(res, C.png_path(NAME, quick=args.quick))


if __name__ == "__main__":
    main()
