"""The dry-run table in docs/scaling.md is what the dry run prints: every figure of every
recipe's row equals the plan of that recipe at its cluster shape (GB = 1e9 bytes, one
decimal), at the busiest GPU, so a change to the memory model or a recipe cannot leave the
table stale."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_d3s.dry_run import JobShape, plan
from nemo_d3s.train import compose_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "scaling.md"
GB = 1e9
COLUMNS = [
    "weights",
    "grads",
    "optimizer",
    "activations",
    "vllm",
    "train_peak",
    "refit_peak",
    "generation_peak",
]


def _rows():
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(
            r"\| (\w+) \((\d+) x (\d+)\)[^|]*\|[^|]*\| ([\d.]+)B \|(.*)\| (fits|does not fit) \|$",
            line,
        )
        if m:
            cells = [c.strip() for c in m.group(5).split("|")]
            figures = [float(c.split()[0]) for c in cells]
            rows[m.group(1)] = (
                int(m.group(2)),
                int(m.group(3)),
                float(m.group(4)),
                figures,
                m.group(6),
            )
    return rows


ROWS = _rows()


def test_the_table_lists_every_vllm_recipe():
    assert set(ROWS) == {
        "llama3_8b",
        "qwen25_math_7b",
        "llama3_70b",
        "qwen25_72b",
        "llama3_70b_long",
        "llama3_70b_32k",
        "qwen3_32b",
    }


@pytest.mark.parametrize("name", sorted(ROWS))
def test_row_equals_the_dry_run(name, tmp_path):
    nodes, gpus, params_b, figures, verdict = ROWS[name]
    report = plan(
        compose_config([f"experiment={name}", f"output_dir={tmp_path}"]),
        JobShape(nodes, gpus, "test"),
    )
    busiest = max(report["positions"], key=lambda p: p["peak_bytes"])
    assert busiest["peak_bytes"] == report["worst"]["peak_bytes"]
    t = busiest["terms_bytes"]
    got = [
        t["weights"],
        t["grads"],
        t["optimizer"],
        t["activations"],
        t["vllm"],
        busiest["train_peak_bytes"],
        busiest["refit_peak_bytes"],
        busiest["generation_peak_bytes"],
    ]
    assert [round(g / GB, 1) for g in got] == figures, dict(zip(COLUMNS, got))
    assert round(busiest["params"] / 1e9, 2) == params_b
    assert (verdict == "fits") == report["fits"]


def _plan_busiest(name, tmp_path, *overrides):
    nodes, gpus = ROWS[name][:2]
    report = plan(
        compose_config([f"experiment={name}", f"output_dir={tmp_path}", *overrides]),
        JobShape(nodes, gpus, "test"),
    )
    return report, max(report["positions"], key=lambda p: p["peak_bytes"])


def test_generation_peaks_with_the_cache_kept_are_the_dry_runs(tmp_path):
    """ "with the last update's blocks still reserved it would be A / B / ... GB": the busiest
    GPU's ``generation_peak_if_cache_kept_bytes`` of each recipe, in the table's order."""
    text = " ".join(DOC.read_text().split())
    m = re.search(r"still reserved it would be ([\d. /]+) GB", text)
    assert m, "the sentence on the generation peak with the cache kept is gone"
    quoted = [float(x) for x in m.group(1).split(" / ")]
    order = [
        re.match(r"\| (\w+) \(", line).group(1)
        for line in DOC.read_text().splitlines()
        if re.match(r"\| (\w+) \((\d+) x (\d+)\)", line)
    ]
    got = [
        round(_plan_busiest(n, tmp_path)[1]["generation_peak_if_cache_kept_bytes"] / GB, 1)
        for n in order
    ]
    assert quoted == got, dict(zip(order, got))


def test_the_long_recipe_without_sequence_parallelism_is_the_dry_runs(tmp_path):
    """ "without sequence parallelism ... need X GB of activations on stage 0 and the dry run
    says Y GB, does not fit"."""
    text = " ".join(DOC.read_text().split())
    m = re.search(
        r"without sequence parallelism the same 32768-token micro-batches need ([\d.]+) GB of "
        r"activations on stage 0 and the dry run says ([\d.]+) GB, does not fit",
        text,
    )
    assert m, "the sentence on llama3_70b_long without SP is gone"
    report, _ = _plan_busiest("llama3_70b_long", tmp_path, "model.params.sequence_parallel=false")
    stage0 = max(
        (p for p in report["positions"] if p["pp_rank"] == 0),
        key=lambda p: p["terms_bytes"]["activations"],
    )
    assert not report["fits"]
    assert float(m.group(1)) == round(stage0["terms_bytes"]["activations"] / GB, 1)
    assert float(m.group(2)) == round(report["worst"]["peak_bytes"] / GB, 1)


