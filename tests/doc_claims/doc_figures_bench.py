"""benchmarks/README.md's figures, rendered from the benchmark records (``doc_figures.claims``
adds them; ``tests/test_doc_numbers.py`` checks each occurs in the document)."""

from __future__ import annotations

from typing import List

from doc_records import GIB, MIB, median, record, sci


def benchmarks_readme() -> List[str]:
    """benchmarks/README.md's global top-K and micro-batch tables, from their records."""
    res = record("bench_global_topk.json")["results"]
    by = {(r["n_total"], r["method"]): r for r in res}
    out = []
    for n in sorted({r["n_total"] for r in res}):

        def ms(m):
            return f"{by[(n, m)]['time_s_median'] * 1000:.0f} ms"

        def b(m):
            x = by[(n, m)]["bytes_received_counted"]
            return f"{x / 1024:.1f} KiB" if x < MIB else f"{x / MIB:.1f} MiB"

        quant = ms("gather_quantile") + (" (kthvalue)" if n > 2**24 else "")
        gather = f"{by[(n, 'gather_sort')]['bytes_received_counted'] / MIB:.0f} MiB"
        out.append(
            f"| 2^{n.bit_length() - 1} ({n / 1e6:.1f}M) | {ms('radix8')} | {ms('radix16')} | "
            f"{quant} | {ms('gather_sort')} | {b('radix8')} / {b('radix16')} / {gather} |"
        )
    ent = {
        (r["tp"], r["dtype"], r["method"]): r["torch_alloc_peak_bytes"]
        for r in record("bench_vocab_parallel_entropy.json")["results"]
        if r["mode"] == "fwd"
    }

    def size(x):
        return (f"{x / GIB:.1f}", "GiB") if x >= GIB else (f"{x / MIB:.0f}", "MiB")

    def pair(tp, method):
        (a, ua), (b, ub) = size(ent[(tp, "fp32", method)]), size(ent[(tp, "bf16", method)])
        return f"{a} / {b} {ua}" if ua == ub else f"{a} {ua} / {b} {ub}"

    out.append(f"| 1 | {pair(1, 'fused')} (core) | = fused | {pair(1, 'gather_naive')} |")
    for tp in (2, 4):
        out.append(
            f"| {tp} | {pair(tp, 'fused')} | {pair(tp, 'gather_core')} | "
            f"{pair(tp, 'gather_naive')} |"
        )
    vpe = record("bench_vocab_parallel_entropy.json")
    t = {(r["tp"], r["dtype"], r["mode"], r["method"]): r for r in vpe["results"] if r["tp"] > 1}

    def sec(tp, method, mode="fwd"):
        return t[(tp, "fp32", mode, method)]["time_s_median"]

    def x(tp, method, mode="fwd"):
        return sec(tp, method, mode) / sec(tp, "fused", mode)

    def mx(tp, dtype, method):
        return ent[(tp, dtype, method)] / ent[(tp, dtype, "fused")]

    no_gather = (
        sec(2, "gather_core") - t[(2, "fp32", "fwd", "gather_core")]["gather_s_median"]
    ) / (sec(2, "fused"))
    ext = {(e["method"], e["mode"]): e["bytes_by_tp"] for e in vpe["analytic_extrapolation"]}
    out += [
        f"gather_core needs {mx(2, 'fp32', 'gather_core'):.1f}x (TP2) and "
        f"{mx(4, 'fp32', 'gather_core'):.1f}x (TP4) the memory of fused in fp32 "
        f"({mx(2, 'bf16', 'gather_core'):.1f}x / {mx(4, 'bf16', 'gather_core'):.1f}x in bf16), "
        f"gather_naive {mx(2, 'fp32', 'gather_naive'):.0f}x / {mx(4, 'fp32', 'gather_naive'):.0f}x",
        f"TP2 fused {sec(2, 'fused'):.2f} s vs gather_core {sec(2, 'gather_core'):.2f} s "
        f"({x(2, 'gather_core'):.1f}x; {no_gather:.2f}x without the all-gather itself) and "
        f"gather_naive {sec(2, 'gather_naive'):.2f} s ({x(2, 'gather_naive'):.1f}x); TP4 "
        f"(oversubscribed) {sec(4, 'fused'):.2f} s vs {sec(4, 'gather_core'):.2f} s "
        f"({x(4, 'gather_core'):.1f}x) and {sec(4, 'gather_naive'):.2f} s "
        f"({x(4, 'gather_naive'):.1f}x)",
        f"Forward + backward: {x(2, 'gather_core', 'fwd_bwd'):.1f}x / "
        f"{x(2, 'gather_naive', 'fwd_bwd'):.1f}x at TP2, {x(4, 'gather_core', 'fwd_bwd'):.1f}x / "
        f"{x(4, 'gather_naive', 'fwd_bwd'):.1f}x at TP4",
        f"the forward needs {ext[('fused', 'fwd')]['2'] / MIB:.0f} MiB (TP2) / "
        f"{ext[('fused', 'fwd')]['4'] / MIB:.0f} MiB (TP4) per rank fused against "
        f"{ext[('gather_core', 'fwd')]['2'] / GIB:.1f} GiB gathered + core and "
        f"{ext[('gather_naive', 'fwd')]['2'] / GIB:.1f} GiB gathered + naive",
    ]
    gen = record("bench_batched_generation.json")["times_s"]
    g = {k: median(v) for k, v in gen.items()}
    ref = g["hf_generate_per_prompt"]
    out.append(
        f"`model.generate` once per prompt {ref:.2f} s; the seeded sampler once per prompt "
        f"{g['seeded_per_prompt']:.2f} s ({ref / g['seeded_per_prompt']:.2f}x); the seeded "
        f"sampler in one batched call {g['seeded_batched']:.2f} s "
        f"({ref / g['seeded_batched']:.2f}x)"
    )
    r = record("bench_megatron_cpu.json")["results"]

    def w(layout, call):
        return r[layout][call]["wall_s_median"]

    def rel(layout, call):
        return w(layout, call) / w("hf", call)

    out.append(
        f"score {w('hf', 'score'):.2f} s (HF) / {w('megatron_tp1', 'score'):.2f} s (Megatron "
        f"TP1, {rel('megatron_tp1', 'score'):.2f}x) / {w('megatron_tp1_pp2', 'score'):.2f} s "
        f"(TP1 x PP2, {rel('megatron_tp1_pp2', 'score'):.2f}x); train_step "
        f"{w('hf', 'train_step'):.2f} s / {w('megatron_tp1', 'train_step'):.2f} s "
        f"({rel('megatron_tp1', 'train_step'):.2f}x) / {w('megatron_tp1_pp2', 'train_step'):.2f} s"
        f" ({rel('megatron_tp1_pp2', 'train_step'):.2f}x)"
    )

    big = {r["method"]: r for r in res if r["n_total"] == max(x["n_total"] for x in res)}
    r8, r16, gq = big["radix8"], big["radix16"], big["gather_quantile"]
    out += [
        f"radix8 = {r8['collectives_counted']['all_reduce']['calls']} all-reduces x 257 int64 = "
        f"{r8['bytes_received_counted']:,} B",
        f"radix16 = {r16['collectives_counted']['all_reduce']['calls']} x 65,537 int64",
        f"{round(gq['bytes_received_counted'] / r8['bytes_received_counted'], -3):,.0f}x less "
        "traffic than the gather",
        f"Peak RSS per rank at {max(x['n_total'] for x in res) / 1e6:.1f}M: radix "
        f"{r8['rss_peak_delta_bytes_median'] / MIB:.0f} MiB, gather + quantile "
        f"{gq['rss_peak_delta_bytes_median'] / MIB:.0f} MiB, gather + sort "
        f"{big['gather_sort']['rss_peak_delta_bytes_median'] / MIB:.0f} MiB",
    ]
    sel = record("bench_selection_overhead.json")["layouts"]
    one, two = sel["TP2xDP1"], sel["TP2xDP2"]
    ph = one["summary"]["phases"]

    def share(layout, part):
        return layout["summary"][part]["share_median"]

    out += [
        f"TP2xDP1 step {one['summary']['step_s_median']:.1f} s = old-logprob pass "
        f"{ph['old_logprob_pass']['share_median']:.0%}, training fwd/bwd "
        f"{ph['train_fwd_bwd']['share_median']:.0%}, AdamW {ph['optimizer']['share_median']:.0%}",
        f"{one['summary']['selection']['ms_median']:.1f} ms ({share(one, 'selection'):.2%}), "
        f"rebalancing {one['summary']['rebalancing']['ms_median']:.1f} ms "
        f"({share(one, 'rebalancing'):.2%}). TP2xDP2 (4 ranks on 2 cores): step "
        f"{two['summary']['step_s_median']:.1f} s; selection "
        f"{two['summary']['selection']['ms_median']:.0f} ms ({share(two, 'selection'):.2%}",
        f"rebalancing {two['summary']['rebalancing']['ms_median']:.0f} ms "
        f"({share(two, 'rebalancing'):.2%}",
        f"(one 8-byte all-reduce: {two['dp_allreduce_8B_latency_ms_median']:.1f} ms under "
        "oversubscription)",
    ]

    def minutes(name):
        return f"{record(name)['elapsed_s'] / 60:.1f} min"

    sig = [b["seconds"] for b in record("bench_token_signal.json")["batches"]]
    out += [
        f"bench_vocab_parallel_entropy.py # {minutes('bench_vocab_parallel_entropy.json')} on 2 "
        "cores (the record's run)",
        f"bench_global_topk.py # {minutes('bench_global_topk.json')}",
        f"bench_megatron_cpu.py # {minutes('bench_megatron_cpu.json')} on 2 cores (3 rounds",
        f"bench_selection_overhead.py # {minutes('bench_selection_overhead.json')}",
        f"bench_token_signal.py # {min(sig) / 60:.0f}-{max(sig) / 60:.0f} min a batch on 1 core",
        f"bench_microbatch.py # {record('bench_microbatch.json')['wall_s']:.0f} s (HF tiny Llama",
    ]

    def cpu(layout, call):
        return r[layout][call]["cpu_s_median"] / r["hf"][call]["cpu_s_median"]

    def rank(layout, i=0):
        return r[layout]["per_rank"][i]

    agree = r["megatron_tp1"]["agreement_vs_hf"]
    peak = {k: [p["rss_peak_bytes_median"] / GIB for p in r[k]["per_rank"]] for k in r}
    hf0, tp0, pp = rank("hf"), rank("megatron_tp1"), r["megatron_tp1_pp2"]["per_rank"]
    out += [
        f"Process CPU seconds agree for TP1 ({cpu('megatron_tp1', 'score'):.2f}x / "
        f"{cpu('megatron_tp1', 'train_step'):.2f}x); PP2 spends as much CPU as HF "
        f"({cpu('megatron_tp1_pp2', 'score'):.2f}x / {cpu('megatron_tp1_pp2', 'train_step'):.2f}x)",
        "Scores agree with the HF backend to "
        f"{sci(max(agree['logprobs_max_abs_diff'], agree['entropy_max_abs_diff']))} on response "
        f"tokens and the first step's grad norm to {sci(agree['grad_norm_rel_diff'])} (relative)",
        f"HF {peak['hf'][0]:.2f} GiB; Megatron TP1 {peak['megatron_tp1'][0]:.2f} GiB "
        f"({peak['megatron_tp1'][0] / peak['hf'][0]:.2f}x); TP1 x PP2 "
        f"{peak['megatron_tp1_pp2'][0]:.2f} GiB (rank 0) and {peak['megatron_tp1_pp2'][1]:.2f} GiB "
        f"(rank 1), {peak['megatron_tp1_pp2'][0] / peak['hf'][0]:.2f}x / "
        f"{peak['megatron_tp1_pp2'][1] / peak['hf'][0]:.2f}x of HF per rank",
        f"the megatron-core import "
        f"(+{(tp0['rss_start_bytes_median'] - hf0['rss_start_bytes_median']) / MIB:.0f} MiB at "
        "start)",
        f"({hf0['rss_built_bytes_median'] / MIB:.0f} MiB after the build against Megatron's "
        f"{tp0['rss_built_bytes_median'] / MIB:.0f} MiB)",
        f"score rise is {tp0['score_rss_rise_bytes_median'] / MIB:.0f} MiB against "
        f"{hf0['score_rss_rise_bytes_median'] / MIB:.0f} MiB and the train_step rise "
        f"{tp0['train_step_rss_rise_bytes_median'] / GIB:.2f} GiB against "
        f"{hf0['train_step_rss_rise_bytes_median'] / GIB:.2f} GiB",
        f"After a step both hold {hf0['rss_end_bytes_median'] / GIB:.1f} GiB"
        if f"{hf0['rss_end_bytes_median'] / GIB:.1f}" == f"{tp0['rss_end_bytes_median'] / GIB:.1f}"
        else "the two backends' memory after a step differs",
        f"each stage holds {pp[0]['param_bytes'] / MIB:.0f} MiB of the "
        f"{hf0['param_bytes'] / MIB:.0f} MiB of weights",
        f"and {max(p['rss_end_bytes_median'] for p in pp) / GIB:.1f} GiB after a step",
        f"({hf0['param_bytes'] / MIB:.0f} MiB in fp32)",
    ]
    r = record("bench_microbatch.json")
    m = r["methods"]
    for name, label in (
        ("fixed", "fixed, 4 rows"),
        ("budget", "budget 4096 tokens"),
        ("packed", "packed, 4096 tokens"),
    ):
        x = m[name]
        out.append(
            f"| {label} | {x['fed_tokens']:.0f} | {x['padding_share']:.1%} | "
            f"{x['micro_batches']:.0f} | {x['score_s_median']:.3f} | "
            f"{x['train_step_s_median']:.3f} | {x['grad_norm']:.5f} |"
        )
    plans, long = r["megatron_plans"], r["long_recipe_plans"]
    out.append(
        "PP 1 "
        + " -> ".join(f"{plans[f'pp1_{k}']['fed_tokens']}" for k in ("fixed", "budget", "packed"))
        + " fed tokens; PP 2 "
        + " -> ".join(f"{plans[f'pp2_{k}']['fed_tokens']}" for k in ("fixed", "budget", "packed"))
    )
    lb, lp = long["pp2_budget"]["padding_share"], long["pp2_packed"]["padding_share"]
    out.append(
        f"{long['rows']} rows of {long['real_tokens']:.0f} tokens: budget {lb:.1%}, packed {lp:.1%}"
    )
    cp = {k: max(v["alloc_peak_bytes_per_rank"]) / GIB for k, v in r["context_parallel"].items()}
    out.append(
        f"{cp['cp1']:.1f} GiB at CP 1, {cp['cp2']:.1f} GiB per rank at CP 2 (packed: "
        f"{cp['cp1_packed']:.1f} -> {cp['cp2_packed']:.1f} GiB)"
    )
    rw = {e["label"]: e["by_workers"] for e in record("bench_rewards.json")["entries"]}

    def rate(label, w):
        r = rw[label][w]
        return f"{r['step_rewards_per_s']:.0f} rewards/s for a step's calls and " + (
            f"{r['eval_rewards_per_s']:.0f} for an evaluation's"
        )

    out.append(f"trainer process) {rate('before', '0')}")
    for w in ("0", "2"):
        r = rw["after"][w]
        out.append(f"{r['step_rewards_per_s']:.0f} / {r['eval_rewards_per_s']:.0f}")
    moe = moe_ep()
    out += [
        f"bench_moe_ep.py # {moe['MINUTES']} on 2 cores",
        *(moe[k] for k in ("STEP", "SHARE", "MEMORY", "DIFF")),
    ]
    return out


