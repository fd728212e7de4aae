"""Every figure the README and docs/ quote from a run, rendered from the committed
records, so the text cannot drift from them (``tests/test_doc_numbers.py`` checks that each
rendered line occurs in its document).

    python tests/doc_claims/doc_numbers.py    # print each claim and whether its document has it

Records read (all committed under ``benchmarks/results/``):

- ``cpu_default/main_job.json`` (``record_main_job.py summarize`` of the 30-step main job's
  records beside it) and ``cpu_default/memory_disk.json`` (``record_main_job.py run`` of a
  2-step run of the same job: peak memory and the size of a checkpoint and of the export);
- ``evidence/table.json`` and ``evidence/timing/table.json`` (``compare_presets.py``'s
  summaries) and ``evidence/runs/*/`` (per-run metrics and evals), re-read here with
  ``compare_presets.load_run`` / ``paired_difference`` / ``mean_ci``, the functions that
  wrote the tables;
- ``reward_check/`` (the README's few-step run of a custom reward on SmolLM2) and the
  ``bench_*.json`` records, the code's constants and the tests' assertions behind the other
  documents' figures: ``doc_figures.py``.
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from pathlib import Path
from typing import Dict, List, Tuple

import doc_figures
from doc_figures import readme_selfcheck
from doc_records import BENCHMARKS, REPO, asserted, results

sys.path.insert(0, str(BENCHMARKS))  # the evidence harness wrote the tables: its reader
from compare_presets import load_run, mean_ci, paired_difference  # noqa: E402

README, EVIDENCE_DOC = "README.md", "docs/evidence.md"

# The main table's rows, in the document's order.
VARIANTS = (
    "grpo",
    "d3s",
    "d3s_i",
    "gspo_d3s",
    "d3s_m0",
    "d3s_i_m0",
    "gspo_d3s_m0",
    "d3s_m128",
    "d3s_paper_m0",
    "d3s_eligible_m0",
    "d2s",
    "d1s",
    "d1s_cross",
    "pods",
    "grpo_m2",
    "d3s_i_tiebreak_m0",
)
PER_SEED = ("grpo", "d3s", "d3s_m0", "d1s_cross", "pods", "grpo_m2")


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _runs(name: str, seeds=range(5)) -> List[dict]:
    return [
        {**load_run(results() / "evidence" / "runs" / f"{name}_s{s}"), "seed": s}
        for s in seeds
        if (results() / "evidence" / "runs" / f"{name}_s{s}" / "summary.json").is_file()
    ]


def _pm(mc, digits=3, sign=False) -> str:
    m, h = mc
    head = f"{m:+.{digits}f}" if sign else f"{m:.{digits}f}"
    return head if h != h else f"{head} ± {h:.{digits}f}"


def _k(x: float) -> str:
    return f"{x / 1000:.1f}k"


def main_table_rows(table: dict) -> List[str]:
    out = []
    for name in VARIANTS:
        v = table["variants"][name]
        n = v["seeds"]
        diff = v["eval_final_minus_reference"]
        if name == table["reference"]:
            paired = "—"
        elif diff["pairs"] == 1:
            paired = f"{diff['mean']:+.3f} (1 pair)"
        else:
            paired = _pm((diff["mean"], diff["half_width"]), sign=True)
        out.append(
            " | ".join(
                [
                    f"| `{name}`",
                    str(n),
                    _pm(v["eval_final"]),
                    paired,
                    f"{v['kept_sample_ratio'][0]:.2f}",
                    f"{v['kept_token_ratio'][0]:.2f}",
                    _k(v["update_tokens_total"][0]),
                    f"{v['grad_norm_vs_reference']:.1f}",
                    f"{v['generation_share'][0]:.2f}",
                    f"{v['time_to_threshold']['reached']} of {n} |",
                ]
            )
        )
    return out


def per_seed_lines() -> List[str]:
    out = []
    for name in PER_SEED:
        seeds = []
        for r in _runs(name):
            seeds.append(f"s{r['seed']} " + "/".join(f"{p['eval']:.2f}" for p in r["curve"]))
        out.append(f"- `{name}`: " + "; ".join(seeds))
    return out


def floor_lift() -> str:
    """Each floored variant minus its own floor-0 twin, same seed."""
    parts = []
    for name in ("d3s", "d3s_i", "gspo_d3s"):
        d = paired_difference(_runs(name, range(3)), _runs(f"{name}_m0", range(3)))
        parts.append(f"{name} {_pm((d['mean'], d['half_width']), sign=True)}")
    return ", ".join(parts)


def eligible_range() -> Tuple[int, int, int, int]:
    """d3s (5 seeds), updates from step 5 on: (least, most eligible tokens of the kept
    rollouts, updates where the floor of 256 was what K came to, all updates)."""
    rows = []
    for s in range(5):
        for line in (
            (results() / "evidence" / "runs" / f"d3s_s{s}" / "metrics.jsonl")
            .read_text()
            .splitlines()
        ):
            r = json.loads(line)
            if not r.get("skipped"):
                rows.append(r)
    later = [r["n_eligible_tokens"] for r in rows if r["step"] >= 5]
    floored = sum(r["n_kept_tokens"] == 256 < r["n_eligible_tokens"] for r in rows)
    return int(min(later)), int(max(later)), floored, len(rows)


def _yaml(path: Path) -> dict:
    import yaml  # PyYAML, a dependency of omegaconf

    return yaml.safe_load(path.read_text())


def _rows(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _frac(x: float) -> str:
    return str(Fraction(x).limit_denominator(64))


def _mmss(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60:02d}:{s % 60:02d}"


def _minus(x: float, digits: int = 3) -> str:
    """A signed number as the prose writes it (U+2212 for a minus)."""
    return f"{x:+.{digits}f}".replace("-", "\u2212")


def readme_main_job() -> List[str]:
    """The main job's settings, duration, progress-bar example and eval line: its record folder
    (``cpu_default/``: config.yaml, metrics.jsonl, eval.jsonl, summary.json)."""
    rec = results() / "cpu_default"
    cfg, summary = _yaml(rec / "config.yaml"), _json(rec / "summary.json")
    mem = _json(rec / "memory_disk.json")
    t, sch = cfg["trainer"], cfg["d3s"]["schedule"]
    evals = _rows(rec / "eval.jsonl")
    rows = {r["step"]: r for r in _rows(rec / "metrics.jsonl")}
    out = [
        f"{t['steps']} steps of {t['prompts_per_step']} prompts x {t['num_generations']} rollouts "
        f"(up to {t['max_new_tokens']} new tokens, temperature {t['temperature']})",
        f"D3S keeps {_frac(sch['n_init'])} -> {_frac(sch['n_final'])} of the rollouts and, "
        f"within them, {sch['k_init']:.0%} -> {sch['k_final']:.0%} of the tokens (at least "
        f"{cfg['d3s']['min_kept_tokens']} a step); greedy evaluation on {cfg['task']['eval_size']} "
        "held-out problems at steps " + ", ".join(str(e["step"]) for e in evals),
        f"about {summary['wall_time'] / 60:.0f} minutes with start-up",
        f"a {mem['steps']}-step run of the same job with its first evaluation and one checkpoint",
        f"run keeps `trainer.keep_last={t['keep_last']}` checkpoints (every "
        f"`trainer.save_every={t['save_every']}` steps)",
        f"mean reward of this step's {t['prompts_per_step'] * t['num_generations']} sampled "
        "rollouts",
        f"(the same files as the export) takes {mem['disk_bytes']['hf_export'] / 1e9:.1f} GB more",
    ]
    # The progress bar at step 11: its clock starts with step 1 (the wall time of step 1 less
    # that step's own time) and stands still during every evaluation (Logger.clock_paused), so
    # the evaluation after step 10 is taken out.
    n, total = 11, t["steps"]
    start = rows[1]["wall_time"] - rows[1]["time_step"]
    paused = sum(e["time_eval"] for e in evals if 1 <= e["step"] < n)
    elapsed = rows[n]["wall_time"] - start - paused
    rate = elapsed / n
    r = rows[n]
    out.append(
        f"{n}/{total} [{_mmss(elapsed)}<{_mmss(rate * (total - n))}, {rate:.1f}s/step, "
        f"reward={r['reward_mean']:.3f}, smp={r['kept_sample_ratio']:.2f}, "
        f"tok={r['kept_token_ratio']:.2f}]"
    )
    e10 = next(e for e in evals if e["step"] == 10)
    out.append(
        f"eval step 10: reward {e10['eval_reward_mean']:.4f} over {e10['eval_n']} problems in "
        f"{e10['time_eval']:.1f} s"
    )
    return out


def readme_evidence_setting() -> List[str]:
    """The headline's and "Does D3S help here?"'s setting: the evidence runs' config and table."""
    table = _json(results() / "evidence" / "table.json")
    tv = _json(results() / "evidence" / "timing" / "table.json")["variants"]
    cfg = _yaml(results() / "evidence" / "runs" / "d3s_s0" / "config.yaml")
    seeds = [v["seeds"] for v in table["variants"].values() if v["seeds"] > 1]
    v = table["variants"]
    return [
        f"{cfg['trainer']['steps']} steps, {min(seeds)}-{max(seeds)} seeds",
        f"D3S with a floor of {cfg['d3s']['min_kept_tokens']} kept tokens a step matches GRPO's",
        f"its updates carry "
        f"{v['d3s']['update_tokens_total'][0] / v['grpo']['update_tokens_total'][0]:.0%} of "
        f"GRPO's tokens, and a D3S step costs about "
        f"{tv['d3s']['step_time'][0] / tv['grpo']['step_time'][0]:.2f} of a GRPO step",
        f"With its floor of {cfg['d3s']['min_kept_tokens']} kept tokens a step, D3S ends level",
        f"at the papers' K of {cfg['d3s']['schedule']['k_init']:.0%} of a small batch (about "
        f"{_token_signal()['summary']['pipeline:d3s']['0.0']['tokens_mean']:.0f} tokens)",
    ]


