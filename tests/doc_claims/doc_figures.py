"""docs/scaling.md's and docs/evidence.md's measured figures outside the evidence runs, and the
figures the docs take from the code or from a test's assertion: rendered here from the
committed records (``benchmarks/results/bench_*.json``), the constants of the module that
uses them, or the assertion that makes them true, so the text cannot drift from them
(``doc_numbers.claims`` adds these; ``tests/test_doc_numbers.py`` checks each occurs).
"""

from __future__ import annotations

import json
from typing import List, Tuple

from doc_figures_bench import async_overlap, async_overlap_vllm, benchmarks_readme, moe_ep
from doc_records import GB, GIB, MIB, REPO, asserted, median, record, results

SCALING, EVIDENCE_DOC, README = "docs/scaling.md", "docs/evidence.md", "README.md"


def readme_selfcheck() -> List[str]:
    """The self-check's CPU form: the checks that run without CUDA (vLLM's only where vLLM is
    installed), counted from the registry the command runs."""
    from nemo_d3s.selfcheck.cli import all_checks

    cpu = [c for c in all_checks() if not c.needs_cuda]
    plain = [c for c in cpu if not c.name.startswith("vllm.")]
    assert len(cpu) - len(plain) == 1, [c.name for c in cpu]
    article = "an" if str(len(cpu)).startswith(("8", "11", "18")) else "a"
    return [
        f"({len(plain)} checks pass here",
        f"{article} {len(cpu)}th, vLLM's shared-memory refit",
    ]


def gpu_h200() -> List[Tuple[str, str]]:
    """The first GPU run's figures (README, benchmarks/README.md), from its records."""
    from doc_records import record

    sc = record("gpu_h200/selfcheck_one_gpu.json")["checks"]
    count = {k: sum(r["status"] == k for r in sc) for k in ("passed", "failed", "not run")}
    te = [r["name"] for r in sc if r["status"] == "failed" and "Transformer Engine" in r["reason"]]
    assert len(te) == count["failed"], te  # every failure of that run was the missing TE
    mem = next(r["measured"] for r in sc if r["name"] == "gpu.peak_memory")
    ent = record("gpu_h200/entropy_cuda.json")
    r = ent["results"]
    c, p = r["chunked"], r["plain"]
    bench = "benchmarks/README.md"
    s2 = record("gpu_h200/session2/summary.json")
    sc2 = s2["selfcheck"]
    k1 = [s2["smoke_k1_cuda"][b] for b in ("hf", "meg")]
    assert all(run["second_run_differing_values"] == 0 for run in k1)
    assert all(run["rollout_staleness"][1:] == [1.0] * (run["steps"] - 1) for run in k1)
    assert s2["moe_megatron_cuda_ep1"]["alltoall_vs_allgather_differing_values"] == 0
    return [
        (README, f"self-check again ({sc2['passed']} passed, the same {sc2['failed']} Transformer"),
        (README, f"Engine failures, {sc2['not run']} not run)"),
        (README, f"({count['passed']} passed; the {count['failed']} Transformer Engine"),
        (README, f"checks failed for the missing library; {count['not run']} need 2+ GPUs"),
        (README, f"({mem['measured_gib']:.2f} GiB measured, {mem['predicted_gib']:.2f} planned)"),
        (
            bench,
            f"chunked {c['seconds_fwd_bwd'] * 1e3:.1f} ms and {c['peak_gib_above_logits']:.2f} GiB",
        ),
        (bench, f"above the {ent['logits_gib']:.2f} GiB of"),
        (
            bench,
            f"plain {p['seconds_fwd_bwd'] * 1e3:.1f} ms and {p['peak_gib_above_logits']:.1f} GiB",
        ),
        (bench, f"{c['seconds_fwd_bwd'] / p['seconds_fwd_bwd']:.1f}x the time"),
        (bench, f"{p['peak_gib_above_logits'] / c['peak_gib_above_logits']:.0f}x less memory"),
    ]