def moe_ep() -> dict:
    """benchmarks/README.md's and docs/scaling.md's expert-parallelism figures, by placeholder."""
    rec = record("bench_moe_ep.json")
    s = rec["summary"]

    def step(name):
        return s[name]["rl_step_s"]

    def share(name):
        return f"{s[name]['train_step']['dispatcher_share']:.0%}"

    ep1, a2a, ag = "ep1", "ep2_alltoall", "ep2_allgather"
    return {
        "MINUTES": f"{rec['elapsed_s'] / 60:.1f} min",
        "STEP": f"an RL step takes {step(ep1):.2f} s at EP 1, {step(a2a):.2f} s "
        f"({s[a2a]['rl_step_vs_ep1']:.2f}x) at EP 2 with the all-to-all dispatcher and "
        f"{step(ag):.2f} s ({s[ag]['rl_step_vs_ep1']:.2f}x) with the all-gather one",
        "SHARE": f"the dispatcher's share of train_step {share(ep1)} / {share(a2a)} / {share(ag)}",
        "MEMORY": f"expert parameters {s[ep1]['expert_param_bytes_per_rank'] / MIB:.1f} MiB "
        f"per rank at EP 1 and {s[a2a]['expert_param_bytes_per_rank'] / MIB:.1f} MiB at EP 2, "
        f"peak RSS per rank {s[ep1]['rss_peak_bytes_per_rank'] / MIB:.0f} / "
        f"{s[a2a]['rss_peak_bytes_per_rank'] / MIB:.0f} / "
        f"{s[ag]['rss_peak_bytes_per_rank'] / MIB:.0f} MiB",
        "DIFF": "bit for bit"
        if max(s[n]["logprob_max_abs_diff_vs_ep1"] for n in (a2a, ag)) == 0
        else "max |difference| " + sci(max(s[n]["logprob_max_abs_diff_vs_ep1"] for n in (a2a, ag))),
    }


