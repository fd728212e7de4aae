"""One mixture-of-experts RL step on the CPU: expert parallelism 1 vs 2 at the same two ranks.

Model: a random Qwen3-MoE made with transformers (``--hidden`` 256, 4 layers, 8 experts of
width 512, top-2, head_dim 64, the byte-level tokenizer), float32, on the Megatron backend's
local spec (``SequentialMLP`` experts). Batch: 16 rows of up to 160 tokens (a 32-token prompt,
then the response), split over the two data-parallel ranks; GRPO, token_mean.

Layouts (2 gloo ranks each, one core per rank):

``ep1``            DP 2, EP 1: every rank holds every expert, no token leaves its rank;
``ep2_alltoall``   DP 2, EP 2: each rank holds 4 experts, tokens go to their experts'
                   rank and back by all-to-all (megatron-core's ``alltoall`` dispatcher);
``ep2_allgather``  the same split with the ``allgather`` dispatcher (every rank sees every
                   token, keeps its experts' share, reduce-scatters the outputs back).

An RL step's two Megatron calls are timed: ``score`` (old log-probs + entropy, forward only)
and ``train_step`` (forward, backward, optimizer). The token dispatcher's share: wall time
inside its dispatch / combine methods (the permutation and the communication), in the forward
from wrappers and in the backward from gradient hooks on each method's input and output (the
span between the gradient reaching its output and leaving its input); the rest is attention,
experts, router and the head. At EP 2 the dispatcher's collectives are where a rank waits for
the other, so its share includes that wait. Memory: expert parameter bytes per rank and the
process peak.

Rounds rotate the layout order (``--rounds``, ``--reps`` per launch); times are medians of the
slowest rank. Writes ``benchmarks/results/bench_moe_ep.{json,png}``.

    python benchmarks/bench_moe_ep.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as C  # noqa: E402

NAME = "bench_moe_ep"
OPS = ("score", "train_step")
LAYOUTS = {
    "ep1": {"ep": 1, "dispatcher": "alltoall", "label": "DP 2 x EP 1"},
    "ep2_alltoall": {"ep": 2, "dispatcher": "alltoall", "label": "DP 2 x EP 2, all-to-all"},
    "ep2_allgather": {"ep": 2, "dispatcher": "allgather", "label": "DP 2 x EP 2, all-gather"},
}
REFERENCE = "ep1"
DISPATCH_METHODS = (
    "dispatch_preprocess",
    "token_dispatch",
    "dispatch_postprocess",
    "combine_preprocess",
    "token_combine",
    "combine_postprocess",
)


def make_model(folder: str, hidden: int, layers: int, experts: int, width: int) -> str:
    """A random Qwen3-MoE folder (transformers' own save) with the byte-level tokenizer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from nemo_d3s.backends.hf.loading import byte_level_tokenizer

    tok = byte_level_tokenizer()
    cfg = Qwen3MoeConfig(
        vocab_size=320,
        hidden_size=hidden,
        intermediate_size=2 * width,
        moe_intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=512,
        use_sliding_window=False,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------- rank body


class DispatcherClock:
    """Wall seconds inside the token dispatcher's methods (module docstring): ``forward``
    from wrappers on the classes, ``backward`` from gradient hooks around each call."""

    def __init__(self):
        self.forward = 0.0
        self.backward = 0.0
        self._saved = []

    def install(self):
        from megatron.core.transformer.moe import token_dispatcher as td

        for cls in (td.MoEAlltoAllTokenDispatcher, td.MoEAllGatherTokenDispatcher):
            for name in DISPATCH_METHODS:
                fn = getattr(cls, name, None)
                if fn is not None:
                    self._saved.append((cls, name, fn))
                    setattr(cls, name, self._wrap(fn))
        return self

    def reset(self):
        self.forward = self.backward = 0.0

    def _wrap(self, fn):
        import torch

        def grads_of(x):
            items = x if isinstance(x, (tuple, list)) else (x,)
            return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.forward += time.perf_counter() - t0
            ins = [t for a in args for t in grads_of(a)]
            outs = grads_of(out)
            if torch.is_grad_enabled() and ins and outs:
                started = []
                outs[0].register_hook(lambda g: started.append(time.perf_counter()))

                def ended(g):
                    if started:
                        self.backward += time.perf_counter() - started.pop()

                ins[0].register_hook(ended)
            return out

        return wrapper


def _rank(rank, name, cfg):
    import gc

    import torch
    from megatron.core import parallel_state as ps

    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig
    from nemo_d3s.core.losses import loss_denominator
    from nemo_d3s.trainer.update import one_minibatch_loss_fn

    lay = LAYOUTS[name]
    clock = DispatcherClock().install()
    pol = MegatronBackend(
        MegatronBackendConfig(
            model=cfg["model"],
            device="cpu",
            dtype="float32",
            expert_model_parallel_size=lay["ep"],
            moe_token_dispatcher_type=lay["dispatcher"],
        )
    )
    batch, adv, noise, keep = C.grpo_batch(cfg["B"], cfg["S"], cfg["prompt"], 256)
    half = cfg["B"] // 2
    rows = torch.arange(half) + half * ps.get_data_parallel_rank()
    local = batch.select(rows)
    M = cfg["micro_batch_size"]
    first = pol.score(local, with_entropy=True, micro_batch_size=M)
    loss_fn = one_minibatch_loss_fn(
        local, first.logprobs + noise[rows] * local.attention_mask, adv[rows], keep[rows]
    )
    denominator = float(loss_denominator(keep, "token_mean"))
    calls = {
        "score": lambda: pol.score(local, with_entropy=True, micro_batch_size=M),
        "train_step": lambda: pol.train_step(local, loss_fn, M, denominator=denominator),
    }
    rec = {op: {"wall": [], "cpu": [], "fwd": [], "bwd": []} for op in OPS}
    for rep in range(cfg["reps"]):
        for op in C.rotate(OPS, rep + cfg["round"]):
            gc.collect()
            C.barrier()
            clock.reset()
            c0, t0 = time.process_time(), time.perf_counter()
            calls[op]()
            rec[op]["wall"].append(time.perf_counter() - t0)
            rec[op]["cpu"].append(time.process_time() - c0)
            rec[op]["fwd"].append(clock.forward)
            rec[op]["bwd"].append(clock.backward)
    experts = sum(
        p.numel() * p.element_size()
        for n, p in pol.chunks[0].named_parameters()
        if ".experts." in n
    )
    return {
        "rank": rank,
        "ep": ps.get_expert_model_parallel_world_size(),
        "threads": torch.get_num_threads(),
        "rec": rec,
        "expert_param_bytes": experts,
        "rss_peak_bytes": C._proc_status()["VmHWM"],
        "logprobs": first.logprobs,
        "response_mask": local.response_mask,
    }


# ---------------------------------------------------------------------------- aggregation


def summarize(launches):
    """Per layout: medians over every repetition of every launch (the slowest rank's time,
    the dispatcher's seconds of that rank), memory per rank, log-probs against EP 1."""
    ref = launches[REFERENCE][0]
    out = {}
    for name, runs in launches.items():
        rec = {"layout": name, "label": LAYOUTS[name]["label"], "launches": len(runs)}
        for op in OPS:
            wall, disp_f, disp_b, cpu = [], [], [], []
            for ranks in runs:
                for k in range(len(ranks[0]["rec"][op]["wall"])):
                    slow = max(ranks, key=lambda r: r["rec"][op]["wall"][k])
                    wall.append(slow["rec"][op]["wall"][k])
                    disp_f.append(slow["rec"][op]["fwd"][k])
                    disp_b.append(slow["rec"][op]["bwd"][k])
                    cpu.append(sum(r["rec"][op]["cpu"][k] for r in ranks))
            w = C.median(wall)
            d = C.median([f + b for f, b in zip(disp_f, disp_b)])
            rec[op] = {
                "wall_s_median": w,
                "cpu_s_median": C.median(cpu),
                "dispatcher_forward_s_median": C.median(disp_f),
                "dispatcher_backward_s_median": C.median(disp_b),
                "dispatcher_share": d / w if w else None,
                "wall_s_all": wall,
            }
        step = rec["score"]["wall_s_median"] + rec["train_step"]["wall_s_median"]
        rec["rl_step_s"] = step
        ranks = runs[0]
        rec["expert_param_bytes_per_rank"] = max(r["expert_param_bytes"] for r in ranks)
        rec["rss_peak_bytes_per_rank"] = max(r["rss_peak_bytes"] for r in ranks)
        err = 0.0
        for r, q in zip(
            sorted(ranks, key=lambda r: r["rank"]), sorted(ref, key=lambda r: r["rank"])
        ):
            m = r["response_mask"]
            err = max(err, float((r["logprobs"] - q["logprobs"])[m].abs().max()))
        rec["logprob_max_abs_diff_vs_ep1"] = err
        out[name] = rec
    base = out[REFERENCE]["rl_step_s"]
    for rec in out.values():
        rec["rl_step_vs_ep1"] = rec["rl_step_s"] / base
    return out


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, name in enumerate(names):
        left = 0.0
        for op, color in (("score", "#4c72b0"), ("train_step", "#dd8452")):
            r = summary[name][op]
            d = r["dispatcher_forward_s_median"] + r["dispatcher_backward_s_median"]
            ax.barh(i, r["wall_s_median"] - d, left=left, color=color, label=f"{op}: other")
            left += r["wall_s_median"] - d
            ax.barh(i, d, left=left, color=color, hatch="//", alpha=0.6, label=f"{op}: dispatcher")
            left += d
    ax.set_yticks(range(len(names)), [summary[n]["label"] for n in names])
    ax.set_xlabel("seconds (median, slowest rank)")
    ax.set_title("one MoE RL step on 2 CPU ranks: score + train_step")
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys(), fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, 1 round, 1 rep")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args(argv)
    rounds, reps = (1, 1) if a.quick else (a.rounds, a.reps)
    started = time.perf_counter()
    hidden = 128 if a.quick else a.hidden
    cfg = {"B": 16, "S": 160, "prompt": 32, "micro_batch_size": 4, "reps": reps}
    C.set_preload(["torch", "transformers", "megatron.core", "nemo_d3s.backends.megatron"])
    with tempfile.TemporaryDirectory() as tmp:
        cfg["model"] = make_model(os.path.join(tmp, "moe"), hidden, 4, 8, 2 * hidden)
        launches = {n: [] for n in LAYOUTS}
        for r in range(rounds):
            for name in C.rotate(list(LAYOUTS), r):
                t0 = time.perf_counter()
                res = C.run_ranks(
                    _rank, 2, name, {**cfg, "round": r}, threads=C.threads_per_rank(2)
                )
                if {x["ep"] for x in res} != {LAYOUTS[name]["ep"]}:
                    raise RuntimeError(f"{name}: the ranks report EP {[x['ep'] for x in res]}")
                launches[name].append(res)
                print(f"round {r} {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    summary = summarize(launches)
    rows = []
    for name, s in summary.items():
        rows.append(
            [
                s["label"],
                f"{s['score']['wall_s_median']:.3f}",
                f"{s['train_step']['wall_s_median']:.3f}",
                f"{s['rl_step_s']:.3f}",
                f"{s['rl_step_vs_ep1']:.2f}x",
                f"{100 * s['score']['dispatcher_share']:.0f}%",
                f"{100 * s['train_step']['dispatcher_share']:.0f}%",
                C.fmt_bytes(s["expert_param_bytes_per_rank"]),
                C.fmt_bytes(s["rss_peak_bytes_per_rank"]),
                f"{s['logprob_max_abs_diff_vs_ep1']:.1e}",
            ]
        )
    C.print_table(
        [
            "layout",
            "score s",
            "train s",
            "RL step s",
            "vs EP 1",
            "disp. score",
            "disp. train",
            "experts/rank",
            "peak RSS/rank",
            "|dlogp| vs EP 1",
        ],
        rows,
    )
    data = {
        "machine": C.machine_info(),
        "config": {**cfg, "hidden": hidden, "layers": 4, "experts": 8, "top_k": 2},
        "rounds": rounds,
        "elapsed_s": time.perf_counter() - started,
        "note": C.oversubscription_note(2),
        "summary": summary,
    }
    print("wrote", C.write_json(NAME, data, quick=a.quick))
    path = C.png_path(NAME, quick=a.quick)
    plot(summary, path)
    print("wrote", path)


if __name__ == "__main__":
    main()