def _token_signal() -> dict:
    return _json(results() / "bench_token_signal.json")


def evidence_prose() -> List[str]:
    """docs/evidence.md's set-up, timing table and "What this shows", from the records."""
    table = _json(results() / "evidence" / "table.json")
    v = table["variants"]
    timing = _json(results() / "evidence" / "timing" / "table.json")
    tv = timing["variants"]
    mem = _json(results() / "cpu_default" / "memory_disk.json")
    cfg = _yaml(results() / "evidence" / "runs" / "d3s_s0" / "config.yaml")
    t = cfg["trainer"]
    sig = _token_signal()
    ss = sig["summary"]
    base = _runs("grpo")[0]["curve"][0]["eval"]
    n_eval = cfg["task"]["eval_size"]
    out = [
        f"scores {base:.2f} greedy on the {n_eval} held-out problems, standard error about "
        f"{(base * (1 - base) / n_eval) ** 0.5:.2f}), {t['steps']} steps of "
        f"{t['prompts_per_step']} prompts x {t['num_generations']} rollouts, eval every "
        f"{t['eval_every']} steps",
        f"({mem['disk_bytes']['one_checkpoint'] / 1e9:.1f} GB each here, with the optimizer "
        f"state) and a Hugging Face export ({mem['disk_bytes']['hf_export'] / 1e9:.1f} GB), "
        "about {:.1f} GB a run".format(
            (t["keep_last"] * mem["disk_bytes"]["one_checkpoint"] + mem["disk_bytes"]["hf_export"])
            / 1e9
        ),
        f"99% of GRPO's best mean ({table['threshold']:.3f})",
    ]

    def own(name, s):
        rows = _rows(results() / "evidence" / "runs" / f"{name}_s{s}" / "metrics.jsonl")
        return sum(r["time_step"] for r in rows)

    for name in ("grpo", "d3s", "d1s_cross"):
        x = tv[name]
        runs = _runs(name, (3, 4))
        ttt = x["time_to_threshold"]
        sp = ttt["speedup_vs_reference"]
        if name == timing["reference"]:
            sooner = f"{sp['ratio']:.2f}x"
        elif ttt["reached"] == 1:
            sooner = f"{sp['ratio']:.1f}x (the one seed)"
        else:
            sooner = f"{sp['ratio']:.1f}x [{sp['lo']:.2f}, {sp['hi']:.2f}]"
        out.append(
            " | ".join(
                [
                    f"| `{name}`",
                    ", ".join(f"{own(name, s):.0f}" for s in (3, 4)),
                    f"{x['step_time'][0]:.0f}",
                    f"{x['generation_share'][0]:.2f}",
                    ", ".join(f"{r['curve'][-1]['eval']:.2f}" for r in runs),
                    f"{x['eval_at_equal_time'][0]:.2f}",
                    f"{ttt['reached']} of {x['seeds']}",
                    f"{sooner} |",
                ]
            )
        )
    out += [
        f"reached {timing['threshold']:.3f} (99% of GRPO's best here)",
        f"its {own('d3s', 4):.0f} s flatters it a little; seed 3, {own('d3s', 3):.0f} s, shared",
    ]
    # The token-signal tables (benchmarks/bench_token_signal.py's summary).
    ks = sig["k_fracs"]
    label = {
        "d3s": "top by \\|A\\| x H (D3S's rule)",
        "adv": "top by \\|A\\| alone",
        "entropy": "top by H alone (tokens with A != 0)",
        "random": "random (tokens with A != 0)",
    }
    for rule in sig["rules"]:
        cells = [f"{ss[rule][str(k)]['mean']:.2f}" for k in ks]
        out.append(f"| {label[rule]} | " + " | ".join(cells) + " |")
    for name, unit in (("d3s", " tokens"), ("d3s_paper", "")):
        row = [ss["pipeline:" + name][p] for p in ("0.0", "0.5", "1.0")]
        cells = [
            f"{c['mean']:.2f} ({c['tokens_mean']:.0f}{unit if i == 0 else ''})"
            for i, c in enumerate(row)
        ]
        out.append(" | ".join(cells) + " |")
    for name in ("d2s", "pods", "d1s_cross"):
        p = ss["pipeline:" + name]["0.0"]
        out.append(f"| {p['mean']:.2f} ({p['tokens_mean']:.0f}) |")
    resp = sum(b["response_tokens"] for b in sig["batches"]) / len(sig["batches"])
    d5 = ss["d3s"]["0.05"]
    out += [
        f"Means over {len(sig['batches'])} batches; the batches differ a lot (D3S's 5%: "
        f"{d5['min']:.2f} to {d5['max']:.2f})",
        f"about {ss['pipeline:d3s']['0.0']['tokens_mean']:.0f} of ~{round(resp, -2):,.0f} "
        "response tokens a step",
        f"(cosine {ss['pipeline:d3s']['0.0']['mean']:.2f} in the token-signal table)",
        f"(pre-clip norm ~{v['d3s_m0']['grad_norm_vs_reference']:.0f}x GRPO's",
        f"(kept Var(A) {v['d3s_m0']['kept_adv_var'][0]:.2f} vs {v['d3s_m0']['adv_var_all'][0]:.1f}"
        " for the batch)",
        f"(`d1s_cross`: {ss['pipeline:d1s_cross']['0.0']['mean']:.2f})",
        f"({ss['d3s']['0.05']['mean']:.2f} vs {ss['random']['0.05']['mean']:.2f} at 5%) and "
        f"than entropy alone ({ss['entropy']['0.05']['mean']:.2f})",
    ]

    # "What this shows": the inline figures repeat the tables'.
    def pm(name):
        return _pm(v[name]["eval_final"])

    def dpm(name):
        d = v[name]["eval_final_minus_reference"]
        return f"{_minus(d['mean'])} ± {d['half_width']:.3f}"

    def dpm_ascii(name):
        d = v[name]["eval_final_minus_reference"]
        return _pm((d["mean"], d["half_width"]), sign=True)

    def fin(name, seeds=range(5)):
        return mean_ci([r["curve"][-1]["eval"] for r in _runs(name, seeds)])[0]

    pods, m2 = _runs("pods"), _runs("grpo_m2")
    below = sum(a["curve"][-1]["eval"] < b["curve"][-1]["eval"] for a, b in zip(m2, pods))
    tie = _runs("d3s_i_tiebreak_m0", range(1))[0]["curve"]
    out += [
        f"Eval at step 20: grpo {pm('grpo')} ({v['grpo']['seeds']} seeds), d3s {pm('d3s')} "
        f"({dpm('d3s')} against GRPO, same seed), d3s_m0 {fin('d3s_m0'):.3f} ({dpm('d3s_m0')}, "
        "outside the interval)",
        f"A floor of 128 lands in between ({fin('d3s_m128'):.2f})",
        f"With the floor D3S updates on {_k(v['d3s']['update_tokens_total'][0])} response tokens "
        f"over {t['steps']} steps against GRPO's {_k(v['grpo']['update_tokens_total'][0])} "
        f"({v['d3s']['update_tokens_total'][0] / v['grpo']['update_tokens_total'][0]:.0%})",
        f"every token) {pm('d1s_cross')} over {v['d1s_cross']['seeds']} seeds "
        f"({dpm_ascii('d1s_cross')} against GRPO); `d1s` (the same per group) {pm('d1s')} "
        f"({dpm_ascii('d1s')})",
        f"a D3S step costs about {tv['d3s']['step_time'][0] / tv['grpo']['step_time'][0]:.2f} of a "
        f"GRPO step and a `d1s_cross` step "
        f"{tv['d1s_cross']['step_time'][0] / tv['grpo']['step_time'][0]:.2f}, so after the same "
        f"{timing['equal_time']:.0f} s of training they are at "
        f"{tv['d3s']['eval_at_equal_time'][0]:.2f} and "
        f"{tv['d1s_cross']['eval_at_equal_time'][0]:.2f} against GRPO's "
        f"{tv['grpo']['eval_at_equal_time'][0]:.2f}; `d1s_cross` reached 99% of "
        f"GRPO's best {tv['d1s_cross']['time_to_threshold']['speedup_vs_reference']['ratio']:.1f}x "
        f"sooner in both seeds, D3S "
        f"{tv['d3s']['time_to_threshold']['speedup_vs_reference']['ratio']:.1f}x sooner in one of "
        "two",
        f"ended at {pm('pods')} over {v['pods']['seeds']} seeds ({dpm('pods')} against GRPO",
        f"their advantages ({fin('d1s', range(3)):.3f}, {v['d1s']['seeds']} seeds)",
        f"(`grpo_m2`) ended at {pm('grpo_m2')}, below PODS in {below} of {len(pods)} seeds",
        f"`grpo_m2` seed fell to {min(r['curve'][-1]['eval'] for r in m2):.2f}",
        f"(`d2s`: {fin('d2s', range(3)):.3f}; `d3s_paper_m0`: {fin('d3s_paper_m0', range(3)):.3f})",
        f"gspo_d3s {fin('gspo_d3s', range(3)):.3f} with the floor, "
        f"{fin('gspo_d3s_m0', range(3)):.3f} without, against {fin('d3s', range(3)):.3f} and "
        f"{fin('d3s_m0', range(3)):.3f} on GRPO's loss (`d3s` and `d3s_m0`, the same seeds 0-2)",
        f"`d3s_eligible_m0` {fin('d3s_eligible_m0', range(3)):.3f} against `d3s_m0` "
        f"{fin('d3s_m0', range(3)):.3f}",
        f"eval {tie[1]['eval']:.2f} at steps {tie[1]['step']} and {tie[2]['step']}, recovering "
        f"to {tie[-1]['eval']:.2f} once N reached 2",
        f"`d3s_i_m0` trains normally ({fin('d3s_i_m0', range(3)):.2f}) and `d3s_i` matches GRPO "
        f"({fin('d3s_i', range(3)):.2f})",
    ]
    return out