@pytest.mark.parametrize("name", ["llama3_70b", "qwen25_72b"])
def test_the_idle_gpus_while_generating_are_the_dry_runs(name, tmp_path):
    """ "they leave X of Y GPUs without an engine while generating (E engines per Z-GPU model
    copy)", and with one engine per copy "would leave X1 of Y GPUs waiting"."""
    text = " ".join(DOC.read_text().split())
    m = re.search(
        r"they leave (\d+) of (\d+) GPUs without an engine while generating "
        r"\((\d+) engines per (\d+)-GPU model copy\)",
        text,
    )
    m1 = re.search(r"would leave (\d+) of (\d+) GPUs waiting while generating", text)
    assert m and m1, "the sentences on the GPUs without an engine are gone"
    nodes, gpus = ROWS[name][:2]
    report, _ = _plan_busiest(name, tmp_path)
    v, layout = report["vllm"], report["layout"]
    copy, per = layout["tp"] * layout["pp"], int(report["layout"]["rollout_engines_per_copy"])
    assert [int(x) for x in m.groups()] == [v["gpus_idle_in_generation"], nodes * gpus, per, copy]
    assert v["engines"] == nodes * gpus // copy * per
    one, _ = _plan_busiest(name, tmp_path, "model.params.rollout_engines_per_copy=1")
    assert [int(x) for x in m1.groups()] == [one["vllm"]["gpus_idle_in_generation"], nodes * gpus]


def test_the_overlapped_70b_step_is_the_dry_runs(tmp_path):
    """The paragraph on ``llama3_70b_async``: its training peak, the step model's seconds and
    GPU-seconds for the engines apart (synchronous, k = 1) and ``llama3_70b``'s colocated step."""
    text = " ".join(DOC.read_text().split())
    m = re.search(
        r"No training GPU carries an engine: ([\d.]+) GB peak\. .*?generation ([\d.]+) s, "
        r"training ([\d.]+) s, a step of ([\d.]+) s synchronous or ([\d.]+) s overlapped on "
        r"(\d+) GPUs, ([\d,]+) or ([\d,]+) GPU-seconds; `llama3_70b`'s colocated synchronous "
        r"step is ([\d.]+) s on (\d+) GPUs \(([\d,]+) GPU-seconds: its engines at 0\.4 of a GPU "
        r"hold (\d+) of the (\d+) rollouts each, (\d+) waves\)",
        text,
    )
    assert m, "the paragraph on llama3_70b_async is gone"
    got = [float(x.replace(",", "")) for x in m.groups()]
    apart = plan(
        compose_config(["experiment=llama3_70b_async", f"output_dir={tmp_path}"]),
        JobShape(8, 8, "test"),
    )
    sync, k1 = apart["step_model"]["layouts"]
    coloc_report, _ = _plan_busiest("llama3_70b", tmp_path)
    (coloc,) = coloc_report["step_model"]["layouts"]
    v = coloc_report["vllm"]
    want = [
        round(apart["worst"]["peak_bytes"] / GB, 1),
        round(sync["generation_s"], 1),
        round(sync["training_s"], 1),
        round(sync["step_s"], 1),
        round(k1["step_s"], 1),
        sync["gpus"],
        round(sync["gpu_seconds"]),
        round(k1["gpu_seconds"]),
        round(coloc["step_s"], 1),
        coloc["gpus"],
        round(coloc["gpu_seconds"]),
        v["full_sequences"],
        v["rows_per_engine_step"],
        -(-v["rows_per_engine_step"] // v["full_sequences"]),
    ]
    assert got == want
