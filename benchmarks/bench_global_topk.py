"""DP-global token top-K%: radix-histogram threshold vs all-gather + quantile / sort.

Every rank of a gloo group (default 4 ranks, CPU) holds ``N_total / world`` token scores
``|A| x H`` (rows of 1024 tokens; a quarter of the rows have A = 0, as degenerate GRPO
groups do; entropies exponential), all eligible, and keeps the top ``K`` = 20% of the
scores of ALL ranks. Methods:

``radix8`` / ``radix16``  ``select_tokens_global(scope="global_exact", bits_per_round=8|16)``:
                          exact top-k; only histograms travel (<= 32/bits all-reduces of
                          2^bits + 1 int64, plus one all-gather of one int64 when the
                          threshold value is tied across the cut).
``gather_quantile``       ``select_tokens_global(scope="gather_quantile")`` (TRL's rule):
                          all-gather every score, threshold = linear quantile at 1 - K.
                          torch.quantile refuses more than 2^24 elements; above that the
                          library computes the same quantile from two ``torch.kthvalue``
                          order statistics (``topk.quantile_linear``).
``gather_sort``           all-gather every score, stable descending ``torch.sort``, keep the
                          first k = ceil(K x N) in global order: the exact reference (same
                          tie rule as radix: rank, then flattened index).
``local``                 ``scope="local"``: top K% of this rank only; no collective. A floor
                          for time; it keeps a different set (shown as "differs" below).

Reported per total size: median wall time of the slowest rank over interleaved repetitions;
the bytes each rank receives from collectives, counted by wrapping ``torch.distributed``
calls (payload: all_reduce = tensor bytes, all_gather = world x input bytes) next to the
analytic formula; a ring-algorithm wire estimate; the resident-set peak during the call;
and whether the mask equals the exact reference (and the kept count of the quantile rule).

    python benchmarks/bench_global_topk.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as C  # noqa: E402

NAME = "bench_global_topk"
METHODS = ("radix8", "radix16", "gather_quantile", "gather_sort", "local")
ROW = 1024
TORCH_QUANTILE_MAX = 1 << 24


def analytic_bytes(
    method: str, n_total: int, world: int, rounds: int = None, tie_step: bool = True
) -> dict:
    """Bytes received per rank: payload (what the collective delivers to the rank) and a
    ring-algorithm wire estimate (bytes a rank sends, = receives: all-reduce 2 (w-1)/w x
    size, all-gather (w-1)/w x output)."""
    per_rank = math.ceil(n_total / world)
    ring_ar = 2 * (world - 1) / world
    ring_ag = (world - 1) / world
    if method.startswith("radix"):
        bits = int(method[5:])
        r = 32 // bits if rounds is None else rounds
        ar = r * ((1 << bits) + 1) * 8
        ag = world * 8 if tie_step else 0
        return {
            "payload": ar + ag,
            "ring_wire": ar * ring_ar + ag * ring_ag,
            "formula": f"{r} x (2^{bits}+1) x 8 B all-reduce"
            + (f" + {world} x 8 B all-gather" if tie_step else ""),
        }
    if method in ("gather_quantile", "gather_sort"):
        ag = world * 8 + world * per_rank * 4
        return {
            "payload": ag,
            "ring_wire": ag * ring_ag,
            "formula": f"{world} x 8 B counts + {world} x {per_rank} x 4 B scores all-gather",
        }
    return {"payload": 0, "ring_wire": 0.0, "formula": "no collective"}


# ---------------------------------------------------------------------------- ranks


def _rank(rank, cfg):
    import torch
    import torch.distributed as dist

    from nemo_d3s.distributed import select_tokens_global
    from nemo_d3s.distributed.comm import all_gather_counts, all_gather_varlen, exclusive_prefix

    group = dist.group.WORLD
    world = dist.get_world_size()
    k_frac = cfg["k_frac"]

    def gather_sort(scores, eligible):
        local = scores[eligible].to(torch.float32)
        counts = all_gather_counts(local.numel(), group, local.device)
        everything, _ = all_gather_varlen(local, group, counts)
        k = math.ceil(k_frac * everything.numel())
        order = torch.sort(everything, descending=True, stable=True).indices
        keep_all = torch.zeros(everything.numel(), dtype=torch.bool)
        keep_all[order[:k]] = True
        off = int(exclusive_prefix(counts)[rank])
        keep = torch.zeros_like(eligible)
        keep[eligible] = keep_all[off : off + local.numel()]
        return keep

    def call(method, scores, eligible):
        if method == "gather_sort":
            return gather_sort(scores, eligible), None
        if method.startswith("radix"):
            sel = select_tokens_global(
                scores,
                eligible,
                k_frac,
                group,
                scope="global_exact",
                bits_per_round=int(method[5:]),
            )
        else:
            sel = select_tokens_global(scores, eligible, k_frac, group, scope=method)
        return sel.token_keep, sel

    records = []
    for n_total in cfg["sizes"]:
        n_local = n_total // world
        rows = n_local // ROW
        g = torch.Generator().manual_seed(10_000 * rank + n_total % 9973)
        adv = torch.randn(rows, 1, generator=g)
        adv[torch.rand(rows, 1, generator=g) < 0.25] = 0.0  # degenerate groups: A = 0
        entropy = torch.empty(rows, ROW).exponential_(1.0, generator=g)
        scores = (adv.abs() * entropy).contiguous()
        eligible = torch.ones(rows, ROW, dtype=torch.bool)
        del entropy
        gc.collect()
        k = math.ceil(k_frac * n_total)

        # One counted, checked, untimed call per method (also the warm-up).
        info = {}
        ref = None
        masks = {}
        for m in cfg["methods"]:
            C.barrier()
            with C.CollectiveCounter() as cc:
                keep, sel = call(m, scores, eligible)
            masks[m] = keep
            kept_local = torch.tensor([int(keep.sum())], dtype=torch.long)
            dist.all_reduce(kept_local, group=group)
            info[m] = {
                "counted": cc.summary(),
                "n_kept_global": int(kept_local),
                "threshold": None if sel is None or sel.threshold is None else float(sel.threshold),
            }
        ref = masks.get("gather_sort")
        for m in cfg["methods"]:
            if ref is not None:
                same = torch.tensor([int(torch.equal(masks[m], ref))], dtype=torch.long)
                dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
                info[m]["equals_exact_reference"] = bool(int(same))
        del masks, ref
        gc.collect()

        reps = cfg["reps"][n_total]
        times = {m: [] for m in cfg["methods"]}
        rss = {m: [] for m in cfg["methods"]}
        for rep in range(reps):
            for m in C.rotate(cfg["methods"], rep):
                gc.collect()
                C.barrier()
                with C.RssPeak() as rp:
                    t0 = time.perf_counter()
                    out = call(m, scores, eligible)
                    dt = time.perf_counter() - t0
                del out
                dt, rd = C.max_over_ranks_vec([dt, rp.delta if rp.delta is not None else -1])
                times[m].append(dt)
                rss[m].append(rd if rd >= 0 else None)

        for m in cfg["methods"]:
            counted = info[m]["counted"]
            n_rounds = counted["by_op"].get("all_reduce", {}).get("calls", 0)
            tie = "all_gather" in counted["by_op"]
            a = analytic_bytes(m, n_total, world, n_rounds if m.startswith("radix") else None, tie)
            a_max = analytic_bytes(m, n_total, world) if m.startswith("radix") else a
            note = None
            if m == "gather_quantile":
                note = (
                    "torch.quantile"
                    if n_total <= TORCH_QUANTILE_MAX
                    else "torch.quantile refuses > 2^24 elements: the library falls back to two "
                    "torch.kthvalue order statistics (same linear interpolation)"
                )
            if m == "gather_sort":
                note = (
                    "exact reference: all-gather + stable descending torch.sort, first k in "
                    "global order"
                )
            if m == "local":
                note = "per-rank top K% (no collective): keeps a different set than the global rule"
            records.append(
                {
                    "n_total": n_total,
                    "n_per_rank": n_local,
                    "world": world,
                    "k": k,
                    "method": m,
                    "time_s_median": C.median(times[m]),
                    "time_s_all": times[m],
                    "bytes_received_counted": counted["total_bytes"],
                    "collectives_counted": counted["by_op"],
                    "bytes_received_analytic": a["payload"],
                    "bytes_received_analytic_worst_case": a_max["payload"],
                    "bytes_ring_wire_estimate": a["ring_wire"],
                    "analytic_formula": a["formula"],
                    "rss_peak_delta_bytes_median": C.median(rss[m]),
                    "n_kept_global": info[m]["n_kept_global"],
                    "kept_minus_k": info[m]["n_kept_global"] - k,
                    "equals_exact_reference": info[m].get("equals_exact_reference"),
                    "threshold": info[m]["threshold"],
                    "note": note,
                }
            )
        del scores, eligible, adv
        gc.collect()
    return records if rank == 0 else None


# ---------------------------------------------------------------------------- main


def size_label(n: int) -> str:
    e = n.bit_length() - 1
    return f"2^{e} ({n / 1e6:.1f}M)" if n == 1 << e else f"{n / 1e6:.1f}M"


def plot(records, cfg, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "radix8": "#1b9e77",
        "radix16": "#66a61e",
        "gather_quantile": "#d95f02",
        "gather_sort": "#7570b3",
        "local": "#999999",
    }
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5.2))
    for m in cfg["methods"]:
        rs = sorted((r for r in records if r["method"] == m), key=lambda r: r["n_total"])
        xs = [r["n_total"] for r in rs]
        a1.plot(xs, [r["time_s_median"] for r in rs], "o-", color=colors[m], label=m)
        if m != "local":
            a2.plot(
                xs,
                [r["bytes_received_counted"] for r in rs],
                "o-",
                color=colors[m],
                label=f"{m} (counted)",
            )
            a2.plot(
                xs,
                [r["bytes_received_analytic"] for r in rs],
                "x--",
                color=colors[m],
                alpha=0.6,
                label=f"{m} (analytic)",
            )
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"total scores over {cfg['world']} ranks")
        ax.axvline(TORCH_QUANTILE_MAX, color="k", lw=0.8, ls=":")
        ax.grid(alpha=0.3, which="both")
    a1.text(
        TORCH_QUANTILE_MAX * 1.05,
        a1.get_ylim()[0] * 1.3,
        "above 2^24: torch.quantile -> 2 x kthvalue",
        fontsize=8,
        rotation=90,
        va="bottom",
    )
    a1.set_ylabel("time (s), slowest rank, median")
    a1.set_title(
        f"time per selection (top {cfg['k_frac']:.0%}), {cfg['world']} gloo ranks on "
        f"{C.cores()} cores"
    )
    a2.set_ylabel("bytes received per rank (log)")
    a2.set_title("collective payload per rank: counted (solid) vs analytic (dashed)")
    a1.legend(fontsize=8)
    a2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="sizes 2^20 and 2^21, 2 repetitions (smoke test, < 60 s)",
    )
    ap.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    ap.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=None,
        help="total scores (default 2^20 2^22 2^24 2^25)",
    )
    ap.add_argument("--k-frac", type=float, default=0.2)
    ap.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed repetitions after one untimed checked call (default 3)",
    )
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    args = ap.parse_args(argv)

    quick = args.quick
    sizes = args.sizes or ([1 << 20, 1 << 21] if quick else [1 << 20, 1 << 22, 1 << 24, 1 << 25])
    for n in sizes:
        if n % (args.world * ROW):
            raise SystemExit(f"size {n} must be a multiple of world x {ROW}")
    fixed = args.reps
    cfg = {
        "world": args.world,
        "sizes": sizes,
        "k_frac": args.k_frac,
        "methods": args.methods,
        "quick": quick,
    }
    reps_of = (lambda n: fixed) if fixed else ((lambda n: 2) if quick else (lambda n: 3))
    C.set_preload(["torch", "torch.distributed", "nemo_d3s.core", "nemo_d3s.distributed"])
    note = C.oversubscription_note(args.world)
    if note:
        print(f"NOTE: {note}", flush=True)
    t0 = time.time()
    records = C.run_ranks(
        _rank,
        args.world,
        {**cfg, "reps": {n: reps_of(n) for n in sizes}},
        threads=C.threads_per_rank(args.world),
        timeout=1800,
    )[0]

    rows = []
    for r in records:
        ref = [q for q in records if q["n_total"] == r["n_total"] and q["method"] == "radix8"]
        rt = r["time_s_median"] / ref[0]["time_s_median"] if ref else float("nan")
        eq = r["equals_exact_reference"]
        rows.append(
            [
                size_label(r["n_total"]),
                r["method"],
                f"{r['time_s_median'] * 1e3:.1f}",
                f"{rt:.2f}",
                C.fmt_bytes(r["bytes_received_counted"]),
                C.fmt_bytes(r["bytes_received_analytic"]),
                C.fmt_bytes(r["rss_peak_delta_bytes_median"]),
                f"{r['kept_minus_k']:+d}",
                {True: "yes", False: "differs", None: "-"}[eq],
                ("kthvalue" if r["n_total"] > TORCH_QUANTILE_MAX else "torch.quantile")
                if r["method"] == "gather_quantile"
                else "",
            ]
        )
    print()
    table = C.print_table(
        [
            "N total",
            "method",
            "ms",
            "time/radix8",
            "bytes recv (counted)",
            "analytic",
            "RSS peak",
            "kept-k",
            "== exact",
            "quantile via",
        ],
        rows,
    )
    if note:
        print(f"NOTE: {note}")
    data = {
        "benchmark": NAME,
        "machine": C.machine_info(),
        "config": {
            **cfg,
            "row_length": ROW,
            "threads_per_rank": C.threads_per_rank(args.world),
            "reps": {str(n): reps_of(n) for n in sizes},
            "data": (
                "scores = |A_row| x H, A ~ N(0,1) with 25% of rows A=0, H ~ Exp(1), fp32, all "
                "eligible"
            ),
        },
        "notes": {
            "oversubscription": note,
            "time": (
                "wall seconds of the slowest rank per call, median over interleaved repetitions"
            ),
            "bytes_received_counted": (
                "sum over the collectives issued during one call (torch.distributed wrapped): "
                "all_reduce = tensor bytes, all_gather = world x input bytes (own part "
                "included)"
            ),
            "bytes_ring_wire_estimate": (
                "bytes one rank sends (= receives) with ring algorithms: all-reduce 2(w-1)/w x "
                "size, all-gather (w-1)/w x output"
            ),
            "quantile_above_2^24": (
                "torch.quantile raises for inputs over 2^24 elements; "
                "nemo_d3s.distributed.topk.quantile_linear then takes the two neighbouring "
                "order statistics with torch.kthvalue (positions in float64) and interpolates "
                "linearly, as torch.quantile would"
            ),
            "rss_peak_delta_bytes": (
                "VmHWM after the call minus VmRSS before it (max over ranks, median over "
                "repetitions)"
            ),
        },
        "results": records,
        "table": table,
        "elapsed_s": time.time() - t0,
    }
    path = C.write_json(NAME, data, quick)
    plot(records, cfg, C.png_path(NAME, quick))
    print(f"\nwrote {path} and {C.png_path(NAME, quick)} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