def _overlap(rec: dict) -> str:
    """One record of bench_async_overlap as the README words it: seconds a step at k = 1 and
    k = 0, the speed-up by seed, where the time went and the held-out reward at steps 10 / 20 /
    30 (means over the seeds where there are several)."""
    runs = rec["runs"]
    arms = {k: [r for r in runs if r["max_staleness"] == k] for k in (0, 1)}
    n = len(arms[0])

    def mean(k, f):
        return sum(f(r) for r in arms[k]) / len(arms[k])

    step = {k: mean(k, lambda r: 1 / r["steps_per_s"]) for k in (0, 1)}
    ev = {
        k: [mean(k, lambda r, s=s: r["eval_reward"][s]) for s in ("10", "20", "30")] for k in (0, 1)
    }
    speed = ", ".join(f"{x:.2f}x" for x in rec["speedup_by_seed"])
    return (
        f"{step[1]:.1f} s a step against {step[0]:.1f} s "
        f"({speed} the steps per second{' by seed' if n > 1 else ''}; generation "
        f"{mean(0, lambda r: r['generation_s']):.1f} -> {mean(1, lambda r: r['generation_s']):.1f}"
        f" s, update {mean(0, lambda r: r['training_s']):.1f} -> "
        f"{mean(1, lambda r: r['training_s']):.1f} s, "
        f"{mean(1, lambda r: r['overlap_share']):.0%} of generation overlapped, a wait of "
        f"{mean(1, lambda r: r['wait_for_rollouts_s']):.1f} s), held-out reward at steps 10 / 20 "
        f"/ 30 {' / '.join(f'{x:.3f}' for x in ev[0])} at k = 0 and "
        f"{' / '.join(f'{x:.3f}' for x in ev[1])} at k = 1"
        + (f" (means over {n} seeds)" if n > 1 else "")
    )


def async_overlap_vllm() -> str:
    """README's sentence on the vLLM record of overlapped generation."""
    return _overlap(record("bench_async_overlap_vllm.json"))


def async_overlap() -> str:
    """README's sentence on the seeded sampler's record of overlapped generation."""
    return _overlap(record("bench_async_overlap.json"))