def _span(spec: str) -> Tuple[str, str]:
    """ ">=2.13,<2.16" -> ("2.13", "2.15"): a range of minor releases as the text reads it."""
    lo, hi = (p.lstrip("<>=") for p in spec.split(","))
    major, minor = hi.split(".")[:2]
    return lo, f"{major}.{int(minor) - 1}"


def readme_stack() -> List[str]:
    """The tested versions (``nemo_d3s/versions.py``), the recipes and the dry run's GPU."""
    import yaml

    from nemo_d3s.versions import TESTED

    torch, vllm, trl = (_span(TESTED[k]) for k in ("torch", "vllm", "trl"))
    assert trl[0] == trl[1]
    gpu = yaml.safe_load((REPO / "conf" / "trainer" / "default.yaml").read_text())
    recipes = sorted(
        p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml") if "nodes:" in p.read_text()
    )
    words = {6: "six", 7: "seven", 8: "eight", 5: "five", 9: "nine"}
    listed = (
        "nine recipes (`experiment=llama3_8b | qwen25_math_7b | llama3_70b | llama3_70b_long | "
    )
    listed += "llama3_70b_32k | qwen25_72b | qwen3_32b | qwen3_30b_a3b | qwen3_235b_a22b`)"
    names = sorted(listed.split("=", 1)[1].rstrip("`)").split(" | "))
    return [
        listed if names == recipes and words.get(len(recipes)) == "nine" else f"recipes {recipes}",
        f"Which versions: torch {torch[0]} to {torch[1]};",
        f"vLLM {vllm[0]} to {vllm[1]}.",
        f"tested on trl {trl[0]},",
        f"per-GPU memory against {gpu['gpu_memory_gb']} GB",
        f"`trainer.reward_timeout_s` (default {gpu['reward_timeout_s']} s)",
        "a step `logging.slow_step_factor`={:g} times".format(
            yaml.safe_load((REPO / "conf" / "logging" / "default.yaml").read_text())[
                "slow_step_factor"
            ]
        ),
    ]


def vllm_rollouts() -> List[str]:
    """``python benchmarks/bench_vllm_rollouts.py``: its table's tokens/s (response tokens over
    the median time), the speed-up, the trainer's step on each engine and the engine's costs."""
    d = record("bench_vllm_rollouts.json")
    g, tr = d["generation"], d["training"]
    tps = {
        k: g["response_tokens"][k] / median(g["times_s"][k])
        for k in ("seeded_batched", "vllm_float32")
    }
    return [
        f"| seeded sampler (`rollout=hf`) | {tps['seeded_batched']:.0f} | "
        f"{tr['hf']['time_step_s']:.1f} s | {tr['hf']['rollout_share']:.0%} |",
        f"| vLLM (`rollout=vllm`) | {tps['vllm_float32']:.0f} ({d['speedup']:.2f}x) | "
        f"{tr['vllm']['time_step_s']:.1f} s | {tr['vllm']['rollout_share']:.0%} |",
        f"Engine start {g['engine_start_s']:.0f} s, weight refit "
        f"{tr['vllm']['time_weight_sync_s']:.1f} s per step",
    ]


def megatron_cpu() -> List[str]:
    """``python benchmarks/bench_megatron_cpu.py``: the HF / Megatron layouts' table."""
    r = record("bench_megatron_cpu.json")["results"]
    hf = r["hf"]

    def t(x, call):
        return x[call]["wall_s_median"]

    def ratio(x, call):
        return f"{t(x, call):.2f} s ({t(x, call) / t(hf, call):.2f}x)"

    def rss(x):
        return [p["rss_peak_bytes_median"] / GIB for p in x["per_rank"]]

    tp1, pp2 = r["megatron_tp1"], r["megatron_tp1_pp2"]
    return [
        f"| HF backend, 1 process | {t(hf, 'score'):.2f} s | {t(hf, 'train_step'):.2f} s | "
        f"{rss(hf)[0]:.2f} GiB |",
        f"| Megatron TP1, 1 process | {ratio(tp1, 'score')} | {ratio(tp1, 'train_step')} | "
        f"{rss(tp1)[0]:.2f} GiB ({rss(tp1)[0] / rss(hf)[0]:.2f}x:",
        f"| Megatron TP1 x PP2, 2 gloo ranks | {ratio(pp2, 'score')} | "
        f"{ratio(pp2, 'train_step')} | " + " / ".join(f"{x:.2f}" for x in rss(pp2)) + " GiB |",
        f"on SmolLM2 ({hf['per_rank'][0]['param_bytes'] / 1e6:.0f} MB fp32)",
    ]


