"""Every figure the README and docs/evidence.md quote from a run, rendered from the committed
records, so the text cannot drift from them (``tests/test_doc_numbers.py`` checks that each
rendered line occurs in its document).

    python benchmarks/doc_numbers.py          # print each claim and whether its document has it

Records read (all committed under ``benchmarks/results/``):

- ``cpu_default/main_job.json`` (``record_main_job.py summarize`` of the 30-step main job's
  records beside it) and ``cpu_default/memory_disk.json`` (``record_main_job.py run`` of a
  2-step run of the same job: peak memory and the size of a checkpoint and of the export);
- ``evidence/table.json`` and ``evidence/timing/table.json`` (``compare_presets.py``'s
  summaries) and ``evidence/runs/*/`` (per-run metrics and evals), re-read here with
  ``compare_presets.load_run`` / ``paired_difference`` / ``mean_ci``, the functions that
  wrote the tables.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare_presets import load_run, mean_ci, paired_difference  # noqa: E402

REPO = HERE.parent
RESULTS = HERE / "results"
EVIDENCE = RESULTS / "evidence"
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
        {**load_run(EVIDENCE / "runs" / f"{name}_s{s}"), "seed": s}
        for s in seeds
        if (EVIDENCE / "runs" / f"{name}_s{s}" / "summary.json").is_file()
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
        for line in (EVIDENCE / "runs" / f"d3s_s{s}" / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if not r.get("skipped"):
                rows.append(r)
    later = [r["n_eligible_tokens"] for r in rows if r["step"] >= 5]
    floored = sum(r["n_kept_tokens"] == 256 < r["n_eligible_tokens"] for r in rows)
    return int(min(later)), int(max(later)), floored, len(rows)


def claims() -> List[Tuple[str, str]]:
    """(document, text it must contain), every text rendered from a record."""
    out: List[Tuple[str, str]] = []
    main = _json(RESULTS / "cpu_default" / "main_job.json")
    mem = _json(RESULTS / "cpu_default" / "memory_disk.json")
    table = _json(EVIDENCE / "table.json")
    timing = _json(EVIDENCE / "timing" / "table.json")
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
    timing_v = _json(EVIDENCE / "timing" / "table.json")["variants"]
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
        if " ".join(text.split()) not in " ".join((REPO / doc).read_text().split()):
            missing.setdefault(doc, []).append(text)
    return missing


if __name__ == "__main__":
    missing = check()
    for doc, text in claims():
        print(("MISSING  " if text in missing.get(doc, []) else "ok       ") + f"{doc}: {text}")
    sys.exit(1 if missing else 0)