def claims() -> List[Tuple[str, str]]:
    """(document, text it must contain), every text rendered from a record."""
    out: List[Tuple[str, str]] = []
    main = _json(results() / "cpu_default" / "main_job.json")
    mem = _json(results() / "cpu_default" / "memory_disk.json")
    table = _json(results() / "evidence" / "table.json")
    timing = _json(results() / "evidence" / "timing" / "table.json")
    sps = main["s_per_step"]
    ev = main["eval"]
    d3s_step = table["variants"]["d3s"]["step_time"][0]
    out += [
        (
            README,
            f"**{sps['median']:.0f} s per step** (median of {main['steps']}; "
            f"{sps['min']:.0f}-{sps['max']:.0f} s)",
        ),
        (README, f"{d3s_step:.0f} s per step"),
        (
            README,
            " | ".join(
                ["| eval reward (greedy, 256 problems)", *(f"{e['reward']:.2f}" for e in ev)]
            )
            + " |",
        ),
        (
            README,
            f"{main['train_seconds']:.0f} s of steps and {main['eval_seconds']:.0f} s of "
            "evaluation",
        ),
        (
            README,
            "{:.0%} rollout generation, {:.0%} update, {:.0%} the log-prob/entropy pass".format(
                main["step_time_share"]["rollout"],
                main["step_time_share"]["update"],
                main["step_time_share"]["logprob"],
            ),
        ),
        (README, f"peak memory (RSS) **{mem['peak_rss_bytes'] / 2**30:.1f} GiB**"),
        (README, f"checkpoint is {mem['disk_bytes']['one_checkpoint'] / 1e9:.1f} GB"),
        (README, f"the Hugging Face export {mem['disk_bytes']['hf_export'] / 1e9:.1f} GB"),
        (
            README,
            "export, about {:.1f} GB".format(
                (2 * mem["disk_bytes"]["one_checkpoint"] + mem["disk_bytes"]["hf_export"]) / 1e9
            ),
        ),
        (
            README,
            f"it took {mem['s_per_step']['min']:.0f}-{mem['s_per_step']['max']:.0f} s per step",
        ),
        (
            README,
            f"{main['update_tokens_total'] / 1000:.1f}k loss-carrying tokens against "
            f"{main['rollout_tokens_total'] / 1000:.0f}k generated",
        ),
    ]
    # The README's summary of the evidence.
    tvar = table["variants"]
    d3s_d, pods_d = (
        tvar["d3s"]["eval_final_minus_reference"],
        tvar["pods"]["eval_final_minus_reference"],
    )
    m0 = tvar["d3s_m0"]["eval_final_minus_reference"]["mean"]
    finals = [r["curve"][-1]["eval"] for r in _runs("d3s")]
    timing_v = _json(results() / "evidence" / "timing" / "table.json")["variants"]
    out += [
        (
            README,
            f"(same-seed difference {_pm((d3s_d['mean'], d3s_d['half_width']), sign=True)} "
            f"over {d3s_d['pairs']} seeds) on "
            f"{tvar['d3s']['update_tokens_total'][0] / tvar['grpo']['update_tokens_total'][0]:.0%} "
            "of GRPO's update tokens",
        ),
        (README, f"it trails by {-m0:.2f}"),
        (README, f"ends below GRPO ({_pm((pods_d['mean'], pods_d['half_width']), sign=True)})"),
        (
            README,
            "a D3S step costs "
            f"{timing_v['d3s']['step_time'][0] / timing_v['grpo']['step_time'][0]:.2f} of "
            "a GRPO step",
        ),
        (README, f"D3S's eval at step 20 spans {min(finals):.2f}-{max(finals):.2f}"),
    ]
    out += [(README, text) for text in readme_main_job()]
    out += [(README, text) for text in readme_evidence_setting()]
    out += [(README, text) for text in readme_selfcheck()]
    out.append(
        (
            README,
            asserted(
                "tests/trainer/test_megatron_run.py",
                "assert size < 20e6",
                "the run stays under 20 MB on disk",
            ),
        )
    )
    out += [(EVIDENCE_DOC, text) for text in evidence_prose()]
    out += doc_figures.claims()
    out += [(EVIDENCE_DOC, row) for row in main_table_rows(table)]
    out += [(EVIDENCE_DOC, line) for line in per_seed_lines()]
    out.append((EVIDENCE_DOC, floor_lift()))
    lo, hi, floored, updates = eligible_range()
    out.append((EVIDENCE_DOC, f"{lo}-{hi} eligible tokens"))
    out.append((EVIDENCE_DOC, f"{floored} of the {updates} updates"))
    nz = {n: mean_ci([r["share_nonzero_adv"] for r in _runs(n)])[0] for n in ("d1s_cross", "grpo")}
    out.append(
        (
            EVIDENCE_DOC,
            f"A != 0 is {nz['d1s_cross']:.2f} of its kept rollouts against "
            f"{nz['grpo']:.2f} of GRPO's",
        )
    )
    pods = paired_difference(_runs("pods"), _runs("grpo_m2"))
    out.append(
        (
            EVIDENCE_DOC,
            "PODS minus `grpo_m2`, same seed: "
            f"{_pm((pods['mean'], pods['half_width']), sign=True)}",
        )
    )
    elig = paired_difference(_runs("d3s_eligible_m0", range(3)), _runs("d3s_m0", range(3)))
    out.append((EVIDENCE_DOC, f"({_pm((elig['mean'], elig['half_width']), sign=True)}, same seed)"))
    tv = timing["variants"]
    ratio = (
        tv["d3s"]["step_time"][0] / tv["grpo"]["step_time"][0],
        tv["d1s_cross"]["step_time"][0] / tv["grpo"]["step_time"][0],
    )
    out.append(
        (
            EVIDENCE_DOC,
            f"A D3S step with the floor costs {ratio[0]:.2f} of a GRPO step here, a "
            f"`d1s_cross` step {ratio[1]:.2f}",
        )
    )
    out.append((EVIDENCE_DOC, f"after the same {timing['equal_time']:.0f} s of training"))
    share = table["variants"]["grpo"]["generation_share"][0]
    out.append(
        (
            EVIDENCE_DOC,
            f"~{share:.0%} of a GRPO step here, so no selection rule could make a step more than "
            f"~{1 / share:.1f}x faster",
        )
    )
    return out


def check() -> Dict[str, List[str]]:
    """{document: [claims it lacks]}"""
    missing: Dict[str, List[str]] = {}
    for doc, text in claims():
        # Line breaks of the Markdown source are spaces to a reader.
        # (and a shell command's continued lines one line)
        body = (REPO / doc).read_text().replace("\\\n", " ")
        if " ".join(text.split()) not in " ".join(body.split()):
            missing.setdefault(doc, []).append(text)
    return missing


if __name__ == "__main__":
    missing = check()
    for doc, text in claims():
        print(("MISSING  " if text in missing.get(doc, []) else "ok       ") + f"{doc}: {text}")
    sys.exit(1 if missing else 0)