def microbatch() -> List[str]:
    r = record("bench_microbatch.json")
    m, plans, long = r["methods"], r["megatron_plans"], r["long_recipe_plans"]
    cp = {k: max(v["alloc_peak_bytes_per_rank"]) / GIB for k, v in r["context_parallel"].items()}
    return [
        f"padding {m['fixed']['padding_share']:.0%} -> {m['budget']['padding_share']:.0%} on a "
        "long-tailed mix",
        f"packed rows pad {m['packed']['padding_share']:.0%} of the HF backend's update and "
        f"{plans['pp2_packed']['padding_share']:.1%} of the Megatron backend's (widths "
        f"multiples of 128, against {plans['pp2_budget']['padding_share']:.1%} with token "
        "budgets)",
        f"{long['pp2_packed']['padding_share']:.1%} at the long-response recipe's scale",
        f"context parallelism 2 holds {cp['cp2']:.1f} GiB per rank where CP 1 holds "
        f"{cp['cp1']:.1f} GiB",
    ]


def readme_packing() -> List[str]:
    """The README's figures of packed sequences and context parallelism."""
    r = record("bench_microbatch.json")
    m, plans = r["methods"], r["megatron_plans"]
    cp = {k: max(v["alloc_peak_bytes_per_rank"]) / GIB for k, v in r["context_parallel"].items()}
    return [
        # the Megatron backend's token budgets -> packs, then the HF backend's (exact widths)
        f"padding {plans['pp2_budget']['padding_share']:.1%} -> "
        f"{plans['pp2_packed']['padding_share']:.1%} of its tokens (token budgets to packs; the "
        f"HF backend's {m['budget']['padding_share']:.0%} -> {m['packed']['padding_share']:.0%})",
        f"{cp['cp1']:.1f} GiB -> {cp['cp2']:.1f} GiB",
    ]


def dry_run_constants() -> List[str]:
    """The memory model's assumptions as the module states them."""
    from nemo_d3s.backends.vllm.memory import (
        CUDA_GRAPH_BYTES,
        VLLM_COMM_BYTES,
        VLLM_CONTEXT_BYTES,
    )
    from nemo_d3s.dry_run import memory as m

    mib80 = m.PHYSICAL_MIB[80.0]
    per_comm = 2 * m.NCCL_CHANNELS * m.NCCL_BUFFSIZE
    return [
        f"(assumed {m.CUDA_CONTEXT_BYTES / GB:.1f} GB), its NCCL communicators' buffers "
        f"({per_comm / MIB:.0f} MiB each: 2 receive buffers of NCCL's default "
        f"{m.NCCL_BUFFSIZE / MIB:.0f} MiB `NCCL_BUFFSIZE` per channel, {m.NCCL_CHANNELS} "
        "channels assumed",
        f"(assumed {m.FRAGMENTATION_SHARE:.0%} of the step's activations and logits)",
        f"H100 has {mib80:,} MiB = {mib80 * MIB / GB:.2f} GB",
        "(assumed {:.1f} GB: CUDA context, TP communicator, CUDA graphs)".format(
            (VLLM_CONTEXT_BYTES + VLLM_COMM_BYTES + CUDA_GRAPH_BYTES) / GB
        ),
    ]


