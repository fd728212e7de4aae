"""Megatron backend vs HF backend on the CPU: step time and resident memory, same model and batch.

Model: the embedded SmolLM2-135M-Instruct (``model="smollm2-135m-instruct"``), float32,
no autocast. Batch: B rows right-padded to S tokens, a P-token prompt then the response
(row i is S - (7 i mod min(50, S - P)) tokens long: 111 to 160 at the defaults), random token
ids; micro-batch size M. Loss: GRPO, token_mean over every response token, old
log-probs = the layout's own first ``score`` + small noise (ratio ~1, as in a real step), built as
``tests/backends/megatron/test_backend.py`` builds it (``trainer.update.make_loss_fn``,
``core.losses.loss_denominator``).

Layouts (each in its own process(es): the resident set of a process is that layout's):

``hf``                 ``HFBackend``, 1 process, all cores' threads;
``megatron_tp1``       ``MegatronBackend`` TP1 x PP1, 1 process, all cores' threads;
``megatron_tp1_pp2``   ``MegatronBackend`` TP1 x PP2, 2 gloo ranks x (cores / 2) threads
                       (1F1B pipeline; informative: on 2 cores the two stages have no core
                       to spare, so it shows the memory split, not a speed-up).

Measured per layout: build time; one untimed ``score`` (first-call costs; its log-probs
are the old log-probs, and are compared with the HF backend's); then, ``--reps`` times,
``policy.score(batch, with_entropy=True, micro_batch_size=M)`` and
``policy.train_step(batch, loss_fn, M, denominator=...)`` in rotating order. Time = wall
seconds of the slowest rank (a barrier before each call); CPU = process CPU seconds summed
over the ranks (less sensitive to other jobs on the machine than wall time). Memory per
rank (``benchlib``: glibc set to return freed blocks, so RSS follows live memory): RSS at
start (interpreter + torch + transformers; + megatron-core in the Megatron ranks), after
building the policy and its peak during the build, the rise of RSS during each call, RSS at
the end, and the process peak (VmHWM over the launch; from the first ``train_step`` on it
includes gradients and AdamW's two moments). The Megatron backend's HF rollout replica is
built on first use and neither call uses it, so it is not counted: a run that samples with
``rollout.engine=hf`` holds one more full copy of the weights on the first rank of each
model-parallel group.

Interleaving: the layouts cannot share a process (per-process RSS), so a run is
``--rounds`` rounds; every round launches each layout once, the order rotating between
rounds, and each launch runs ``--reps`` repetitions of both calls. Tables show medians over
every repetition of every round and ratios to ``hf`` from the same run.

    python benchmarks/bench_megatron_cpu.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as C  # noqa: E402

NAME = "bench_megatron_cpu"
MODEL = "smollm2-135m-instruct"
OPS = ("score", "train_step")
LAYOUTS = {
    "hf": {"backend": "hf", "tp": 1, "pp": 1, "label": "HF, 1 process"},
    "megatron_tp1": {"backend": "megatron", "tp": 1, "pp": 1, "label": "Megatron TP1, 1 process"},
    "megatron_tp1_pp2": {
        "backend": "megatron",
        "tp": 1,
        "pp": 2,
        "label": "Megatron TP1 x PP2, 2 ranks",
    },
}
REFERENCE = "hf"


# ---------------------------------------------------------------------------- rank body


def _loss_fn(batch, old_lp, adv, keep):
    from nemo_d3s.trainer.update import one_minibatch_loss_fn

    return one_minibatch_loss_fn(batch, old_lp, adv, keep)


def _policy(name, cfg):
    lay = LAYOUTS[name]
    common = dict(model=cfg["model"], device="cpu", dtype="float32")
    if lay["backend"] == "hf":
        from nemo_d3s.backends.hf.backend import HFBackend
        from nemo_d3s.backends.hf.config import HFBackendConfig

        return HFBackend(HFBackendConfig(**common, autocast=None))
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    return MegatronBackend(
        MegatronBackendConfig(
            **common, tensor_model_parallel_size=lay["tp"], pipeline_model_parallel_size=lay["pp"]
        )
    )


def _module_bytes(module) -> int:
    return sum(
        t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers())
    )


def _rank(rank, name, cfg):
    import torch

    from nemo_d3s.core.losses import loss_denominator

    rss_start = C._proc_status()["VmRSS"]
    t0 = time.perf_counter()
    pol = _policy(name, cfg)
    build_s = time.perf_counter() - t0
    st = C._proc_status()
    peak = st["VmHWM"]  # before the first RssPeak resets it
    batch, adv, noise, keep = C.grpo_batch(cfg["B"], cfg["S"], cfg["prompt"], cfg["vocab_ids"])
    M = cfg["micro_batch_size"]

    gc.collect()
    C.barrier()
    with C.RssPeak() as rp:
        t0 = time.perf_counter()
        first = pol.score(batch, with_entropy=True, micro_batch_size=M)
        first_score_s = time.perf_counter() - t0
    peak = max(peak, rp.before + (rp.delta or 0))
    loss_fn = _loss_fn(batch, first.logprobs + noise * batch.attention_mask, adv, keep)
    denominator = float(loss_denominator(keep, "token_mean"))
    calls = {
        "score": lambda: pol.score(batch, with_entropy=True, micro_batch_size=M),
        "train_step": lambda: pol.train_step(batch, loss_fn, M, denominator=denominator),
    }
    wall = {op: [] for op in OPS}
    cpu = {op: [] for op in OPS}
    rise = {op: [] for op in OPS}
    first_metrics = None
    for rep in range(cfg["reps"]):
        for op in C.rotate(OPS, rep + cfg["round"]):
            gc.collect()
            C.barrier()
            with C.RssPeak() as rp:
                c0, t0 = time.process_time(), time.perf_counter()
                out = calls[op]()
                wall[op].append(time.perf_counter() - t0)
                cpu[op].append(time.process_time() - c0)
            if op == "train_step" and first_metrics is None:
                first_metrics = {k: float(v) for k, v in out.items()}
            del out
            rise[op].append(rp.delta)
            peak = max(peak, rp.before + (rp.delta or 0))
    return {
        "rank": rank,
        "threads": torch.get_num_threads(),
        "build_s": build_s,
        "first_score_s": first_score_s,
        "wall_s": wall,
        "cpu_s": cpu,
        "rss_rise_bytes": rise,
        "rss_start_bytes": rss_start,
        "rss_built_bytes": st["VmRSS"],
        "rss_build_peak_bytes": st["VmHWM"],
        "rss_peak_bytes": peak,
        "rss_end_bytes": C._proc_status()["VmRSS"],
        "param_bytes": _module_bytes(pol.model),
        "first_train_metrics": first_metrics,
        "logprobs": first.logprobs,
        "entropy": first.entropy,
        "response_mask": batch.response_mask,
    }


# ---------------------------------------------------------------------------- aggregation


def summarize(launches, names):
    """Per layout: medians over all repetitions of all launches (time: slowest rank; CPU:
    summed over ranks), per-rank memory (median over launches), agreement with the reference."""
    out = {}
    ref = launches[REFERENCE][0][0] if REFERENCE in launches else None
    for name in names:
        runs = launches[name]
        world = len(runs[0])
        rec = {
            "layout": name,
            "label": LAYOUTS[name]["label"],
            "ranks": world,
            "launches": len(runs),
        }
        for op in OPS:
            wall = [
                max(r[i]["wall_s"][op][k] for i in range(world))
                for r in runs
                for k in range(len(r[0]["wall_s"][op]))
            ]
            cpu = [
                sum(r[i]["cpu_s"][op][k] for i in range(world))
                for r in runs
                for k in range(len(r[0]["cpu_s"][op]))
            ]
            rec[op] = {
                "wall_s_median": C.median(wall),
                "wall_s_all": wall,
                "cpu_s_median": C.median(cpu),
                "cpu_s_all": cpu,
            }
        rec["build_s_median"] = C.median(max(r[i]["build_s"] for i in range(world)) for r in runs)
        rec["first_score_s_median"] = C.median(
            max(r[i]["first_score_s"] for i in range(world)) for r in runs
        )
        per_rank = []
        for i in range(world):
            keys = (
                "rss_start_bytes",
                "rss_built_bytes",
                "rss_build_peak_bytes",
                "rss_peak_bytes",
                "rss_end_bytes",
            )
            d = {
                "rank": i,
                "threads": runs[0][i]["threads"],
                "param_bytes": runs[0][i]["param_bytes"],
            }
            for k in keys:
                d[k + "_median"] = C.median(r[i][k] for r in runs)
                d[k + "_all"] = [r[i][k] for r in runs]
            for op in OPS:
                d[f"{op}_rss_rise_bytes_median"] = C.median(
                    x for r in runs for x in r[i]["rss_rise_bytes"][op]
                )
            per_rank.append(d)
        rec["per_rank"] = per_rank
        m = runs[0][0]["first_train_metrics"] or {}
        rec["first_train_step"] = {
            k: m.get(k) for k in ("grad_norm", "loss_sum", "skipped") if k in m
        }
        if ref is not None:
            # on response tokens: the HF backend scores from a micro-batch's first response
            # column on (the prompt positions hold 0), the Megatron backend every position
            lp, ent, resp = (
                runs[0][0]["logprobs"],
                runs[0][0]["entropy"],
                runs[0][0]["response_mask"],
            )
            rec["agreement_vs_hf"] = {
                "logprobs_max_abs_diff": float((lp - ref["logprobs"])[resp].abs().max()),
                "entropy_max_abs_diff": float((ent - ref["entropy"])[resp].abs().max()),
            }
            g, g_ref = m.get("grad_norm"), (ref["first_train_metrics"] or {}).get("grad_norm")
            if g is not None and g_ref:
                rec["agreement_vs_hf"]["grad_norm_rel_diff"] = abs(g - g_ref) / g_ref
        out[name] = rec
    if REFERENCE in out:
        for rec in out.values():
            rec["ratio_vs_hf"] = {
                op: rec[op]["wall_s_median"] / out[REFERENCE][op]["wall_s_median"] for op in OPS
            }
            rec["cpu_ratio_vs_hf"] = {
                op: rec[op]["cpu_s_median"] / out[REFERENCE][op]["cpu_s_median"] for op in OPS
            }
    return out


# ---------------------------------------------------------------------------- plot


def plot(summary, cfg, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(summary)
    colors = {"hf": "#6a9fd4", "megatron_tp1": "#d95f02", "megatron_tp1_pp2": "#7570b3"}
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(names)
    x = np.arange(len(OPS))
    for j, name in enumerate(names):
        rec = summary[name]
        xs = x + (j - (len(names) - 1) / 2) * width
        ys = [rec[op]["wall_s_median"] for op in OPS]
        ax_t.bar(
            xs,
            ys,
            width,
            color=colors.get(name),
            edgecolor="black",
            linewidth=0.4,
            label=rec["label"],
        )
        for xi, yi, op in zip(xs, ys, OPS):
            ratio = rec.get("ratio_vs_hf", {}).get(op)
            ax_t.text(
                xi,
                yi,
                f"{yi:.1f} s" + (f"\n{ratio:.2f}x" if ratio and name != REFERENCE else ""),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax_t.set_xticks(x)
    ax_t.set_xticklabels(
        [
            f"score (with entropy)\nMBS {cfg['micro_batch_size']}",
            f"train_step\nMBS {cfg['micro_batch_size']}",
        ]
    )
    ax_t.set_ylabel("wall seconds, slowest rank (median)")
    ax_t.set_title("step time (ratio to HF)")
    ax_t.legend(fontsize=8)
    ax_t.grid(axis="y", alpha=0.3)

    bars = [(name, d) for name in names for d in summary[name]["per_rank"]]
    gib = 2**30
    for k, (name, d) in enumerate(bars):
        start = d["rss_start_bytes_median"] / gib
        built = d["rss_built_bytes_median"] / gib
        peak = d["rss_peak_bytes_median"] / gib
        ax_m.bar(
            k,
            start,
            color="#cccccc",
            edgecolor="black",
            linewidth=0.4,
            label="process start" if k == 0 else None,
        )
        ax_m.bar(
            k,
            built - start,
            bottom=start,
            color=colors.get(name),
            alpha=0.55,
            edgecolor="black",
            linewidth=0.4,
            label="+ policy built" if k == 0 else None,
        )
        ax_m.bar(
            k,
            peak - built,
            bottom=built,
            color=colors.get(name),
            edgecolor="black",
            linewidth=0.4,
            hatch="//",
            label="+ up to the peak (steps, AdamW state)" if k == 0 else None,
        )
        ax_m.text(k, peak, f"{peak:.2f}", ha="center", va="bottom", fontsize=8)
    ax_m.set_xticks(range(len(bars)))
    ax_m.set_xticklabels(
        [f"{summary[n]['label'].split(',')[0]}\nrank {d['rank']}" for n, d in bars], fontsize=8
    )
    ax_m.set_ylabel("resident set (GiB), median over launches")
    ax_m.set_title("peak RSS per rank")
    ax_m.legend(fontsize=8, loc="upper right")
    ax_m.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"{cfg['model']} fp32 on CPU ({C.cores()} cores): {cfg['B']} rows x {cfg['S']} "
        f"tokens (prompt {cfg['prompt']}); {cfg['rounds']} rounds x {cfg['reps']} reps",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="8 rows x 96 tokens, MBS 4, 1 round (smoke test, ~2 min)",
    )
    ap.add_argument(
        "--model", default=MODEL, help="HF folder or the embedded smollm2-135m-instruct"
    )
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--batch", type=int, default=None, help="rows B (default 16)")
    ap.add_argument(
        "--seq", type=int, default=None, help="tokens per row S, right-padded (default 160)"
    )
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens per row (default 60)")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="M (default 8)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="launches of every layout, order rotating (default 3)",
    )
    ap.add_argument(
        "--reps", type=int, default=1, help="timed repetitions of each call per launch (default 1)"
    )
    args = ap.parse_args(argv)
    quick = args.quick
    cfg = {
        "model": args.model,
        "B": args.batch or (8 if quick else 16),
        "S": args.seq or (96 if quick else 160),
        "prompt": args.prompt or (32 if quick else 60),
        "micro_batch_size": args.micro_batch_size or (4 if quick else 8),
        "rounds": args.rounds or (1 if quick else 3),
        "reps": args.reps,
        "vocab_ids": 49152,  # SmolLM2's vocabulary
        "dtype": "float32",
        "loss": "grpo, token_mean, every response token",
        "quick": quick,
    }
    names = [n for n in LAYOUTS if n in args.layouts]
    # torch/transformers/nemo_d3s preloaded in the fork server; megatron-core is imported by
    # the Megatron ranks only, so the HF process's resident set does not carry it.
    quiet = (
        "ignore:Apex is not installed:UserWarning",
        "ignore:full scope is deprecated:UserWarning",
    )
    os.environ["PYTHONWARNINGS"] = ",".join(
        x for x in (os.environ.get("PYTHONWARNINGS"), *quiet) if x
    )
    C.set_preload(
        ["torch", "torch.distributed", "transformers", "nemo_d3s.core", "nemo_d3s.distributed"]
    )
    t_start = time.time()
    notes = {}
    launches = {n: [] for n in names}
    for rnd in range(cfg["rounds"]):
        for name in C.rotate(names, rnd):
            lay = LAYOUTS[name]
            world = lay["tp"] * lay["pp"]
            sizes = (lay["tp"], lay["pp"], 1) if lay["backend"] == "megatron" else None
            t0 = time.time()
            res = C.run_ranks(
                _rank,
                world,
                name,
                {**cfg, "round": rnd},
                threads=C.threads_per_rank(world),
                megatron_sizes=sizes,
                timeout=1200,
            )
            launches[name].append(res)
            print(
                f"round {rnd + 1}/{cfg['rounds']} {name}: "
                + ", ".join(f"{op} {max(r['wall_s'][op][0] for r in res):.1f} s" for op in OPS)
                + f" ({time.time() - t0:.0f} s)",
                flush=True,
            )
    for name in names:
        world = LAYOUTS[name]["tp"] * LAYOUTS[name]["pp"]
        note = C.oversubscription_note(world)
        if world > 1:
            note = note or (
                f"{world} ranks x {C.threads_per_rank(world)} thread on {C.cores()} CPU "
                "cores: every core is busy, none is left for gloo's threads or other jobs "
                "on the machine, which time-share with the ranks; the two stages overlap "
                "only across micro-batches (1F1B), and each runs single-threaded where "
                "the 1-process layouts run 2 threads"
            )
            notes[name] = note
            print(f"NOTE {name}: {note}", flush=True)
    summary = summarize(launches, names)

    print()
    rows = []
    for name, rec in summary.items():
        agree = rec.get("agreement_vs_hf", {})
        score_diff = max(
            agree.get("logprobs_max_abs_diff", 0), agree.get("entropy_max_abs_diff", 0)
        )
        rows.append(
            [
                rec["label"],
                *(f"{rec[op]['wall_s_median']:.2f}" for op in OPS),
                *(f"{rec.get('ratio_vs_hf', {}).get(op, float('nan')):.2f}" for op in OPS),
                *(f"{rec[op]['cpu_s_median']:.1f}" for op in OPS),
                f"{rec['build_s_median']:.1f}",
                f"{score_diff:.1e}" if "agreement_vs_hf" in rec else "-",
                f"{rec['agreement_vs_hf'].get('grad_norm_rel_diff', float('nan')):.1e}"
                if "agreement_vs_hf" in rec
                else "-",
            ]
        )
    table = C.print_table(
        [
            "layout",
            "score s",
            "train_step s",
            "score /hf",
            "train /hf",
            "score CPU s",
            "train CPU s",
            "build s",
            "max|diff| lp,ent",
            "grad norm rel",
        ],
        rows,
    )
    print()
    mem_rows = []
    for name, rec in summary.items():
        for d in rec["per_rank"]:
            mem_rows.append(
                [
                    rec["label"],
                    d["rank"],
                    d["threads"],
                    C.fmt_bytes(d["param_bytes"]),
                    C.fmt_bytes(d["rss_start_bytes_median"]),
                    C.fmt_bytes(d["rss_built_bytes_median"]),
                    C.fmt_bytes(d["rss_build_peak_bytes_median"]),
                    C.fmt_bytes(d["score_rss_rise_bytes_median"]),
                    C.fmt_bytes(d["train_step_rss_rise_bytes_median"]),
                    C.fmt_bytes(d["rss_end_bytes_median"]),
                    C.fmt_bytes(d["rss_peak_bytes_median"]),
                ]
            )
    mem_table = C.print_table(
        [
            "layout",
            "rank",
            "threads",
            "params",
            "RSS start",
            "RSS built",
            "build peak",
            "score rise",
            "train rise",
            "RSS end",
            "peak RSS",
        ],
        mem_rows,
    )
    for k, v in notes.items():
        print(f"NOTE {k}: {v}")
    data = {
        "benchmark": NAME,
        "machine": C.machine_info(),
        "config": {
            **cfg,
            "layouts": names,
            "threads_per_rank": {
                n: C.threads_per_rank(LAYOUTS[n]["tp"] * LAYOUTS[n]["pp"]) for n in names
            },
        },
        "notes": {
            "oversubscription": notes,
            "wall_s": (
                "wall seconds of the slowest rank per call (barrier before each call), median "
                "over every repetition of every round"
            ),
            "cpu_s": (
                "process CPU seconds (time.process_time, all threads) of the call, summed over "
                "the ranks"
            ),
            "rss": (
                "per rank, median over launches; glibc mmap threshold 64 KiB and eager trim "
                "(RSS follows live memory); start = after imports (fork server preloads torch, "
                "transformers, nemo_d3s), built = after the policy is constructed, peak = "
                "VmHWM over the launch (includes AdamW moments after the first train_step), "
                "rise = VmHWM during the call minus VmRSS before it"
            ),
            "rollout_replica": (
                "not built (neither call needs it): with rollout.engine=hf the Megatron "
                "backend adds one full copy of the weights on the first rank of each "
                "model-parallel group"
            ),
            "interleaving": (
                "one launch per layout per round, order rotating by round; calls rotate order "
                "within a launch"
            ),
            "agreement_vs_hf": (
                "first score's log-probs / entropy (max abs diff) and first train_step's grad "
                "norm (relative) against the hf layout"
            ),
        },
        "results": summary,
        "table": table,
        "memory_table": mem_table,
    }
    png = C.png_path(NAME, quick)
    plot(summary, cfg, png)
    data["elapsed_s"] = time.time() - t_start
    print(f"\nwrote {C.write_json(NAME, data, quick)} and {png} ({data['elapsed_s']:.0f} s)")
    return data


if __name__ == "__main__":
    main()
