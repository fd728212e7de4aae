"""What D3S selection and DP rebalancing cost inside one GRPO training step.

A small causal LM made of megatron-core tensor-parallel layers (VocabParallelEmbedding ->
n x [ColumnParallelLinear -> gelu -> RowParallelLinear, residual] -> output
ColumnParallelLinear, vocab-sharded logits; no attention) runs full D3S steps on gloo ranks
(CPU) for TP2 x DP1 (2 ranks) and TP2 x DP2 (4 ranks). One step, phase by phase (a barrier
before each phase, so a phase's time is the time of its slowest rank):

  advantages         core.compute_advantages (GRPO) on this rank's whole groups
  sample_selection   distributed.global_select_samples (D3S cross-group, N per prompt) over DP
  rebalance          distributed.plan_rebalance (by sequence length) + apply_rebalance (one
                     all_to_all of ids, masks, advantages) over DP
  old_logprob_pass   forward (no grad) over micro-batches + vocab-parallel entropy/log-probs
  token_selection    core.token_scores |A| x H + select_tokens_global (exact global top-K%)
                     + step_normalizer (global loss denominator)
  train_fwd_bwd      forward + distributed policy loss (vocab-parallel log-probs, GRPO) +
                     backward, per micro-batch
  grad_allreduce     all-reduce of the gradients over DP (what DDP does; 0 work at DP1)
  optimizer          torch AdamW step + zero_grad

selection = advantages + sample_selection + token_selection; rebalancing = rebalance.
The rollout generation and reward are not part of the step measured here.

    python benchmarks/bench_selection_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as C  # noqa: E402

NAME = "bench_selection_overhead"
PHASES = (
    "advantages",
    "sample_selection",
    "rebalance",
    "old_logprob_pass",
    "token_selection",
    "train_fwd_bwd",
    "grad_allreduce",
    "optimizer",
)
SELECTION = ("advantages", "sample_selection", "token_selection")
REBALANCE = ("rebalance",)


def _rank(rank, cfg):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as Fn
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as mtp
    from megatron.core.model_parallel_config import ModelParallelConfig

    from nemo_d3s.core.advantages import compute_advantages
    from nemo_d3s.core.losses import policy_loss
    from nemo_d3s.core.token_selection import token_scores
    from nemo_d3s.distributed import (
        PerTokenStore,
        apply_rebalance,
        global_select_samples,
        logprob_loss_func,
        plan_rebalance,
        select_tokens_global,
        step_normalizer,
        train_loss_func,
    )

    tp_size = ps.get_tensor_model_parallel_world_size()
    tp, dp = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    H, F, V, S = cfg["hidden"], cfg["ffn"], cfg["vocab"], cfg["seq"]
    P, G, N_KEEP, MB = cfg["prompts_per_rank"], cfg["group_size"], cfg["n_keep"], cfg["micro_batch"]

    mcfg = ModelParallelConfig(
        tensor_model_parallel_size=tp_size, use_cpu_initialization=True, perform_initialization=True
    )

    def init(w):
        return torch.nn.init.normal_(w, std=0.02)

    torch.manual_seed(1234)  # the same master weights on every rank; each keeps its shard

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = mtp.VocabParallelEmbedding(V, H, init_method=init, config=mcfg)
            self.fc1 = torch.nn.ModuleList(
                mtp.ColumnParallelLinear(
                    H, F, config=mcfg, init_method=init, bias=True, gather_output=False
                )
                for _ in range(cfg["layers"])
            )
            self.fc2 = torch.nn.ModuleList(
                mtp.RowParallelLinear(
                    F,
                    H,
                    config=mcfg,
                    init_method=init,
                    bias=True,
                    input_is_parallel=True,
                    skip_bias_add=False,
                )
                for _ in range(cfg["layers"])
            )
            self.head = mtp.ColumnParallelLinear(
                H, V, config=mcfg, init_method=init, bias=False, gather_output=False
            )

        def forward(self, ids):
            h = self.embed(ids)
            for fc1, fc2 in zip(self.fc1, self.fc2):
                a, _ = fc1(h)
                o, _ = fc2(Fn.gelu(a))
                h = h + o
            logits, _ = self.head(h)
            return logits  # [B, S, V / TP]

    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    n_params_local = sum(p.numel() for p in model.parameters())

    def rollouts(step):
        """This DP rank's rollouts: P prompts x G samples, right-padded to S."""
        g = torch.Generator().manual_seed(100_000 * step + dp_rank)
        B = P * G
        ids = torch.randint(0, V, (B, S), generator=g)
        prompt = cfg["prompt_len"]
        resp = torch.randint(S // 8, S - prompt + 1, (B,), generator=g)
        pos = torch.arange(S)
        response_mask = (pos >= prompt) & (pos < (prompt + resp).unsqueeze(1))
        lengths = prompt + resp
        rewards = (torch.rand(B, generator=g) < 0.5).float()
        rewards[:G] = 1.0  # one solved prompt per rank: a degenerate group, as in practice
        group_ids = torch.arange(P).repeat_interleave(G)
        return ids, response_mask, lengths, rewards, group_ids

    def micro_batches(n):
        return [torch.arange(i, min(i + MB, n)) for i in range(0, n, MB)]

    records = []
    for step in range(cfg["warmup"] + cfg["steps"]):
        ids, response_mask, lengths, rewards, group_ids = rollouts(step)
        t = {}
        info = {}

        counts = {}

        @contextmanager
        def phase(name):
            C.barrier()
            with C.CollectiveCounter() as cc, C.timed(t, name):
                yield
            counts[name] = cc.summary()["n_calls"]

        with phase("advantages"):
            adv = compute_advantages(rewards, group_ids, "grpo")
        with phase("sample_selection"):
            sel = global_select_samples("d3s_cross", rewards, adv.advantages, group_ids, N_KEEP, dp)
        with phase("rebalance"):
            plan = plan_rebalance(lengths, sel.sample_keep, dp)
            batch = apply_rebalance(
                plan,
                {
                    "ids": ids,
                    "response_mask": response_mask,
                    "advantages": sel.advantages,
                    "lengths": lengths,
                },
                dp,
                zero_on_pad=("response_mask",),
            )
        ids_k, mask_k, adv_k = (
            batch.tensors["ids"],
            batch.tensors["response_mask"],
            batch.tensors["advantages"],
        )
        info["rows_kept_before_rebalance"] = int(sel.sample_keep.sum())
        info["rows_after_rebalance"] = int(ids_k.shape[0])
        info["imbalance_before"], info["imbalance_after"] = (
            plan.imbalance_before,
            plan.imbalance_after,
        )
        mbs = micro_batches(ids_k.shape[0])

        with phase("old_logprob_pass"):
            store = PerTokenStore()
            with torch.no_grad():
                for r in mbs:
                    logprob_loss_func(store, ids_k[r], tp, token_aligned=True)(model(ids_k[r]))
            entropy = torch.cat([m["entropy"] for m in store.micro_batches])
            old_lp = torch.cat([m["logprobs"] for m in store.micro_batches])

        with phase("token_selection"):
            scores = token_scores(adv_k, entropy, mask_k)
            tsel = select_tokens_global(scores, mask_k, cfg["k_frac"], dp, scope="global_exact")
            keep = tsel.token_keep
            norm = step_normalizer(
                [keep[r] for r in mbs],
                "token_mean",
                dp,
                num_microbatches=len(mbs),
                megatron_schedule=False,
            )
        info["tokens_eligible_global"] = tsel.n_eligible_global
        info["tokens_kept_global"] = tsel.n_kept_global

        with phase("train_fwd_bwd"):
            for r in mbs:

                def loss_sum(lp, rows):
                    return policy_loss(
                        "grpo", lp, old_lp[rows], adv_k[rows], keep[rows], denominator=1.0
                    )

                loss_fn = train_loss_func(
                    ids_k[r], torch.ones_like(ids_k[r], dtype=torch.bool), r, loss_sum, norm, tp
                )
                loss, _ = loss_fn(model(ids_k[r]))
                loss.backward()

        with phase("grad_allreduce"):
            if dp_size > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=dp)
                    p.grad.div_(dp_size)

        with phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

        C.barrier()
        maxed = C.max_over_ranks_vec([t[p] for p in PHASES])
        if step >= cfg["warmup"]:
            records.append(
                {
                    "step": step,
                    "phase_s": dict(zip(PHASES, maxed)),
                    "collectives_rank0": counts,
                    **info,
                }
            )

    # Latency of one tiny collective on the DP group: the floor of every selection phase.
    lat = []
    x = torch.zeros(1)
    for _ in range(30):
        C.barrier()
        t0 = time.perf_counter()
        if dp_size > 1:
            dist.all_reduce(x, group=dp)
        lat.append(C.max_over_ranks(time.perf_counter() - t0))
    if rank != 0:
        return None
    return {
        "steps": records,
        "n_params_per_rank": n_params_local,
        "tp": tp_size,
        "dp": dp_size,
        "dp_allreduce_8B_latency_ms_median": 1e3 * C.median(lat),
    }