def scaling_asserted() -> List[str]:
    dry = "tests/test_dry_run.py"
    counts = {
        "Llama-3.3-70B": "70_553_706_496",
        "Llama-3.1-8B": "8_030_261_248",
        "Qwen2.5-Math-7B": "7_615_616_512",
        "Qwen2.5-72B": "72_706_203_648",
        "Qwen3-32B": "32_762_123_264",
    }
    out = [
        asserted(
            "tests/trainer/test_megatron_run.py",
            "assert size < 20e6",
            "experiment=megatron_smoke output_dir=runs/msmoke  # tiny model, TP2, < 20 MB",
        ),
        asserted(
            "tests/convert/test_memory.py",
            "assert convert - baseline < 0.6 * model_bytes",
            "stays under 0.6x the model above the bare import",
        ),
        asserted(
            dry,
            '"problem: the training state alone needs 436.6 GB per GPU"',
            '"the training state alone needs 436.6 GB per GPU", largest term grads',
        ),
        asserted(dry, 'round(no_sp["worst"]["peak_bytes"] / GB, 1) == 96.1', "says 96.1 GB"),
    ]
    for name, n in counts.items():
        out.append(asserted(dry, n, f"{name} {int(n.replace('_', '')):,}"))
    return out


def parallel_pieces() -> List[str]:
    """docs/evidence.md "Measured: the parallel pieces": one result per benchmark record."""
    ent = {
        (r["tp"], r["method"]): r
        for r in record("bench_vocab_parallel_entropy.json")["results"]
        if r["dtype"] == "fp32" and r["mode"] == "fwd"
    }

    def mem(tp, method):
        return ent[(tp, method)]["torch_alloc_peak_bytes"]

    def fwd(tp):
        return ent[(tp, "gather_core")]["time_s_median"] / ent[(tp, "fused")]["time_s_median"]

    naive = mem(2, "gather_naive")
    assert naive == mem(4, "gather_naive") and mem(2, "gather_core") == mem(4, "gather_core")
    topk = {
        r["method"]: r for r in record("bench_global_topk.json")["results"] if r["n_total"] == 2**25
    }
    sel = record("bench_selection_overhead.json")["layouts"]

    def overhead(layout):
        s = sel[layout]["summary"]
        ms = s["selection"]["ms_median"] + s["rebalancing"]["ms_median"]
        share = s["selection"]["share_median"] + s["rebalancing"]["share_median"]
        return ms, share, s["step_s_median"]

    (ms2, sh2, step2), (ms4, sh4, _) = overhead("TP2xDP1"), overhead("TP2xDP2")
    steps = sel["TP2xDP2"]["steps"]
    gen = record("bench_batched_generation.json")["times_s"]
    batched, per_prompt = median(gen["seeded_batched"]), median(gen["hf_generate_per_prompt"])
    return [
        f"extra memory per rank {mem(2, 'fused') / MIB:.0f} MiB (TP2) / "
        f"{mem(4, 'fused') / MIB:.0f} MiB (TP4) vs {mem(2, 'gather_core') / MIB:.0f} MiB gathered "
        f"+ the same kernel ({mem(2, 'gather_core') / mem(2, 'fused'):.0f}x / "
        f"{mem(4, 'gather_core') / mem(4, 'fused'):.0f}x less) and {naive / GIB:.1f} GiB gathered "
        f"+ `log_softmax` ({naive / mem(2, 'fused'):.0f}x / {naive / mem(4, 'fused'):.0f}x); "
        f"forward {fwd(2):.1f}x (TP2) / {fwd(4):.1f}x (TP4) faster",
        f"{topk['radix8']['bytes_received_counted'] / 1024:.0f} KiB moved per rank at any size "
        f"vs {topk['gather_sort']['bytes_received_counted'] / MIB:.0f} MiB gathered at "
        f"{2**25 / 1e6:.1f}M scores; {topk['radix8']['time_s_median']:.1f} s vs "
        f"{topk['gather_quantile']['time_s_median']:.1f} s (gather + kthvalue; `torch.quantile` "
        f"refuses > 2^24 elements) vs {topk['gather_sort']['time_s_median']:.0f} s (gather + sort)",
        f"TP2: {ms2:.1f} ms of a {step2:.1f} s step ({sh2:.2%}); TP2xDP2: {ms4:.0f} ms "
        f"({sh4:.2%}); token imbalance across DP ranks "
        f"{median([s['imbalance_before'] for s in steps]):.2f} -> "
        f"{median([s['imbalance_after'] for s in steps]):.2f} after rebalancing",
        f"one batched call with per-prompt seeds {batched:.1f} s vs {per_prompt:.1f} s for "
        f"`model.generate` once per prompt ({per_prompt / batched:.1f}x)",
    ]


