"""Fused vocab-parallel entropy + log-prob vs gathering the full vocabulary.

Per TP size (gloo ranks on CPU, one process group per TP size) and logits dtype, every
rank holds its vocabulary shard ``[B, S, V/TP]`` of random logits and the same targets,
and three methods compute per-token entropy and target log-prob:

``fused``         ``nemo_d3s.distributed.vocab_parallel_entropy_and_logprobs``: the shard
                  never leaves its rank; 2 all-reduces of O(B x S) floats.
``gather_core``   all-gather the shards and concatenate to ``[B, S, V]`` on every rank
                  (what ``gather_output=True`` does; the backward keeps this rank's slice
                  of the gradient), then ``nemo_d3s.core.entropy.entropy_and_logprobs``
                  (chunked, fp32 accumulation). At TP=1 there is nothing to gather and
                  ``fused`` falls back to the same core function, so it is not run twice.
``gather_naive``  the same gather, then ``log_softmax`` of the fp32 logits over the whole
                  vocabulary, entropy = -sum p log p: what a straightforward trainer does.

Two modes: ``fwd`` (no grad: the old-policy pass that produces entropy + old log-probs) and
``fwd_bwd`` (training pass: forward, then ``logprobs.sum().backward()`` down to this rank's
shard; its gradient, the size of the shard, counts as extra memory).

Reported per (TP, dtype, method, mode): median wall time of the slowest rank over
interleaved repetitions, and the extra memory of one rank (maximum over ranks) measured
two ways (see ``benchlib``): torch allocator peak (profiler memory events; exact, torch
buffers only) and resident-set peak minus the resident set before the call (OS view, glibc
set to return freed buffers). An analytic estimate of the dominant buffers is printed
beside them. Inputs (the logits shard and targets) are allocated before measuring and not
counted.

    python benchmarks/bench_vocab_parallel_entropy.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as C  # noqa: E402

NAME = "bench_vocab_parallel_entropy"
METHODS = ("fused", "gather_core", "gather_naive")
MODES = ("fwd", "fwd_bwd")
DTYPES = {"fp32": 4, "bf16": 2}


# ---------------------------------------------------------------------------- analytic model


def analytic_bytes(method: str, mode: str, n: int, v: int, tp: int, dsize: int, chunk: int) -> int:
    """Dominant extra buffers of one rank (bytes), from reading the implementations.

    n tokens, v vocabulary, shard width v/tp, logits element size dsize, c = min(chunk, n)
    tokens per chunk; fp32 workspace is 4 bytes/element. Small O(n) vectors are ignored.
    """
    c = min(chunk, n)
    vr = v // tp
    bf16 = dsize == 2
    if method == "fused" and tp > 1:
        # fwd chunk: u, e (e*u is taken in place) (+ the fp32 upcast z for bf16);
        # bwd: grad shard + gz (+ z and the bf16 cast of gz for bf16 logits).
        fwd = (3 if bf16 else 2) * c * vr * 4
        bwd = n * vr * dsize + c * vr * ((4 + 4 + 2) if bf16 else 4)
        return fwd if mode == "fwd" else max(fwd, bwd)
    # core on [n, V]: z (bf16 upcast), u, e per chunk (e*u is taken in place).
    core_fwd = c * v * (3 if bf16 else 2) * 4
    # core bwd: grad [n, V] + (z upcast for bf16) + exp(z - lse) and its product with -g
    # alive together (+ the bf16 cast of that product).
    core_bwd = n * v * dsize + c * v * ((4 + 4 + 4 + 2) if bf16 else 2 * 4)
    full = n * v * dsize
    if method == "fused" or (method == "gather_core" and tp == 1):
        return core_fwd if mode == "fwd" else max(core_fwd, core_bwd)
    gather_peak = 2 * full if tp > 1 else 0  # the gathered parts + their concatenation
    held = full if tp > 1 else 0
    shard_grad = n * vr * dsize
    if method == "gather_core":
        fwd = max(gather_peak, held + core_fwd)
        if mode == "fwd":
            return fwd
        # grad of the full logits, then the copy of this rank's slice
        return max(fwd, held + core_bwd + shard_grad)
    # gather_naive: log_softmax output, exp, product: 3 [n, V] fp32 (the bf16 upcast is
    # freed once log_softmax returns).
    fwd = max(gather_peak, held + 3 * n * v * 4)
    if mode == "fwd":
        return fwd
    # bwd: saved log_softmax output + grad of it + grad of its input (which is the logits'
    # gradient at TP=1), + this rank's slice at TP>1. The forward peak dominates.
    bwd = 3 * n * v * 4 + (shard_grad if tp > 1 else 0)
    return max(fwd, bwd)


# ---------------------------------------------------------------------------- ranks


def _rank(rank, cfg):
    import torch
    import torch.distributed as dist

    from nemo_d3s.core.entropy import entropy_and_logprobs
    from nemo_d3s.distributed import vocab_parallel_entropy_and_logprobs

    group = dist.group.WORLD
    tp = dist.get_world_size()
    B, S, V, chunk = cfg["B"], cfg["S"], cfg["V"], cfg["chunk"]
    assert V % tp == 0
    vr = V // tp
    gather_seconds = []

    class _GatherVocab(torch.autograd.Function):
        """[B, S, V/TP] -> [B, S, V] on every rank; backward keeps this rank's slice."""

        @staticmethod
        def forward(ctx, shard):
            t0 = time.perf_counter()
            parts = [torch.empty_like(shard) for _ in range(tp)]
            dist.all_gather(parts, shard.contiguous(), group=group)
            full = torch.cat(parts, dim=-1)
            del parts
            gather_seconds.append(time.perf_counter() - t0)
            return full

        @staticmethod
        def backward(ctx, g):
            return g[..., rank * vr : (rank + 1) * vr].contiguous()

    def gather(x):
        return x if tp == 1 else _GatherVocab.apply(x)

    def run(method, shard, targets):
        if method == "fused":
            return vocab_parallel_entropy_and_logprobs(
                shard, targets, group if tp > 1 else None, chunk_size=chunk
            )
        full = gather(shard)
        if method == "gather_core":
            return entropy_and_logprobs(full, targets, chunk_size=chunk)
        lp_all = torch.log_softmax(full.float(), dim=-1)
        logprobs = lp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            entropy = -(lp_all.exp() * lp_all).sum(-1)
        return entropy, logprobs

    def call(method, mode, shard, targets):
        if mode == "fwd":
            with torch.no_grad():
                out = run(method, shard, targets)
        else:
            out = run(method, shard, targets)
            out[1].sum().backward()
        return out

    records = []
    for dname in cfg["dtypes"]:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname]
        g = torch.Generator().manual_seed(1000 + rank)
        shard = (torch.randn(B, S, vr, generator=g) * cfg["logit_std"]).to(dtype)
        targets = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(7))
        shard.requires_grad_(True)
        methods = [m for m in METHODS if not (tp == 1 and m == "gather_core")]
        combos = [(m, mode) for mode in cfg["modes"] for m in methods]

        # One untimed call per combination first: warm-up, allocator peak under the
        # profiler, and (fwd) the agreement of the results with fused.
        alloc, agree, ref = {}, {}, None
        for combo in combos:
            shard.grad = None
            gc.collect()
            C.barrier()
            with C.TorchAllocPeak() as ap:
                ent, lp = call(*combo, shard, targets)
            shard.grad = None
            alloc[combo] = C.max_over_ranks(ap.peak)
            if combo[1] == "fwd":
                if ref is None:
                    ref = (ent.clone(), lp.detach().clone())
                agree[combo[0]] = {
                    "entropy_max_abs_diff": float((ent - ref[0]).abs().max()),
                    "logprob_max_abs_diff": float((lp.detach() - ref[1]).abs().max()),
                }
            del ent, lp

        times = {c: [] for c in combos}
        gtimes = {c: [] for c in combos}
        rss = {c: [] for c in combos}
        for rep in range(cfg["reps"]):
            for combo in C.rotate(combos, rep):
                shard.grad = None
                gc.collect()
                C.barrier()
                del gather_seconds[:]
                with C.RssPeak() as rp:
                    t0 = time.perf_counter()
                    out = call(*combo, shard, targets)
                    dt = time.perf_counter() - t0
                del out
                shard.grad = None
                dt, gt, rd = C.max_over_ranks_vec(
                    [dt, sum(gather_seconds), rp.delta if rp.delta is not None else -1]
                )
                times[combo].append(dt)
                gtimes[combo].append(gt)
                rss[combo].append(rd if rd >= 0 else None)

        for m, mode in combos:
            records.append(
                {
                    "tp": tp,
                    "dtype": dname,
                    "method": m,
                    "mode": mode,
                    "time_s_median": C.median(times[(m, mode)]),
                    "time_s_all": times[(m, mode)],
                    "gather_s_median": C.median(gtimes[(m, mode)])
                    if m != "fused" and tp > 1
                    else 0.0,
                    "torch_alloc_peak_bytes": int(alloc[(m, mode)]),
                    "rss_peak_delta_bytes_median": C.median(rss[(m, mode)]),
                    "rss_peak_delta_bytes_all": rss[(m, mode)],
                    "analytic_bytes": analytic_bytes(m, mode, B * S, V, tp, DTYPES[dname], chunk),
                    "agreement_vs_fused": agree.get(m, agree.get("fused")),
                }
            )
            if tp == 1 and m == "fused":
                # gather_core at TP=1 is the same call (no gather; fused falls back to core).
                r = dict(records[-1])
                r["method"] = "gather_core"
                r["same_as"] = "fused (TP=1: nothing to gather, both run core.entropy_and_logprobs)"
                records.append(r)
        del shard, targets
        gc.collect()
    return records if rank == 0 else None