# ---------------------------------------------------------------------------- main


def summarize(res):
    steps = res["steps"]
    totals = [sum(s["phase_s"].values()) for s in steps]
    out = {"step_s_median": C.median(totals), "phases": {}}
    for p in PHASES:
        xs = [s["phase_s"][p] for s in steps]
        shares = [s["phase_s"][p] / tot for s, tot in zip(steps, totals)]
        out["phases"][p] = {
            "ms_median": 1e3 * C.median(xs),
            "share_median": C.median(shares),
            "ms_all": [1e3 * x for x in xs],
        }
    for name, group in (("selection", SELECTION), ("rebalancing", REBALANCE)):
        xs = [sum(s["phase_s"][p] for p in group) for s in steps]
        out[name] = {
            "ms_median": 1e3 * C.median(xs),
            "share_median": C.median([x / tot for x, tot in zip(xs, totals)]),
        }
    return out


def plot(layouts, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "advantages": "#e41a1c",
        "sample_selection": "#ff7f00",
        "rebalance": "#984ea3",
        "token_selection": "#f781bf",
        "old_logprob_pass": "#a6cee3",
        "train_fwd_bwd": "#1f78b4",
        "grad_allreduce": "#b2df8a",
        "optimizer": "#33a02c",
    }
    order = (
        "advantages",
        "sample_selection",
        "token_selection",
        "rebalance",
        "old_logprob_pass",
        "train_fwd_bwd",
        "grad_allreduce",
        "optimizer",
    )
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1.2, 1]})
    names = list(layouts)
    for i, lay in enumerate(names):
        s = layouts[lay]["summary"]
        left = 0.0
        for p in order:
            w = s["phases"][p]["ms_median"]
            a1.barh(
                i,
                w,
                left=left,
                color=colors[p],
                edgecolor="black",
                linewidth=0.3,
                label=p if i == 0 else None,
            )
            left += w
        sel = s["selection"]["share_median"] + s["rebalancing"]["share_median"]
        a1.text(
            left * 1.01,
            i,
            f"step {s['step_s_median'] * 1e3:.0f} ms\nsel.+rebal. {sel:.2%}",
            va="center",
            fontsize=8,
        )
    a1.set_yticks(range(len(names)))
    a1.set_yticklabels(names)
    a1.set_xlabel("ms per step (median per phase, slowest rank)")
    a1.set_title("one GRPO/D3S step, phase by phase")
    a1.set_xlim(0, max(layouts[n]["summary"]["step_s_median"] for n in names) * 1e3 * 1.35)
    a1.legend(fontsize=7, loc="lower right")
    # Right: the small phases in ms on a log scale (they are invisible on the left).
    small = ("advantages", "sample_selection", "token_selection", "rebalance")
    width = 0.8 / len(names)
    for i, lay in enumerate(names):
        s = layouts[lay]["summary"]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(small))]
        ys = [s["phases"][p]["ms_median"] for p in small]
        a2.bar(xs, ys, width, label=lay, edgecolor="black", linewidth=0.3)
        ncoll = layouts[lay]["steps"][-1]["collectives_rank0"]
        for xx, yy, p in zip(xs, ys, small):
            a2.text(xx, yy * 1.05, f"{ncoll.get(p, 0)} coll.", ha="center", va="bottom", fontsize=7)
    a2.set_xticks(range(len(small)))
    a2.set_xticklabels(small, fontsize=8)
    a2.set_yscale("log")
    a2.set_ylabel("ms (median, log)")
    a2.set_title("selection and rebalancing phases (collectives per call on top)")
    a2.grid(axis="y", alpha=0.3, which="both")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smaller model, 2 steps per layout (smoke test, < 60 s)",
    )
    ap.add_argument(
        "--layouts", nargs="+", default=None, help="TPxDP layouts, e.g. 2x1 2x2 (default both)"
    )
    ap.add_argument("--steps", type=int, default=None, help="measured steps per layout (default 5)")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    args = ap.parse_args(argv)
    quick = args.quick
    cfg = {
        "hidden": args.hidden or (128 if quick else 256),
        "ffn": 4 * (args.hidden or (128 if quick else 256)),
        "layers": 2,
        "vocab": args.vocab or (8192 if quick else 32768),
        "seq": args.seq or (128 if quick else 256),
        "prompt_len": 32,
        "prompts_per_rank": 2 if quick else 4,
        "group_size": 8,
        "n_keep": 4,  # D3S cross-group: keep N x n_groups of the pooled DP batch
        "k_frac": 0.2,
        "micro_batch": 4,
        "warmup": 1,
        "steps": args.steps or (2 if quick else 5),
        "quick": quick,
    }
    layouts = args.layouts or ["2x1", "2x2"]
    C.set_preload(
        [
            "torch",
            "torch.distributed",
            "megatron.core.parallel_state",
            "megatron.core.tensor_parallel",
            "nemo_d3s.core",
            "nemo_d3s.distributed",
        ]
    )
    t0 = time.time()
    out = {}
    notes = {}
    for lay in layouts:
        tp, dp = (int(x) for x in lay.lower().split("x"))
        world = tp * dp
        key = f"TP{tp}xDP{dp}"
        note = C.oversubscription_note(world)
        if note:
            notes[key] = note
            print(f"NOTE {key}: {note}", flush=True)
        t1 = time.time()
        res = C.run_ranks(
            _rank,
            world,
            cfg,
            threads=C.threads_per_rank(world),
            megatron_sizes=(tp, 1, 1),
            timeout=1200,
        )[0]
        res["summary"] = summarize(res)
        res["threads_per_rank"] = C.threads_per_rank(world)
        out[key] = res
        print(f"{key} done in {time.time() - t1:.0f} s", flush=True)

    rows = []
    for key, res in out.items():
        s = res["summary"]
        ncoll = res["steps"][-1]["collectives_rank0"]
        for p in PHASES:
            nc = ncoll.get(p, 0) if p in SELECTION + REBALANCE else ""
            rows.append(
                [
                    key,
                    p,
                    f"{s['phases'][p]['ms_median']:.1f}",
                    f"{s['phases'][p]['share_median']:.2%}",
                    nc,
                ]
            )
        rows.append(
            [
                key,
                "= selection (adv + samples + tokens)",
                f"{s['selection']['ms_median']:.1f}",
                f"{s['selection']['share_median']:.2%}",
                sum(ncoll.get(p, 0) for p in SELECTION),
            ]
        )
        rows.append(
            [
                key,
                "= rebalancing",
                f"{s['rebalancing']['ms_median']:.1f}",
                f"{s['rebalancing']['share_median']:.2%}",
                sum(ncoll.get(p, 0) for p in REBALANCE),
            ]
        )
        rows.append([key, "= step (sum of phases)", f"{s['step_s_median'] * 1e3:.1f}", "100%", ""])
        rows.append(
            [
                key,
                "(latency of one 8 B DP all-reduce)",
                f"{res['dp_allreduce_8B_latency_ms_median']:.2f}",
                "",
                "",
            ]
        )
    print()
    table = C.print_table(["layout", "phase", "ms (median)", "share of step", "collectives"], rows)
    for k, v in notes.items():
        print(f"NOTE {k}: {v}")
    for key, res in out.items():
        st = res["steps"]
        kept = [x["rows_kept_before_rebalance"] for x in st]
        after = [x["rows_after_rebalance"] for x in st]
        tokens_kept = C.median(x["tokens_kept_global"] for x in st)
        tokens_eligible = C.median(x["tokens_eligible_global"] for x in st)
        print(
            f"{key}: {cfg['prompts_per_rank'] * cfg['group_size']} rollouts per DP rank -> "
            f"{min(kept)}-{max(kept)} kept on rank 0 -> {min(after)}-{max(after)} after "
            "rebalance; token imbalance max/mean "
            f"{C.median(x['imbalance_before'] for x in st):.3f} -> "
            f"{C.median(x['imbalance_after'] for x in st):.3f} (median); tokens "
            f"kept/eligible (global) {tokens_kept:.0f}/{tokens_eligible:.0f}"
        )
    data = {
        "benchmark": NAME,
        "machine": C.machine_info(),
        "config": {**cfg, "layouts": layouts},
        "notes": {
            "oversubscription": notes,
            "timing": (
                "a barrier precedes every phase; a phase's time is the maximum over ranks; "
                "step = sum of phases; medians over the measured steps (after warm-up); share "
                "= median over steps of phase / step"
            ),
            "model": (
                "megatron-core TP layers on CPU/gloo: VocabParallelEmbedding, layers x "
                "(ColumnParallelLinear -> gelu -> RowParallelLinear + residual), "
                "ColumnParallelLinear head (vocab-sharded logits). No attention, no Megatron "
                "schedule/DDP: a plain micro-batch loop and a per-parameter DP all-reduce"
            ),
            "scaling": (
                "selection cost depends on the batch (B, S) only, not on the model: in a real "
                "model the step is far longer and the share smaller; the absolute ms are the "
                "transferable number"
            ),
        },
        "layouts": out,
        "table": table,
        "elapsed_s": time.time() - t0,
    }
    path = C.write_json(NAME, data, quick)
    plot(out, C.png_path(NAME, quick))
    print(f"\nwrote {path} and {C.png_path(NAME, quick)} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