def design_choices() -> List[str]:
    """docs/design-choices.md's preset table (``core.presets.PRESETS``) and the D3S-I collapse
    (the ``d3s_i_tiebreak_m0`` evidence run)."""
    from fractions import Fraction

    from nemo_d3s.core.presets import PRESETS

    def g(x):
        return f"G/{Fraction(x).limit_denominator(64).denominator}"

    out = []
    for name in ("pods", "d1s", "d1s_cross"):
        sch = PRESETS[name].schedule
        assert sch.n_init == sch.n_final and sch.k_init == 1.0
        out.append(f"| N = {g(sch.n_init)}" + (" |" if name != "pods" else " (loss:"))
    d2 = PRESETS["d2s"].schedule
    out.append(f"| N = {g(d2.n_init)}, K = {d2.k_init:.0%} |")
    for name in ("d3s", "d3s_i"):
        out.append(f"top K by \\|A\\| x H, at least {PRESETS[name].min_kept_tokens} a step |")
    d3 = PRESETS["d3s"].schedule
    out.append(
        f"| {d3.kind} N {g(d3.n_init)} -> {g(d3.n_final)}, K {d3.k_init:.0%} -> {d3.k_final:.0%} |"
    )
    curve = [
        json.loads(line)
        for line in (results() / "evidence" / "runs" / "d3s_i_tiebreak_m0_s0" / "eval.jsonl")
        .read_text()
        .splitlines()
    ]
    out.append(
        f"(eval {curve[0]['eval_reward_mean']:.2f} -> {curve[1]['eval_reward_mean']:.2f} in "
        f"{curve[1]['step']} steps, `evidence.md`)"
    )
    return out


def reward_check() -> List[str]:
    """README "Use your own model, data and reward": the few-step run of a custom reward on
    SmolLM2 (``benchmarks/results/reward_check/``: the command, its config, metrics and the
    machine), its table row by row."""
    rec = results() / "reward_check"
    # The README's command is the recorded one but for where it writes and the progress bar
    # (the record's run logged to a file), which change no number.
    command = " ".join(
        w
        for w in (rec / "command.txt").read_text().split()
        if not w.startswith(("output_dir=", "logging.progress_bar="))
    )
    rows = [json.loads(x) for x in (rec / "metrics.jsonl").read_text().splitlines() if x.strip()]
    machine = json.loads((rec / "machine.json").read_text())
    import yaml

    cfg = yaml.safe_load((rec / "config.yaml").read_text())["trainer"]
    out = [
        command,
        f"per step of {cfg['prompts_per_step']} prompts x {cfg['num_generations']} rollouts",
        f"(a 135M model, {cfg['max_new_tokens']} new tokens)",
    ]
    for r in rows:
        update = "skipped" if r["skipped"] else f"{r['update_tokens']:.0f} tokens"
        out.append(
            f"| {r['step']} | {r['reward_mean']:.3f} | {r['reward_max']:.1f} | "
            f"{r['n_informative_groups']:.0f} of {r['n_prompts']:.0f} | {update} |"
        )
    ev = json.loads((rec / "eval.jsonl").read_text().splitlines()[-1])
    out.append(
        f"the greedy evaluation after step {ev['step']} scored {ev['eval_reward_mean']:.3f} on the "
        f"{ev['eval_n']} held-out rows"
    )
    times = sorted(r["time_step"] for r in rows)
    load = machine["load_average_1min_seen"].values()
    out.append(
        f"{times[0] / 60:.0f}-{times[-1] / 60:.0f} min a step on {machine['cpu_count']} cores "
        f"under a load average of {min(load):.0f}-{max(load):.0f}"
    )
    return out