# ---------------------------------------------------------------------------- main


def plot(records, cfg, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tps = sorted({r["tp"] for r in records})
    dtypes = [d for d in cfg["dtypes"]]
    colors = {"fused": "#1b9e77", "gather_core": "#d95f02", "gather_naive": "#7570b3"}
    hatches = {"fp32": "", "bf16": "//"}
    fig, axes = plt.subplots(
        2, len(cfg["modes"]), figsize=(6.5 * len(cfg["modes"]), 8.5), squeeze=False
    )
    bars = [(m, d) for d in dtypes for m in METHODS]
    width = 0.8 / len(bars)
    x = np.arange(len(tps))
    for j, mode in enumerate(cfg["modes"]):
        for i, (key, label, scale) in enumerate(
            [
                ("torch_alloc_peak_bytes", "extra memory per rank (GiB)", 2**30),
                ("time_s_median", "time (s), slowest rank, median", 1),
            ]
        ):
            ax = axes[i][j]
            for b, (m, d) in enumerate(bars):
                ys, gs = [], []
                for tp in tps:
                    hit = [
                        r
                        for r in records
                        if r["tp"] == tp
                        and r["method"] == m
                        and r["dtype"] == d
                        and r["mode"] == mode
                    ]
                    ys.append(hit[0][key] / scale if hit else 0)
                    gs.append(hit[0]["gather_s_median"] if hit else 0)
                xs = x + (b - (len(bars) - 1) / 2) * width
                ax.bar(
                    xs,
                    ys,
                    width,
                    color=colors[m],
                    hatch=hatches[d],
                    edgecolor="black",
                    linewidth=0.4,
                    label=f"{m} {d}",
                )
                if i == 1 and any(gs):
                    ax.bar(
                        xs,
                        gs,
                        width,
                        color="black",
                        alpha=0.3,
                        linewidth=0,
                        label="of which all-gather" if b == 1 else None,
                    )
            ax.set_xticks(x)
            ax.set_xticklabels([f"TP={t}" + (" (oversub.)" if t > C.cores() else "") for t in tps])
            ax.set_ylabel(label)
            ax.set_title(
                "forward (old-policy pass)"
                if mode == "fwd"
                else "forward + backward (training pass)"
            )
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[1][0].get_legend_handles_labels()
    pairs = sorted(
        zip(handles, labels), key=lambda hl: hl[1] == "of which all-gather"
    )  # stable: overlay last
    handles, labels = [h for h, _ in pairs], [l for _, l in pairs]
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(
        f"Entropy + log-prob of B*S={cfg['B'] * cfg['S']} tokens, V={cfg['V']}, gloo/CPU, "
        f"{C.cores()} cores\n"
        "memory: torch allocator peak above inputs (per rank, max over ranks); TP=1: "
        "gather_core == fused",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small vocabulary, TP 1-2, 2 repetitions (smoke test, < 60 s)",
    )
    ap.add_argument("--tp", type=int, nargs="+", default=None, help="TP sizes (default 1 2 4)")
    ap.add_argument(
        "--vocab", type=int, default=None, help="vocabulary size (default 152064, Qwen2.5)"
    )
    ap.add_argument("--batch", type=int, default=None, help="B (default 4)")
    ap.add_argument("--seq", type=int, default=None, help="S (default 128): B*S tokens")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed repetitions per method, after one untimed profiled call (default 2)",
    )
    ap.add_argument(
        "--chunk-size",
        type=int,
        default=1024,
        help="chunk_size of both implementations (library default 1024)",
    )
    args = ap.parse_args(argv)

    quick = args.quick
    cfg = {
        "B": args.batch or (2 if quick else 4),
        "S": args.seq or (64 if quick else 128),
        "V": args.vocab or (32768 if quick else 152064),
        "chunk": args.chunk_size,
        "dtypes": args.dtypes,
        "modes": args.modes,
        "reps": args.reps or 2,
        "logit_std": 2.0,
        "quick": quick,
    }
    tps = args.tp or ([1, 2] if quick else [1, 2, 4])
    C.set_preload(["torch", "torch.distributed", "nemo_d3s.core", "nemo_d3s.distributed"])
    t_start = time.time()
    records, notes = [], {}
    for tp in tps:
        if cfg["V"] % tp:
            raise SystemExit(f"--vocab {cfg['V']} is not divisible by TP={tp}")
        note = C.oversubscription_note(tp)
        if note:
            notes[f"tp{tp}"] = note
            print(f"NOTE TP={tp}: {note}", flush=True)
        t0 = time.time()
        records += C.run_ranks(_rank, tp, cfg, threads=C.threads_per_rank(tp), timeout=900)[0]
        print(f"TP={tp} done in {time.time() - t0:.0f} s", flush=True)

    rows = []
    for r in records:
        fused = [
            q
            for q in records
            if q["tp"] == r["tp"]
            and q["dtype"] == r["dtype"]
            and q["mode"] == r["mode"]
            and q["method"] == "fused"
        ][0]
        rows.append(
            [
                r["tp"],
                r["dtype"],
                r["mode"],
                r["method"] + (" (=fused)" if r.get("same_as") else ""),
                f"{r['time_s_median'] * 1e3:.0f}",
                f"{r['gather_s_median'] * 1e3:.0f}" if r["gather_s_median"] else "-",
                f"{r['time_s_median'] / fused['time_s_median']:.2f}",
                f"{(r['time_s_median'] - r['gather_s_median']) / fused['time_s_median']:.2f}",
                C.fmt_bytes(r["torch_alloc_peak_bytes"]),
                C.fmt_bytes(r["rss_peak_delta_bytes_median"]),
                C.fmt_bytes(r["analytic_bytes"]),
                f"{r['torch_alloc_peak_bytes'] / max(1, fused['torch_alloc_peak_bytes']):.1f}",
                f"{max(r['agreement_vs_fused'].values()):.1e}" if r["agreement_vs_fused"] else "-",
            ]
        )
    print()
    table = C.print_table(
        [
            "TP",
            "dtype",
            "mode",
            "method",
            "ms",
            "of which gather ms",
            "time/fused",
            "(ms-gather)/fused",
            "alloc peak",
            "RSS peak",
            "analytic",
            "mem/fused",
            "max|diff| vs fused",
        ],
        rows,
    )
    for k, v in notes.items():
        print(f"NOTE {k}: {v}")
    # The analytic model matches the measured allocator peaks here; use it to show what the
    # same code needs at a training-sized micro-batch, where the gathered [N, V] dominates.
    ext_n, ext_v, ext_tp = 8192, 152064, (1, 2, 4, 8)
    extrapolation = []
    for dname in ("bf16",):
        for mode in MODES:
            for m in METHODS:
                extrapolation.append(
                    {
                        "tokens": ext_n,
                        "vocab": ext_v,
                        "dtype": dname,
                        "chunk": cfg["chunk"],
                        "mode": mode,
                        "method": m,
                        "bytes_by_tp": {
                            str(t): analytic_bytes(
                                m, mode, ext_n, ext_v, t, DTYPES[dname], cfg["chunk"]
                            )
                            for t in ext_tp
                        },
                    }
                )
    print(
        "\n"
        f"Analytic extra memory per rank at N={ext_n} tokens (e.g. 2 x 4096), V={ext_v}, "
        f"bf16, chunk {cfg['chunk']}:"
    )
    C.print_table(
        ["mode", "method"] + [f"TP={t}" for t in ext_tp],
        [
            [e["mode"], e["method"]] + [C.fmt_bytes(e["bytes_by_tp"][str(t)]) for t in ext_tp]
            for e in extrapolation
        ],
    )
    data = {
        "benchmark": NAME,
        "machine": C.machine_info(),
        "config": {
            **cfg,
            "tp": tps,
            "tokens": cfg["B"] * cfg["S"],
            "threads_per_rank": {str(t): C.threads_per_rank(t) for t in tps},
        },
        "notes": {
            "oversubscription": notes,
            "time": (
                "wall seconds of the slowest rank per call, median over interleaved "
                "repetitions (methods and modes rotate order each round)"
            ),
            "torch_alloc_peak_bytes": (
                "peak of torch CPU allocator allocations minus frees during one call on the "
                "calling thread (profiler memory events), max over ranks; excludes inputs; "
                "includes outputs and the shard gradient"
            ),
            "rss_peak_delta_bytes": (
                "VmHWM after the call minus VmRSS before it (peak reset via "
                "/proc/self/clear_refs, glibc mmap threshold 64 KiB so freed buffers leave "
                "RSS), max over ranks; includes gloo buffers and any thread's allocations"
            ),
            "analytic_bytes": (
                "dominant buffers per analytic_bytes() in this script (no O(B*S) vectors)"
            ),
            "gather_core_tp1": (
                "not run separately at TP=1: fused falls back to core.entropy_and_logprobs "
                "there, the same call"
            ),
        },
        "results": records,
        "analytic_extrapolation": extrapolation,
        "table": table,
        "elapsed_s": time.time() - t_start,
    }
    path = C.write_json(NAME, data, quick)
    plot(records, cfg, C.png_path(NAME, quick))
    print(f"\nwrote {path} and {C.png_path(NAME, quick)} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