def defaults() -> List[Tuple[str, str]]:
    """Defaults and constants the docs quote: the schema's, a recipe's, the exit code's."""
    import yaml

    from nemo_d3s.config_schema import TaskConfig, TrainerConfig
    from nemo_d3s.train import EXIT_INTERRUPTED
    from nemo_d3s.trainer.records import CONSTANT_REWARD_STEPS

    tr, task = TrainerConfig(), TaskConfig()
    long = yaml.safe_load((REPO / "conf" / "experiment" / "llama3_70b_long.yaml").read_text())
    t = long["trainer"]
    faults = "docs/faults.md"
    n = CONSTANT_REWARD_STEPS
    return [
        (faults, f"`trainer.dist_timeout_minutes` (default {tr.dist_timeout_minutes:g})"),
        (faults, f"`trainer.max_failed_reward_steps` (default {tr.max_failed_reward_steps})"),
        (faults, f"after {n} such steps one warning: `every rollout of the last {n} steps"),
        (faults, f"`task.max_eval_size` ({task.max_eval_size:,}; raise it if meant)"),
        (README, f'exit with code **{EXIT_INTERRUPTED}** ("interrupted"'),
        (
            README,
            asserted(
                ".ci/run",
                "install -q torch==2.15.0 megatron-core==0.19.2",
                "Python 3.12 (torch 2.15.0 from PyPI, megatron-core 0.19.2)",
            ),
        ),
        (
            README,
            asserted(
                ".ci/run",
                'pip install -q torch==2.13.0 && pip install -q -e ".[test]"',
                "CI runs the default suite on Python 3.11 (torch 2.13.0,",
            ),
        ),
        (
            SCALING,
            f"(prompts up to {long['task']['max_prompt_tokens']} tokens, responses up to "
            f"{t['max_new_tokens']}; its file reasons the layout): without sequence "
            f"parallelism the same {t['micro_batch_tokens']}-token",
        ),
        (
            SCALING,
            f"rows of {long['rollout']['max_model_len']} tokens | TP4 PP4 DP4 SP (tp-pp-dp "
            f"order), vLLM TP8, {t['micro_batch_tokens']}-token micro-batches",
        ),
    ]


def claims() -> List[Tuple[str, str]]:
    out: List[Tuple[str, str]] = [(README, text) for text in readme_stack()]
    out += [(README, text) for text in reward_check()]
    out += [(README, text) for text in readme_packing()]
    for fn in (vllm_rollouts, megatron_cpu, microbatch, dry_run_constants, scaling_asserted):
        out += [(SCALING, text) for text in fn()]
    out += [(EVIDENCE_DOC, text) for text in parallel_pieces()]
    out += defaults()
    out += [("docs/design-choices.md", text) for text in design_choices()]
    out += [("benchmarks/README.md", text) for text in benchmarks_readme()]
    out += [(SCALING, moe_ep()["STEP"]), (README, moe_ep()["STEP"]), (README, async_overlap())]
    out += [(README, async_overlap_vllm())]
    out += gpu_h200()
    arch = "docs/architecture.md"
    out.append(
        (arch, asserted("tests/test_architecture.py", "MAX_LINES = 455", "longer than 455 lines"))
    )
    trl = _span(__import__("nemo_d3s.versions").versions.TESTED["trl"])[0]
    out.append((arch, f"trl {trl} only"))
    return out
